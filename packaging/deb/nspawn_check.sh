#!/usr/bin/env bash
# Runs the packaged unit under a real systemd: a Debian bookworm rootfs (mmdebstrap, with
# systemd, dbus and redis-server) booted with `systemd-nspawn --boot` on a private network
# (loopback only, so its redis-server on 6379 is its own), the .deb that build.sh made
# installed inside, and a slow command job in /srv/app. It checks, in this order:
#   1. `systemctl start playguard` returns only once READY=1 came (the process is already in
#      Redis's `processes` when it returns) and the unit is active/running;
#   2. `systemctl stop` sends TERM: the running job is back in queue:default with
#      interrupted_count 1, playguard exited 0, and the stop took less than TimeoutStopSec;
#   3. `systemctl kill --kill-whom=main -s TSTP playguard` quiets it, nothing else stops: the Busy page's `quiet` is true, /ready 503;
#   4. a SIGSTOPped worker misses its watchdog, systemd kills and restarts it, and the
#      restarted worker runs the job again (recovered from the dead one's working list);
#   5. `journalctl -u playguard` carries SYSLOG_IDENTIFIER=playguard and each line's level as
#      PRIORITY (an unparseable payload's ERROR line is PRIORITY=3).
# Every step has a deadline, the whole run a time bound (NSPAWN_LIMIT seconds, default 600),
# and the machine is powered off and its rootfs removed on every exit, failures included.
# The rootfs tarball is cached in NSPAWN_CACHE (default ~/.cache/playguard-nspawn); the first
# run needs Debian's mirror (mmdebstrap), later ones no network at all.
# Run as root, after `bash packaging/deb/build.sh`. Needs systemd-nspawn (systemd-container),
# mmdebstrap (first run) and nsenter; systemd on the host is not needed (machined neither:
# the machine is driven with nsenter into its PID 1's namespaces).
# NSPAWN_MACHINE names the machine (default pg-nspawn-<pid>); STOP_T is the -t the unit runs
# with (default 5; the unit's TimeoutStopSec=40 is left as shipped).
set -euo pipefail
if [ -z "${NSPAWN_TIMED:-}" ]; then
  NSPAWN_TIMED=1 exec timeout -k 20 "${NSPAWN_LIMIT:-600}" "$0" "$@"
fi
cd "$(dirname "$0")/../.."
machine=${NSPAWN_MACHINE:-pg-nspawn-$$}
cache=${NSPAWN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/playguard-nspawn}
stop_t=${STOP_T:-5}
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
deb=$(ls target/debian/playguard_"$version"-*.deb | head -1)
root=$(mktemp -d /var/tmp/"$machine".XXXXXX)
nspawn_pid=""
leader=""

log() { printf '== %s\n' "$*" >&2; }
fail() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }
cleanup() {
  local rc=$?
  if [ -n "$nspawn_pid" ] && kill -0 "$nspawn_pid" 2>/dev/null; then
    log "powering off $machine"
    [ -n "$leader" ] && nsenter -t "$leader" -a systemctl poweroff --no-block 2>/dev/null || true
    for _ in $(seq 300); do kill -0 "$nspawn_pid" 2>/dev/null || break; sleep 0.1; done
    # nspawn halts the machine on its first TERM and kills it at once on the second.
    kill -TERM "$nspawn_pid" 2>/dev/null && sleep 1 && kill -TERM "$nspawn_pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$nspawn_pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$nspawn_pid" 2>/dev/null || true
    wait "$nspawn_pid" 2>/dev/null || true
  fi
  if findmnt -rno TARGET | grep -q "^$root"; then
    findmnt -rno TARGET | grep "^$root" | sort -r | xargs -r umount -l || true
  fi
  rm -rf --one-file-system "$root"
  if [ "$rc" != 0 ] && [ -s "$root.console" ]; then tail -20 "$root.console" >&2; fi
  rm -f "$root.console"
  [ "$rc" = 0 ] && log "all checks passed" || log "failed (exit $rc); $machine is off, rootfs removed"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 124' TERM INT

# Polls a command until it succeeds or SECONDS seconds pass.
wait_for() {
  local secs=$1 what=$2; shift 2
  local end=$(($(date +%s) + secs))
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$end" ] || fail "no $what within ${secs}s"
    sleep 0.2
  done
}
inm() { nsenter -t "$leader" -a "$@"; }
rcli() { inm redis-cli "$@"; }
prop() { inm systemctl show -P "$1" playguard; }
now() { date +%s.%N; }
secs_since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }'; }

# The rootfs: cached tarball, else mmdebstrap from Debian's mirror.
tarball=$cache/bookworm.tar
# A directory left there by an earlier version of this script is not a cache.
[ -d "$tarball" ] && rm -rf "$tarball"
if [ ! -s "$tarball" ]; then
  mkdir -p "$cache"; rm -rf "$tarball.part"
  log "mmdebstrap bookworm -> $tarball"
  # --format=tar: mmdebstrap picks the format from the target's name, and ".part" is none it
  # knows, so without it the first run on a fresh machine wrote a directory (seen in .ci/run).
  mmdebstrap --variant=minbase --format=tar \
    --include=systemd,systemd-sysv,dbus,redis-server,curl,procps \
    bookworm "$tarball.part" http://deb.debian.org/debian
  mv "$tarball.part" "$tarball"
fi
tar -C "$root" -xf "$tarball"
cp "$deb" "$root/var/tmp/playguard.deb"

# The app: one slow command job, run as the service user in the unit's WorkingDirectory.
mkdir -p "$root/srv/app/jobs/bin"
printf '[[job]]\nclass = "SlowJob"\nrun = ["jobs/bin/slow"]\n' > "$root/srv/app/jobs/app.toml"
printf '#!/bin/sh\necho "start $$" >> ledger.log\nsleep 300\necho "end $$" >> ledger.log\n' \
  > "$root/srv/app/jobs/bin/slow"
chmod 755 "$root/srv/app/jobs/bin/slow"
log "installing $(basename "$deb") in the rootfs"
systemd-nspawn -q -D "$root" --private-network --register=no --keep-unit sh -c \
  'dpkg -i /var/tmp/playguard.deb && chown -R playguard:playguard /srv/app'
sed -i 's/^#\?REDIS_URL=.*/REDIS_URL=redis:\/\/127.0.0.1:6379\/0/' "$root/etc/default/playguard"
sed -i "s/^PLAYGUARD_ARGS=.*/PLAYGUARD_ARGS=-q default -c 2 -t $stop_t --metrics-addr 127.0.0.1:9394/" \
  "$root/etc/default/playguard"

log "booting $machine"
systemd-nspawn --boot -D "$root" --machine="$machine" --private-network --register=no \
  --keep-unit --console=passive > "$root.console" 2>&1 &
nspawn_pid=$!
wait_for 30 "container init" pgrep -P "$nspawn_pid" -x systemd
leader=$(pgrep -P "$nspawn_pid" -x systemd)
wait_for 60 "booted system" sh -c \
  "nsenter -t $leader -a systemctl is-system-running | grep -qE '^(running|degraded)$'"
inm systemctl --failed --no-pager --no-legend | sed "s/^/failed unit at boot: /" >&2 || true
wait_for 30 "redis-server" sh -c "nsenter -t $leader -a redis-cli ping | grep -q PONG"
ledger=$root/srv/app/ledger.log
starts() { grep -c '^start' "$ledger" 2>/dev/null || true; }
has_starts() { [ "$(starts)" -ge "$1" ]; }

log "1. systemctl start returns after READY=1"
t0=$(now)
inm systemctl start playguard
took=$(secs_since "$t0")
[ "$(prop ActiveState)/$(prop SubState)" = active/running ] || fail "not active/running"
n=$(rcli SCARD processes)
[ "$n" = 1 ] || fail "processes has $n members when start returned"
echo "start returned in ${took}s: $(prop ActiveState)/$(prop SubState), StatusText=$(prop StatusText), processes=$n"

log "2. systemctl stop: TERM, job back in its queue, under TimeoutStopSec"
jid=0123456789abcdef01234567
rcli LPUSH queue:default "{\"class\":\"SlowJob\",\"args\":[],\"jid\":\"$jid\",\"queue\":\"default\",\"retry\":true,\"created_at\":$(date +%s),\"enqueued_at\":$(date +%s)}" >/dev/null
wait_for 20 "slow job started" has_starts 1
t0=$(now)
inm systemctl stop playguard
took=$(secs_since "$t0")
limit=$(prop TimeoutStopUSec)
back=$(rcli LRANGE queue:default 0 -1)
echo "stop took ${took}s (TimeoutStopUSec=$limit); ExecMainCode=$(prop ExecMainCode) ExecMainStatus=$(prop ExecMainStatus) Result=$(prop Result)"
echo "queue:default: $back"
awk -v t="$took" 'BEGIN { exit !(t < 40) }' || fail "stop took ${took}s"
[ "$(prop ExecMainStatus)" = 0 ] || fail "playguard did not exit 0 on TERM"
echo "$back" | grep -q "\"jid\":\"$jid\"" || fail "job not back in queue:default"
echo "$back" | grep -q '"interrupted_count":1' || fail "no interrupted_count 1"
inm journalctl -u playguard --no-pager -o cat | grep -iE 'signal|TERM|shut|requeue' | tail -5

log "3. systemctl kill -s TSTP quiets it"
inm systemctl start playguard
wait_for 20 "job fetched again" has_starts 2
identity=$(rcli SMEMBERS processes)
# --kill-whom=main: without it systemctl kill signals every process of the unit, and TSTP's
# default action stops (freezes) the command guardian and the running commands.
inm systemctl kill --kill-whom=main -s TSTP playguard
wait_for 15 "quiet on the Busy page" sh -c \
  "nsenter -t $leader -a redis-cli HGET '$identity' quiet | grep -qx true"
ready=$(inm curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:9394/ready || true)
body=$(inm curl -s http://127.0.0.1:9394/ready || true)
echo "identity $identity: quiet=$(rcli HGET "$identity" quiet), /ready $ready ($body), StatusText=$(prop StatusText)"
[ "$ready" = 503 ] || fail "/ready answered $ready"
echo "the service user's processes after TSTP:"
inm ps -u playguard -o pid,stat,args
inm ps -u playguard -o stat= | grep -q T && fail "a process of the unit is stopped"

log "4. SIGSTOPped worker: watchdog, restart, job recovered"
inm systemctl restart playguard
wait_for 20 "job fetched after restart" has_starts 3
restarts=$(prop NRestarts)
main=$(prop MainPID)
t0=$(now)
inm kill -STOP "$main"
wait_for 40 "restart after the watchdog" sh -c \
  "[ \"\$(nsenter -t $leader -a systemctl show -P NRestarts playguard)\" -gt $restarts ]"
echo "restarted $(secs_since "$t0")s after SIGSTOP of $main; NRestarts=$(prop NRestarts), new MainPID=$(prop MainPID)"
inm journalctl -u playguard --no-pager -o short-monotonic | grep -iE 'watchdog|abort|killing|restart' | tail -6
wait_for 30 "job run again by the restarted worker" has_starts 4
wait_for 20 "restarted unit active" sh -c \
  "[ \"\$(nsenter -t $leader -a systemctl show -P SubState playguard)\" = running ]"
echo "ledger: $(tr '\n' ' ' < "$ledger")"
inm journalctl -u playguard --no-pager -o cat | grep -iE 'recover' | tail -3

log "5. journal fields"
# An unparseable payload: playguard keeps it in dead with an ERROR line, which must reach the
# journal as PRIORITY=3 (src/logging/journal.rs writes the <3> prefix journald reads).
rcli LPUSH queue:default '{not json' >/dev/null
wait_for 20 "ERROR line at PRIORITY=3 in the journal" sh -c \
  "nsenter -t $leader -a journalctl -u playguard -o export --no-pager _COMM=playguard | grep -qx PRIORITY=3"
inm journalctl -u playguard -o verbose --no-pager _COMM=playguard | \
  grep -E '^ *(PRIORITY|SYSLOG_IDENTIFIER|MESSAGE)=' | tail -9
# Captured once: grep -q would close the pipe early and pipefail would count journalctl's EPIPE.
export_lines=$(inm journalctl -u playguard -o export --no-pager _COMM=playguard)
prios=$(sed -n 's/^PRIORITY=//p' <<< "$export_lines" | sort | uniq -c | tr '\n' ' ')
echo "PRIORITY counts among playguard's own lines: $prios"
grep -qx 'SYSLOG_IDENTIFIER=playguard' <<< "$export_lines" || fail "no SYSLOG_IDENTIFIER=playguard"
inm systemctl stop playguard

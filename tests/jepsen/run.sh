#!/bin/bash
# Jepsen-style bed for issue 37: three Redis hosts (redis-server + sentinel each, quorum 2),
# worker hosts each running one `playguard run` against the Sentinel set, one PostgreSQL
# host, all network namespaces named pgj* on one bridge. A seeded fault schedule runs while
# Marquee cycles write fenced rows; check.sql gives the verdict from PostgreSQL alone.
# Needs root (namespaces), redis-server, PostgreSQL server binaries, psql, iproute2.
# Usage: tests/jepsen/run.sh --seconds N --fence database|redis --seed S [--recipe row|fences]
#        [--marquees M] [--workers W] [--server redis|valkey] [--rate R] [--faults k1,k2,..]
#        [--rounds N] (the fault list N times over)
#        [--keep DIR]
# --recipe row: docs/fencing.md's UPDATE ... WHERE fence <= $fence; fences: also requires
# playguard_fences to still hold the fence (phase.sh), --fence database only.
set -u
SECONDS_RUN=60 FENCE=database SEED=1 RECIPE=row MARQUEES=200 WORKERS=3 KEEP=${TMPDIR:-/tmp}/jepsen-kept
ROUNDS=1 SERVER=redis RATE=5 FAULTS=partition,kill-primary,failover,pause-worker,netem,clock-redis,clock-worker
while [ $# -gt 0 ]; do
  case $1 in
    --seconds) SECONDS_RUN=$2; shift 2 ;;
    --fence) FENCE=$2; shift 2 ;;
    --seed) SEED=$2; shift 2 ;;
    --recipe) RECIPE=$2; shift 2 ;;
    --marquees) MARQUEES=$2; shift 2 ;;
    --workers) WORKERS=$2; shift 2 ;;
    --keep) KEEP=$2; shift 2 ;;
    --server) SERVER=$2; shift 2 ;;
    --rate) RATE=$2; shift 2 ;;
    --faults) FAULTS=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
case $FENCE in database|redis) ;; *) echo "--fence database|redis" >&2; exit 2 ;; esac
case $FENCE/$RECIPE in */row|database/fences) ;; *) echo "--recipe row, or fences with --fence database" >&2; exit 2 ;; esac
case $SERVER in redis|valkey) ;; *) echo "--server redis|valkey" >&2; exit 2 ;; esac
SRV=$SERVER-server
command -v "$SRV" >/dev/null || { echo "$SRV not found" >&2; exit 2; }
LIBFAKETIME=$(ls /usr/lib/*/faketime/libfaketime.so.1 2>/dev/null | head -1)
[ -n "$LIBFAKETIME" ] || { echo "libfaketime not found (Debian's faketime)" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "run.sh needs root (it creates network namespaces)" >&2; exit 2; }
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
BIN=${PLAYGUARD_BIN:-$REPO/target/debug/playguard}
[ -x "$BIN" ] || { echo "no playguard binary at $BIN (cargo build)" >&2; exit 2; }
PGBIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
[ -x "$PGBIN/initdb" ] || { echo "PostgreSQL server binaries not found" >&2; exit 2; }
P=pgj$$                       # every namespace: ${P}hub ${P}r1.. ${P}w1.. ${P}db
T=$(mktemp -d "${TMPDIR:-/tmp}/pgj.XXXXXX"); chmod 755 "$T"
NET=10.213.0
DB="postgres://postgres@$NET.30:5432/postgres?sslmode=disable"
RANDOM=$SEED

cleanup() {
  set +e
  for ns in $(ip netns list | awk '{print $1}' | grep "^$P"); do
    for pid in $(ip netns pids "$ns"); do kill -CONT "$pid" 2>/dev/null; kill -KILL "$pid" 2>/dev/null; done
  done
  for ns in $(ip netns list | awk '{print $1}' | grep "^$P"); do ip netns del "$ns"; done
  rm -rf "$T"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

in_ns() { local ns=$1; shift; ip netns exec "$P$ns" "$@"; }
say() { printf '%s %s\n' "$(date -u +%H:%M:%S)" "$*"; }

# --- network: one bridge in ${P}hub, a veth from every host to it --------------------------
ip netns add "${P}hub"; ip -n "${P}hub" link add br0 type bridge; ip -n "${P}hub" link set br0 up
HOSTS="r1:11 r2:12 r3:13 db:30"
for i in $(seq 1 "$WORKERS"); do HOSTS="$HOSTS w$i:2$i"; done
for h in $HOSTS; do
  n=${h%%:*} a=${h##*:}
  ip netns add "$P$n"; ip -n "$P$n" link set lo up
  ip -n "$P$n" link add eth0 type veth peer name "p$n" netns "${P}hub"
  ip -n "$P$n" addr add "$NET.$a/24" dev eth0; ip -n "$P$n" link set eth0 up
  ip -n "${P}hub" link set "p$n" master br0; ip -n "${P}hub" link set "p$n" up
done
# netem needs the kernel's sch_netem; without it (this sandbox's kernel) the slow-link fault
# uses tbf.
NETEM=0; ip netns exec "${P}hub" tc qdisc add dev lo root netem delay 1ms 2>/dev/null && NETEM=1
addr() { for h in $HOSTS; do [ "${h%%:*}" = "$1" ] && echo "$NET.${h##*:}"; done; }

# --- PostgreSQL on ${P}db, as nobody ---------------------------------------------------------
mkdir "$T/pg"; chown nobody:nogroup "$T/pg"
setpriv --reuid=nobody --regid=nogroup --clear-groups -- "$PGBIN/initdb" -D "$T/pg/data" -U postgres \
  -A trust --no-sync -E UTF8 >/dev/null || exit 1
echo "host all all $NET.0/24 trust" >> "$T/pg/data/pg_hba.conf"
in_ns db setpriv --reuid=nobody --regid=nogroup --clear-groups -- "$PGBIN/postgres" -D "$T/pg/data" \
  -c listen_addresses="$NET.30" -c unix_socket_directories="$T/pg" -c fsync=off \
  -c synchronous_commit=off -c max_connections=200 >"$T/pg.log" 2>&1 &
psql_db() { in_ns db psql -X -q -A -t -v ON_ERROR_STOP=1 -d "$DB" "$@"; }
for _ in $(seq 100); do psql_db -c 'SELECT 1' >/dev/null 2>&1 && break; sleep 0.1; done
psql_db -f "$HERE/schema.sql" >/dev/null || { echo "PostgreSQL did not start" >&2; exit 1; }
psql_db -c "INSERT INTO jepsen_marquees (id) SELECT g::text FROM generate_series(1, $MARQUEES) g"

# --- Redis hosts: redis-server + sentinel each; r1 starts as the primary ---------------------
# Every Redis server and worker has its own wall-clock offset file (+0 until a clock fault
# writes it; re-read at most once a second); monotonic clocks stay real. Workers run under
# libfaketime; Redis servers under clockshift.c, since they hang at start under libfaketime
# (see that file). Commands the workers run get the real clock (env -u LD_PRELOAD).
FAKED=(LD_PRELOAD="$LIBFAKETIME" FAKETIME_CACHE_DURATION=1 DONT_FAKE_MONOTONIC=1)
cc -shared -fPIC -O2 -o "$T/clockshift.so" "$HERE/clockshift.c" || { echo "cannot build clockshift.c" >&2; exit 2; }
start_redis() {  # $1 = r1|r2|r3; a restarted server comes up empty and Sentinel reconfigures it
  local n=$1 a; a=$(addr "$n"); mkdir -p "$T/$n"
  local extra=(); [ "$n" != r1 ] && [ ! -e "$T/$n/started" ] && extra=(--replicaof "$NET.11" 6379)
  touch "$T/$n/started"; [ -e "$T/$n/clock" ] || echo +0 > "$T/$n/clock"
  ( in_ns "$n" env LD_PRELOAD="$T/clockshift.so" CLOCKSHIFT_FILE="$T/$n/clock" "$SRV" --port 6379 --bind "$a" --protected-mode no --save '' --appendonly no \
    --dir "$T/$n" "${extra[@]}" >>"$T/$n/redis.log" 2>&1 &
  # ip netns exec and env exec in place: this is redis-server's PID. In a subshell, so its
  # SIGKILL is not reported as a job of this script.
  echo $! > "$T/$n/redis.pid" )
}
for n in r1 r2 r3; do start_redis "$n"; done
for n in r1 r2 r3; do
  a=$(addr "$n")
  printf 'port 26379\nbind %s\nprotected-mode no\ndaemonize no\ndir %s\nsentinel resolve-hostnames no\nsentinel monitor jep %s 6379 2\nsentinel down-after-milliseconds jep 1000\nsentinel failover-timeout jep 5000\nsentinel parallel-syncs jep 1\n' \
    "$a" "$T/$n" "$NET.11" > "$T/$n/sentinel.conf"
  in_ns "$n" "$SRV" "$T/$n/sentinel.conf" --sentinel >"$T/$n/sentinel.log" 2>&1 &
done
rcli() { local n=$1 port=$2; shift 2; in_ns "$n" redis-cli -h "$(addr "$n")" -p "$port" "$@"; }
primary() {  # the host the majority of sentinels names (asked from r2, then r3)
  local ip; for n in r2 r3 r1; do
    ip=$(rcli "$n" 26379 SENTINEL get-master-addr-by-name jep 2>/dev/null | head -1)
    [ -n "$ip" ] && { for h in r1 r2 r3; do [ "$(addr $h)" = "$ip" ] && echo "$h"; done; return; }
  done
}
for _ in $(seq 100); do [ "$(rcli r1 6379 PING 2>/dev/null)" = PONG ] && break; sleep 0.1; done
[ "$(rcli r1 6379 PING 2>/dev/null)" = PONG ] || { echo "redis-server on r1 did not start" >&2; exit 1; }
for _ in $(seq 100); do
  [ "$(rcli r1 26379 SENTINEL master jep 2>/dev/null | sed -n '/^num-other-sentinels$/{n;p}')" = 2 ] &&
  [ "$(rcli r1 26379 SENTINEL master jep 2>/dev/null | sed -n '/^num-slaves$/{n;p}')" = 2 ] && break
  sleep 0.2
done
seq 1 "$MARQUEES" | sed 's/^/SADD jepsen:marquees /' | rcli r1 6379 >/dev/null
seq 1 20 | sed 's/^/SADD jepsen:tickers t/' | rcli r1 6379 >/dev/null

# --- workers ---------------------------------------------------------------------------------
mkdir -p "$T/project/jobs"
cat > "$T/project/jobs/jepsen.toml" <<TOML
[[job]]
class = "MarqueeCycle"
lock = { key = "jepsen:marquee:{args.0}", ttl_secs = 3, label = "Marquee {args.0}", fence = "$FENCE" }
[[job.phase]]
name = "observe"
run = ["/usr/bin/env", "-u", "LD_PRELOAD", "$HERE/phase.sh"]
[[job.phase]]
name = "apply"
run = ["/usr/bin/env", "-u", "LD_PRELOAD", "$HERE/phase.sh"]

[[job]]
class = "PlainJob"
run = ["/usr/bin/env", "-u", "LD_PRELOAD", "$HERE/plain.sh"]

[[job]]
class = "TickProbe"
run = ["/usr/bin/env", "-u", "LD_PRELOAD", "$HERE/tick.sh"]

[[periodic]]
name = "jepsen-dispatch"
every_secs = 10
class = "MarqueeCycle"
queue = "marquees"
for_each_member_of = "jepsen:marquees"

[[periodic]]
name = "jepsen-ticks"
every_secs = 10
class = "TickProbe"
queue = "ticks"
for_each_member_of = "jepsen:tickers"
TOML
start_worker() {  # worker i asks the sentinels starting with r_i's, so w1 follows r1 when cut off
  local i=$1 order
  case $i in 1) order="11 12 13" ;; 2) order="12 13 11" ;; *) order="13 11 12" ;; esac
  local url="redis-sentinel://"; for o in $order; do url="$url$NET.$o:26379,"; done
  url="${url%,}#jep"
  [ -e "$T/w$i.clock" ] || echo +0 > "$T/w$i.clock"
  (cd "$T/project" && JEPSEN_DB="$DB" JEPSEN_HOST="w$i" JEPSEN_RECIPE="$RECIPE" in_ns "w$i" \
    env "${FAKED[@]}" FAKETIME_TIMESTAMP_FILE="$T/w$i.clock" "$BIN" run -r "$url" \
    -j jobs -q marquees,4 -q plain,1 -q ticks,1 -c 8 -t 5 --database-url "$DB" >>"$T/w$i.log" 2>&1) &
}
for i in $(seq 1 "$WORKERS"); do start_worker "$i"; done

# --- the fault schedule: seeded, printed before it runs --------------------------------------
# Each round runs every kind once, in a seeded order.
IFS=, read -r -a ONE <<< "$FAULTS"; KINDS=()
for _ in $(seq 1 "$ROUNDS"); do KINDS+=("${ONE[@]}"); done; NK=${#KINDS[@]}
for k in "${KINDS[@]}"; do case $k in
  partition|kill-primary|failover|pause-worker|netem|clock-redis|clock-worker) ;;
  *) echo "unknown fault $k" >&2; exit 2 ;; esac; done
for k in $(seq 0 $((NK - 1))); do j=$((RANDOM % NK)); t=${KINDS[$k]}; KINDS[$k]=${KINDS[$j]}; KINDS[$j]=$t; done
SLOT=$(( (SECONDS_RUN - 10) / NK ))
[ "$SLOT" -ge 7 ] || { echo "--seconds must be at least $((10 + 7 * NK)) for $NK faults" >&2; exit 2; }
PLAN=()
for k in $(seq 0 $((NK - 1))); do
  at=$(( 5 + k * SLOT + RANDOM % 2 )); hold=$(( 4 + RANDOM % (SLOT - 5) ))
  w=$(( 1 + RANDOM % WORKERS )); PLAN+=("$at ${KINDS[$k]} $hold w$w")
done
say "jepsen: seed $SEED, $SERVER, fence $FENCE, recipe $RECIPE, $MARQUEES Marquees, $WORKERS workers, $RATE plain pushes/s, ${SECONDS_RUN}s"
say "schedule (at-second kind hold-seconds worker):"; printf '  %s\n' "${PLAN[@]}"

cut() {  # blackhole routes both ways between the two sides ($1 and $2: host lists); $3 add|del
  local a b; for a in $1; do for b in $2; do
    ip -n "$P$a" route "$3" blackhole "$(addr "$b")/32"; ip -n "$P$b" route "$3" blackhole "$(addr "$a")/32"
  done; done
}
fault() {  # $1 kind, $2 hold, $3 worker
  local kind=$1 hold=$2 w=$3 p; p=$(primary)
  case $kind in
    partition)
      local others=""; for h in r1 r2 r3 $(seq -f 'w%g' 1 "$WORKERS"); do
        [ "$h" != "$p" ] && [ "$h" != w1 ] && others="$others $h"; done
      say "fault: partition {$p w1} | {$others } for ${hold}s"
      cut "$p w1" "$others" add; sleep "$hold"; cut "$p w1" "$others" del; say "healed" ;;
    kill-primary)
      say "fault: SIGKILL primary $p (redis-server), restart after ${hold}s"
      kill -KILL "$(cat "$T/$p/redis.pid")"
      sleep "$hold"; start_redis "$p"; say "restarted $p" ;;
    failover)
      say "fault: SENTINEL FAILOVER (primary was $p): $(rcli r2 26379 SENTINEL FAILOVER jep)"; sleep "$hold" ;;
    pause-worker)
      say "fault: SIGSTOP every process on $w for ${hold}s"
      local pids; pids=$(ip netns pids "$P$w"); kill -STOP $pids 2>/dev/null; sleep "$hold"; kill -CONT $pids 2>/dev/null; say "resumed $w" ;;
    netem)  # a slow, lossy link on the primary and on one worker: netem's delay and loss
            # where the kernel has it, else a token bucket (tbf) so narrow that packets queue
            # for up to 300 ms and the rest are dropped
      local q="netem delay 120ms 80ms loss 8%"; [ "$NETEM" = 1 ] || q="tbf rate 400kbit burst 4kb latency 300ms"
      say "fault: tc $q on $p and $w for ${hold}s"
      for h in "$p" "$w"; do ip netns exec "$P$h" tc qdisc add dev eth0 root $q; done
      sleep "$hold"; for h in "$p" "$w"; do ip netns exec "$P$h" tc qdisc del dev eth0 root; done; say "tc removed" ;;
    clock-redis)  # a replica's wall clock steps back and stays there: a later promotion hands
                  # out the Redis fence store's time-based fences from a clock behind the old one
      local r; for r in r1 r2 r3; do [ "$r" != "$p" ] && break; done
      local back=$(( 30 + RANDOM % 60 ))
      say "fault: clock of Redis host $r stepped back ${back}s (not corrected)"
      echo "-$back" > "$T/$r/clock"; sleep "$hold" ;;
    clock-worker)  # one worker's wall clock jumps ahead, then back (an NTP correction)
      local ahead=$(( 20 + RANDOM % 40 ))
      say "fault: clock of worker $w stepped ahead ${ahead}s for ${hold}s"
      echo "+$ahead" > "$T/$w.clock"; sleep "$hold"; echo +0 > "$T/$w.clock"; say "clock of $w back" ;;
  esac
}
START=$(date +%s)
# The Rails side: plain jobs pushed from the database host (it reaches both sides of a split).
SENTINELS="$NET.11:26379,$NET.12:26379,$NET.13:26379"
in_ns db python3 "$HERE/pusher.py" push "$SENTINELS" jep "$RATE" "$((SECONDS_RUN - 5))" "$T/pushed" &
PUSHER=$!
for e in "${PLAN[@]}"; do
  set -- $e
  while [ $(( $(date +%s) - START )) -lt "$1" ]; do sleep 0.2; done
  fault "$2" "$3" "$4"
done
while [ $(( $(date +%s) - START )) -lt "$SECONDS_RUN" ]; do sleep 0.5; done

# --- stop the workers, then the verdict -------------------------------------------------------
wait "$PUSHER"
say "stopping workers"
for i in $(seq 1 "$WORKERS"); do for pid in $(ip netns pids "${P}w$i"); do kill -TERM "$pid" 2>/dev/null; done; done
for _ in $(seq 150); do
  left=0; for i in $(seq 1 "$WORKERS"); do [ -n "$(ip netns pids "${P}w$i")" ] && left=1; done
  [ $left = 0 ] && break; sleep 0.2
done
p=$(primary)
say "Redis at the end (primary $p): queues marquees $(rcli "$p" 6379 LLEN queue:marquees) plain $(rcli "$p" 6379 LLEN queue:plain) ticks $(rcli "$p" 6379 LLEN queue:ticks), retry $(rcli "$p" 6379 ZCARD retry), dead $(rcli "$p" 6379 ZCARD dead)"
in_ns db python3 "$HERE/pusher.py" inventory "$(addr "$p")" 6379 "$T/in_redis" || { echo "inventory failed" >&2; exit 1; }
psql_db -c "\\copy jepsen_pushed FROM '$T/pushed' (DELIMITER ' ')" -c "\\copy jepsen_in_redis FROM '$T/in_redis'"
report=$(psql_db -P format=aligned -P tuples_only=off -v faults="${#PLAN[@]}" -f "$HERE/check.sql")
echo "$report"
# overlaps + fence regressions + lost rows + lost jobs (confirmed pushes neither run nor in
# Redis) + stale accepted writes
bad=$(psql_db -v faults=0 -f "$HERE/check.sql" | head -1 | awk -F'|' '{print $5 + $6 + $7 + $12 + $17}')
if [ "$bad" != 0 ]; then
  mkdir -p "$KEEP"; k="$KEEP/$(date -u +%Y%m%dT%H%M%S)-$FENCE-$RECIPE-seed$SEED-$$"; mkdir -p "$k"
  in_ns db setpriv --reuid=nobody --regid=nogroup --clear-groups -- "$PGBIN/pg_dump" -h "$T/pg" -U postgres postgres > "$k/history.sql"
  cp "$T"/w*.log "$k/" 2>/dev/null; printf '%s\n' "${PLAN[@]}" > "$k/schedule"
  say "INVARIANT BROKEN ($bad overlaps+regressions+lost rows+lost jobs+stale writes); history kept in $k"
  exit 1
fi
say "ok: no overlap, no stale write accepted, no fence regression, no row or confirmed job lost"

#!/usr/bin/env bash
# Installs the package build.sh made, checks what it put on the machine, and removes it:
# the installed binary runs (--version, `check` against a redis-server started here on a free
# loopback port and stopped by PID), the completions and man pages sit at their standard paths,
# `systemd-analyze verify` accepts the unit, and `dpkg -r` (then --purge, for the conffile)
# takes it all away again.
# Run as root (dpkg).
set -euo pipefail
cd "$(dirname "$0")/../.."
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
deb=$(ls target/debian/playguard_"$version"-*.deb | head -1)
tmp=$(mktemp -d)
redis_pid=""
cleanup() {
  [ -n "$redis_pid" ] && kill "$redis_pid" 2>/dev/null || true
  dpkg --purge playguard >/dev/null 2>&1 || true
  rm -rf "$tmp"
}
trap cleanup EXIT
dpkg -i "$deb"
dpkg -L playguard
test "$(/usr/bin/playguard --version)" = "playguard $version"
for f in /usr/share/bash-completion/completions/playguard \
         /usr/share/zsh/vendor-completions/_playguard \
         /usr/share/fish/vendor_completions.d/playguard.fish \
         /usr/share/man/man1/playguard.1.gz /usr/share/man/man1/playguard-run.1.gz \
         /usr/share/man/man1/playguard-locks.1.gz \
         /usr/lib/systemd/system/playguard.service /etc/default/playguard; do
  test -s "$f" || { echo "missing or empty: $f" >&2; exit 1; }
done
zcat /usr/share/man/man1/playguard.1.gz | grep -q '^\.TH playguard 1'
bash -c 'source /usr/share/bash-completion/completions/playguard && complete -p playguard'
# `playguard check` from the installed binary against a Redis of our own.
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$tmp" >/dev/null &
redis_pid=$!
mkdir -p "$tmp/app/jobs"
printf '[[job]]\nclass = "NoopJob"\nrun = ["true"]\n' > "$tmp/app/jobs/noop.toml"
for _ in $(seq 100); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
(cd "$tmp/app" && /usr/bin/playguard check -r "redis://127.0.0.1:$port/0")
kill "$redis_pid"; wait "$redis_pid" 2>/dev/null || true; redis_pid=""
# The unit as systemd reads it. verify fails on a missing ExecStart binary or man page, but
# only warns (exit 0) on an unknown key or a bad value, so any output at all fails here too.
# It is all this machine allows: without systemd as PID 1 the unit cannot be started.
unit=/usr/lib/systemd/system/playguard.service
verify=$(systemd-analyze verify "$unit" 2>&1) || { echo "$verify" >&2; exit 1; }
[ -z "$verify" ] || { echo "systemd-analyze verify $unit: $verify" >&2; exit 1; }
dpkg -r playguard
test ! -e /usr/bin/playguard && test ! -e /usr/lib/systemd/system/playguard.service
# -r keeps the conffile, as Debian does; purge it so the machine is as it was.
test -e /etc/default/playguard
dpkg --purge playguard
test ! -e /etc/default/playguard
echo "package checked: $(basename "$deb")"

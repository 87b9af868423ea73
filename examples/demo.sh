#!/usr/bin/env bash
# Runs playguard on real jobs: the six-phase reconcile cycle of jobs/playguard.toml for three
# Marquees, one of which is locked by "another worker" and so is skipped. Installs redis-server
# with apt-get when it is missing and starts a private one (port $PLAYGUARD_DEMO_PORT, default
# 6390, nothing saved to disk), so it never touches an app's Redis. Ends with a SIGTERM.
set -euo pipefail
cd "$(dirname "$0")/.."
sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
if ! command -v redis-server >/dev/null || ! command -v git >/dev/null; then
  $sudo apt-get update -qq && $sudo apt-get install -y -qq redis-server git
fi
port=${PLAYGUARD_DEMO_PORT:-6390}
url="redis://127.0.0.1:$port/0"
started_redis=""
if ! redis-cli -p "$port" ping >/dev/null 2>&1; then
  redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --daemonize yes \
    --pidfile "/tmp/playguard-demo-redis-$port.pid" >/dev/null
  for _ in $(seq 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
  started_redis=yes
fi
cargo build --release --quiet
pg=target/release/playguard
export PLAYGUARD_DEMO_DIR=${PLAYGUARD_DEMO_DIR:-$(mktemp -d)}
log="$PLAYGUARD_DEMO_DIR/worker.log"

# The Rails app keeps this set; the periodic dispatcher fans out over it every 60 s, and a
# process starting mid-minute dispatches the current tick at once (unless a peer already did:
# forget earlier demo runs' ticks, this Redis is the demo's own).
redis-cli -p "$port" del playguard:marquees:launchable >/dev/null
redis-cli -p "$port" sadd playguard:marquees:launchable 1 2 3 >/dev/null
redis-cli -p "$port" --scan --pattern 'playguard:periodic:*' | xargs -r redis-cli -p "$port" del >/dev/null
# Marquee 3 is mid-cycle on another worker: its lock is held, so our job for it is skipped.
redis-cli -p "$port" set playguard:marquee:3 another-worker PX 60000 >/dev/null

"$pg" run -r "$url" -q playguard -q default -c 5 -t 10 > "$log" 2>&1 &
worker=$!
trap 'kill -TERM $worker 2>/dev/null || true' EXIT

for _ in $(seq 300); do
  n=$(grep -c "cycle of Marquee [12] complete" "$log" || true)
  [ "$n" -ge 2 ] && grep -q "Marquee 3 is already locked" "$log" && break
  sleep 0.1
done
kill -TERM "$worker"; wait "$worker" || true; trap - EXIT
grep -E "starting|lock acquired|already locked|phase end|would run|complete|released|periodic|TERM|bye" "$log"
echo
echo "full log: $log"
if [ -n "$started_redis" ]; then
  redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true
  echo "stopped the demo's redis-server on port $port"
fi

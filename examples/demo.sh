#!/usr/bin/env bash
# Runs playguard on real jobs: the six-phase reconcile cycle of jobs/playguard.toml for three
# Marquees, one of which is locked by "another worker" and so is skipped. Installs redis-server
# with apt-get when it is missing and starts a private one (port $PLAYGUARD_DEMO_PORT, default
# 6390, nothing saved to disk), so it never touches an app's Redis. Fences and the cycle ledger
# live in PostgreSQL: $DATABASE_URL when set, else the machine's own server when one answers
# (pg_isready; the demo uses a database of its own there, playguard_demo), else a private
# cluster it creates with initdb in a temp dir (port $PLAYGUARD_DEMO_PG_PORT, default 5491) and
# stops at the end. Ends with a SIGTERM.
set -euo pipefail
cd "$(dirname "$0")/.."
sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
if ! command -v redis-server >/dev/null || ! command -v git >/dev/null; then
  $sudo apt-get update -qq && $sudo apt-get install -y -qq redis-server git
fi
pg_bindir() {
  if command -v initdb >/dev/null; then dirname "$(command -v initdb)"; return; fi
  ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1
}
if ! command -v psql >/dev/null || [ -z "$(pg_bindir)" ]; then
  $sudo apt-get update -qq && $sudo apt-get install -y -qq postgresql postgresql-client
fi
started_pg=""; pgdir=""
db_url=${DATABASE_URL:-}
if [ -z "$db_url" ] && pg_isready -q 2>/dev/null; then
  # The machine's PostgreSQL: a database of the demo's own, never the app's tables.
  for base in "postgresql:///DB?host=/var/run/postgresql" "postgresql://postgres@127.0.0.1:5432/DB"; do
    admin=${base/DB/postgres}
    psql -X -q -d "$admin" -c 'SELECT 1' >/dev/null 2>&1 || continue
    psql -X -q -A -t -d "$admin" -c "SELECT 1 FROM pg_database WHERE datname = 'playguard_demo'" | grep -q 1 \
      || psql -X -q -d "$admin" -c 'CREATE DATABASE playguard_demo' >/dev/null
    db_url=${base/DB/playguard_demo}
    echo "using the PostgreSQL that answers on this machine (database playguard_demo)"
    break
  done
fi
if [ -z "$db_url" ]; then
  pgport=${PLAYGUARD_DEMO_PG_PORT:-5491}
  pgdir=$(mktemp -d)
  as_pg=()
  if [ "$(id -u)" = 0 ]; then  # PostgreSQL refuses to run as root
    chown nobody:nogroup "$pgdir"; as_pg=(setpriv --reuid=nobody --regid=nogroup --clear-groups --)
  fi
  bindir=$(pg_bindir)
  "${as_pg[@]}" "$bindir/initdb" -D "$pgdir/data" -U postgres -A trust --no-sync >/dev/null
  "${as_pg[@]}" "$bindir/postgres" -D "$pgdir/data" -p "$pgport" -c listen_addresses=127.0.0.1 \
    -c unix_socket_directories="$pgdir" > "$pgdir/server.log" 2>&1 &
  started_pg=$!
  for _ in $(seq 100); do pg_isready -q -h 127.0.0.1 -p "$pgport" && break; sleep 0.1; done
  psql -X -q -d "postgres://postgres@127.0.0.1:$pgport/postgres" -c 'CREATE DATABASE playguard_demo' >/dev/null
  db_url="postgres://postgres@127.0.0.1:$pgport/playguard_demo?sslmode=disable"
  echo "started a private PostgreSQL on port $pgport (initdb in $pgdir)"
fi
export DATABASE_URL=$db_url
psql -X -q -v ON_ERROR_STOP=1 -d "$DATABASE_URL" -f examples/demo.sql
stop_pg() {
  if [ -n "$started_pg" ]; then
    kill -INT "$started_pg" 2>/dev/null || true; wait "$started_pg" 2>/dev/null || true
    rm -rf "$pgdir"; echo "stopped the demo's private PostgreSQL"
  fi
}
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
trap 'kill -TERM $worker 2>/dev/null || true; stop_pg' EXIT

for _ in $(seq 300); do
  n=$(grep -c "cycle of Marquee [12] complete" "$log" || true)
  [ "$n" -ge 2 ] && grep -q "Marquee 3 is already locked" "$log" && break
  sleep 0.1
done
kill -TERM "$worker"; wait "$worker" || true; trap - EXIT
grep -E "starting|PostgreSQL|lock acquired|already locked|phase end|would run|saved|complete|released|periodic|TERM|bye" "$log"
echo
echo "The Marquees' observed state, each written with its fence (UPDATE ... WHERE fence <= \$fence):"
psql -X -d "$DATABASE_URL" -c 'SELECT id, observed_playgrounds, fence FROM marquees ORDER BY id'
echo "The cycle ledger (playguard_cycles), newest first:"
psql -X -d "$DATABASE_URL" -c 'SELECT id, lock_key, fence, outcome, phase, finished_at - started_at AS took FROM playguard_cycles ORDER BY id DESC LIMIT 6'
echo "full log: $log"
stop_pg
if [ -n "$started_redis" ]; then
  redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true
  echo "stopped the demo's redis-server on port $port"
fi

#!/usr/bin/env bash
# Load-independent cost per job: the worker runs under `valgrind --tool=callgrind` while it drains
# a fixed number of no-op jobs; the figures are instructions per job (worker) and Redis commands
# per job (INFO commandstats deltas), which do not depend on what else the machine is doing.
# Start-up is not counted: the counters are zeroed once the worker is idle, then the jobs appear
# in the queue at once (RENAME of a staging list), and the counters are dumped once it drained.
# Its own redis-server on a free loopback port (never 6379), stopped by PID. Bounded in time.
#   bench/profile.sh                          # reliable fetch, 20,000 jobs, -c 50, RUST_LOG=info
#   FETCH=basic JOBS=5000 PG_LOG=warn bench/profile.sh
#   REDIS_CALLGRIND=1 bench/profile.sh         # redis-server under callgrind too: its instructions/job
#   RUSTY_BIN=target/release/rusty-bench PG_CONCURRENCY=25 bench/profile.sh   # rusty-sidekiq instead
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
cd "$root"
if [ -z "${SKIP_BUILD:-}" ]; then
  cargo build --release --example bench_worker
fi
bin="${PG_BIN:-${CARGO_TARGET_DIR:-$root/target}/release/examples/bench_worker}"
[ -x "$bin" ] || { echo "missing $bin" >&2; exit 1; }
port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
[ "$port" != 6379 ] || { echo "refusing port 6379" >&2; exit 1; }
out="${OUT_DIR:-$(mktemp -d /tmp/playguard-profile.XXXXXX)}"
wrap=()
[ -z "${REDIS_CALLGRIND:-}" ] || wrap=(valgrind --tool=callgrind "--callgrind-out-file=$out/redis.callgrind.%p")
"${wrap[@]}" redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --daemonize no \
  >"$out/redis.log" 2>&1 &
redis_pid=$!
trap 'kill "$redis_pid" 2>/dev/null || true; wait "$redis_pid" 2>/dev/null || true' EXIT
for _ in $(seq 1 200); do
  redis-cli -p "$port" ping >/dev/null 2>&1 && break
  sleep 0.05
done
REDIS_URL="redis://127.0.0.1:$port/0" PG_BIN="$bin" OUT_DIR="$out" REDIS_PID="$redis_pid" \
  timeout 1200 ruby "$here/profile.rb"

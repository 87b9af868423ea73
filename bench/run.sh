#!/usr/bin/env bash
# Benchmark: Ruby Sidekiq 6.4.1 vs playguard (reliable and basic fetch), one run, one machine.
# Starts its own redis-server on a free loopback port (never 6379), stops it by PID, and prints
# a table that is also written to bench/results.md. Bounded: the driver gives up after 15 min.
#   bench/run.sh                 # build the example, run everything
#   BENCH_JOBS=50000 PG_CONCURRENCY=25 bench/run.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
cd "$root"
if [ -z "${SKIP_BUILD:-}" ]; then
  cargo build --release --example bench_worker
fi
bin="${PG_BIN:-$root/target/release/examples/bench_worker}"
[ -x "$bin" ] || { echo "missing $bin" >&2; exit 1; }

port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
[ "$port" != 6379 ] || { echo "refusing port 6379" >&2; exit 1; }
out="$(mktemp -d /tmp/playguard-bench.XXXXXX)"
redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --daemonize no \
  >"$out/redis.log" 2>&1 &
redis_pid=$!
trap 'kill "$redis_pid" 2>/dev/null || true; wait "$redis_pid" 2>/dev/null || true' EXIT
for _ in $(seq 1 200); do
  redis-cli -p "$port" ping >/dev/null 2>&1 && break
  sleep 0.05
done
redis-cli -p "$port" ping >/dev/null

echo "redis-server $(redis-server --version | sed 's/.*v=\([^ ]*\).*/\1/') on 127.0.0.1:$port, logs in $out" >&2
REDIS_URL="redis://127.0.0.1:$port/0" PG_BIN="$bin" OUT_DIR="$out" \
  timeout 900 ruby "$here/driver.rb"

{
  echo "# Benchmark results"
  echo
  echo "Produced by \`bench/run.sh\` on $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) cores, $(uname -sr)," \
       "redis-server $(redis-server --version | sed 's/.*v=\([^ ]*\).*/\1/'), jobs ${BENCH_JOBS:-100000}."
  echo
  cat "$out/table.md"
} >"$here/results.md"
echo "written to bench/results.md" >&2

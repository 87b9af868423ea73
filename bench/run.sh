#!/usr/bin/env bash
# Benchmark: Ruby Sidekiq 6.4.1, rusty-sidekiq 0.15.2 and playguard (reliable and basic fetch),
# each quiet and at INFO, in one run on one machine: ROUNDS (3) interleaved rounds, medians with
# min-max. Starts its own redis-server on a free loopback port (never 6379), stops it by PID,
# and prints the tables, also written to bench/results.md. Bounded: the driver gives up after
# 40 min. Run it on an otherwise idle machine: worker, Redis and driver share its cores.
#   bench/run.sh                 # build both Rust workers, run everything
#   BENCH_JOBS=50000 ROUNDS=5 BENCH_KINDS=reliable-quiet,rusty-quiet bench/run.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
cd "$root"
target="${CARGO_TARGET_DIR:-$root/target}"
if [ -z "${SKIP_BUILD:-}" ]; then
  cargo build --release --example bench_worker
  # rusty-sidekiq from crates.io, in a crate of its own (not part of playguard's build).
  cargo build --release --manifest-path "$here/rusty/Cargo.toml" --target-dir "$target"
fi
bin="${PG_BIN:-$target/release/examples/bench_worker}"
rusty="${RUSTY_BIN:-$target/release/rusty-bench}"
[ -x "$bin" ] || { echo "missing $bin" >&2; exit 1; }
[ -x "$rusty" ] || { echo "missing $rusty" >&2; exit 1; }

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
load="$(cut -d' ' -f1 /proc/loadavg)"
echo "load average before the run: $load" >&2
REDIS_URL="redis://127.0.0.1:$port/0" PG_BIN="$bin" RUSTY_BIN="$rusty" OUT_DIR="$out" \
  timeout 2400 ruby "$here/driver.rb"

{
  echo "# Benchmark results"
  echo
  echo "Produced by \`bench/run.sh\` on $(date -u +%Y-%m-%dT%H:%MZ): $(nproc) cores" \
       "($(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)), $(uname -sr)," \
       "redis-server $(redis-server --version | sed 's/.*v=\([^ ]*\).*/\1/'), ruby $(ruby -e 'print RUBY_VERSION')," \
       "load average before the run $load."
  echo
  cat "$out/table.md"
} >"$here/results.md"
echo "written to bench/results.md" >&2

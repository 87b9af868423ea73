#!/usr/bin/env bash
# Benchmark: Ruby Sidekiq 6.4.1, rusty-sidekiq 0.15.2 and playguard (reliable and basic fetch),
# each quiet and at INFO, on no-op jobs; Ruby Sidekiq and playguard, quiet, on jobs that burn
# 200 µs of CPU and on /bin/true command jobs; in one run on one machine: ROUNDS (3) interleaved
# rounds, medians with min-max. Starts its own redis-server on a free loopback port (never
# 6379), stops it by PID, and prints the tables, also written to bench/results.md. Bounded: the
# driver gives up after 40 min. Run it on an otherwise idle machine: worker, Redis and driver
# share its cores.
#   bench/run.sh                 # build both Rust workers, run everything
#   BENCH_JOBS=50000 ROUNDS=5 BENCH_KINDS=reliable-quiet,rusty-quiet bench/run.sh
#   BENCH_WORK_JOBS=5000 BENCH_KINDS=ruby-cpu,reliable-cpu,ruby-command,reliable-command bench/run.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
redis_wrap=()
source "$here/lib.sh" bench
# rusty-sidekiq from crates.io, in a crate of its own (not part of playguard's build), built
# only when a rusty-* kind runs.
target="${CARGO_TARGET_DIR:-$bench_root/target}"
rusty="${RUSTY_BIN:-$target/release/rusty-bench}"
if [ -z "${BENCH_KINDS:-}" ] || [[ ",$BENCH_KINDS," == *,rusty-* ]]; then
  [ -n "${SKIP_BUILD:-}" ] || cargo build --release --manifest-path "$here/rusty/Cargo.toml" --target-dir "$target"
  [ -x "$rusty" ] || { echo "missing $rusty" >&2; exit 1; }
fi

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

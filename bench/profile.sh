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
redis_wrap=()
[ -z "${REDIS_CALLGRIND:-}" ] || redis_wrap=(valgrind --tool=callgrind "--callgrind-out-file=@OUT@/redis.callgrind.%p")
source "$here/lib.sh" profile
REDIS_URL="redis://127.0.0.1:$port/0" PG_BIN="$bin" OUT_DIR="$out" \
  timeout 1200 ruby "$here/profile.rb"

#!/usr/bin/env bash
# Scale curves: cost per job (or per tick) at two sizes each, printed as a table (also written
# to bench/scale.md): queue depth, dead set, schedule set, weighted queues, idle processes,
# periodic dispatch over many Marquees, reconcile cycles with 1 and 6 phases; then, once each,
# scheduled-job lateness beside Ruby Sidekiq and one 1,000,000-member periodic tick.
# Its own redis-server on a free loopback port (never 6379), stopped by PID. Bounded in time.
#   bench/scale.sh                      # every curve
#   CURVES=depth,reconcile bench/scale.sh
#   CURVES=lateness,tick LATE_JOBS=20 TICK_MEMBERS=20000 bench/scale.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
redis_wrap=()
source "$here/lib.sh" scale
load="$(cut -d' ' -f1 /proc/loadavg)"
echo "redis-server on 127.0.0.1:$port, logs in $out, load average $load" >&2
REDIS_URL="redis://127.0.0.1:$port/0" PG_BIN="$bin" OUT_DIR="$out" \
  timeout 2700 ruby "$here/scale.rb"
{
  echo "# Scale curves"
  echo
  echo "Produced by \`bench/scale.sh\` on $(date -u +%Y-%m-%dT%H:%MZ): $(nproc) cores, load average" \
       "before the run $load."
  echo
  cat "$out/scale.md"
} >"$here/scale.md"
echo "written to bench/scale.md" >&2

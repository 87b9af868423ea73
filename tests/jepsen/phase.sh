#!/bin/bash
# One phase of a jepsen Marquee cycle: work a little, then the documented fenced write
# (docs/fencing.md) on the Marquee's row, and append the attempt, accepted or refused, to
# jepsen_history. Job data reaches psql only as -v variables, never a shell or SQL string.
# JEPSEN_RECIPE=fences (database fences only) also refuses the write unless playguard_fences
# still holds this fence, read FOR SHARE so a newer acquisition waits for this write.
set -u
start=${EPOCHREALTIME/./}
sleep "0.$(( RANDOM % 4 ))$(( RANDOM % 10 ))"
out=$(psql -X -q -A -t -v ON_ERROR_STOP=1 -d "${JEPSEN_DB:?}" \
  -v args="${PLAYGUARD_ARGS:?}" -v phase="${PLAYGUARD_PHASE:?}" -v fence="${PLAYGUARD_FENCE:?}" \
  -v host="${JEPSEN_HOST:?}" -v jid="${PLAYGUARD_JID:?}" -v pid="$$" -v start="$start" \
  -v recipe="${JEPSEN_RECIPE:-row}" -v lock_key="${PLAYGUARD_LOCK_KEY:?}" <<'SQL'
WITH u AS (
  UPDATE jepsen_marquees
     SET fence = :'fence'::bigint, version = version + 1,
         holder = :'host' || ':' || :'jid' || ':' || :'phase'
   WHERE id = (:'args'::jsonb ->> 0) AND fence <= :'fence'::bigint
     AND (:'recipe' = 'row' OR :'fence'::bigint =
          (SELECT f.fence FROM playguard_fences f WHERE f.lock_key = :'lock_key' FOR SHARE))
  RETURNING version)
INSERT INTO jepsen_history (marquee, phase, fence, host, jid, pid, started_us, ended_us, accepted, version)
SELECT :'args'::jsonb ->> 0, :'phase', :'fence'::bigint, :'host', :'jid', :'pid'::int, :'start'::bigint,
       (extract(epoch FROM clock_timestamp()) * 1000000)::bigint,
       EXISTS (SELECT 1 FROM u), (SELECT version FROM u)
RETURNING accepted;
SQL
) || { echo "history write failed" >&2; exit 2; }
[ "$out" = t ] || { echo "refused: a newer fence already wrote this Marquee (fence $PLAYGUARD_FENCE)" >&2; exit 1; }

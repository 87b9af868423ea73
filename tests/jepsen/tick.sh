#!/bin/bash
# A periodic probe of the jepsen bed: records which tick pushed it (its created_at, whole
# seconds) for which member, so the checker can count pushes per member per tick.
set -u
created=$(python3 -c "import json,sys; print(int(json.load(sys.stdin)[\"created_at\"]))")
psql -X -q -A -t -v ON_ERROR_STOP=1 -d "${JEPSEN_DB:?}" -v jid="${PLAYGUARD_JID:?}" \
  -v host="${JEPSEN_HOST:?}" -v args="${PLAYGUARD_ARGS:?}" -v created="$created" <<'SQL' >/dev/null \
  || { echo "history write failed" >&2; exit 2; }
INSERT INTO jepsen_ticks (member, created_s, jid, host)
VALUES (:'args'::jsonb ->> 0, :'created'::bigint, :'jid', :'host');
SQL

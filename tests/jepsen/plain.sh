#!/bin/bash
# A pushed plain job of the jepsen bed: one jepsen_plain row per attempt (host, jid, ok). One
# jid in ten fails its first attempt, so retries are part of the run. Job data reaches psql
# only as -v variables.
set -u
ok=t
[ -z "${PLAYGUARD_RETRY_COUNT:-}" ] && [ $(( 10#${PLAYGUARD_JID:5} % 10 )) = 3 ] && ok=f
psql -X -q -A -t -v ON_ERROR_STOP=1 -d "${JEPSEN_DB:?}" -v jid="${PLAYGUARD_JID:?}" \
  -v host="${JEPSEN_HOST:?}" -v ok="$ok" <<'SQL' >/dev/null || { echo "history write failed" >&2; exit 2; }
INSERT INTO jepsen_plain (jid, host, ok) VALUES (:'jid', :'host', :'ok'::boolean);
SQL
[ "$ok" = t ] || { echo "planned first-attempt failure" >&2; exit 1; }

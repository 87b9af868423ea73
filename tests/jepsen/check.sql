-- The verdict, from PostgreSQL only (the pusher's log and the Redis inventory are loaded into
-- jepsen_pushed and jepsen_in_redis first). Holder = (jid, fence): one lock acquisition.
\pset footer off
WITH acc AS (SELECT * FROM jepsen_history WHERE accepted),
reg AS (SELECT count(*) n FROM (
  SELECT fence < lag(fence) OVER (PARTITION BY marquee ORDER BY version) AS back FROM acc) s WHERE back),
ovl AS (SELECT count(*) n FROM acc a JOIN acc b ON a.marquee = b.marquee AND a.id < b.id
  AND (a.fence, a.jid) <> (b.fence, b.jid)
  AND a.started_us < b.ended_us AND b.started_us < a.ended_us),
lost AS (SELECT count(*) n FROM jepsen_marquees m
  LEFT JOIN LATERAL (SELECT count(*) c, max(version) v FROM acc WHERE acc.marquee = m.id) h ON true
  LEFT JOIN acc last ON last.marquee = m.id AND last.version = m.version
  WHERE h.c <> m.version OR (m.version > 0 AND (last.fence IS DISTINCT FROM m.fence))),
starved AS (SELECT count(*) n FROM jepsen_marquees WHERE version = 0),
ran AS (SELECT jid, count(*) runs FROM jepsen_plain WHERE ok GROUP BY jid),
-- A pushed job is accounted for when it ran to success or Redis still holds it (queue, retry,
-- dead, schedule, a worker's list).
gone AS (SELECT p.jid, p.confirmed FROM jepsen_pushed p
  WHERE NOT EXISTS (SELECT 1 FROM ran WHERE ran.jid = p.jid)
    AND NOT EXISTS (SELECT 1 FROM jepsen_in_redis r WHERE r.jid = p.jid)),
-- Ticks: the probe's created_at (whole seconds) over its 10 s period. The first tick and the
-- last two are left out (the run started or stopped inside them).
tk AS (SELECT member, created_s / 10 AS tick, count(DISTINCT jid) jobs FROM jepsen_ticks GROUP BY 1, 2),
span AS (SELECT min(tick) + 1 lo, max(tick) - 2 hi FROM tk),
ticks AS (SELECT DISTINCT tick FROM tk, span WHERE tick BETWEEN lo AND hi),
-- A stale accepted write: the lock was taken again (a later playguard_cycles row of the same
-- key) before this write landed, yet it was accepted. 50 ms of slack for the acquisition's own
-- statement time.
stale AS (SELECT count(*) n FROM acc w
  JOIN playguard_cycles c ON c.lock_key = 'jepsen:marquee:' || w.marquee AND c.jid = w.jid AND c.fence = w.fence
  WHERE EXISTS (SELECT 1 FROM playguard_cycles c2 WHERE c2.lock_key = c.lock_key
    AND c2.started_at > c.started_at AND c2.started_at + interval '50 ms' < to_timestamp(w.ended_us / 1e6))),
missed AS (SELECT count(*) n FROM ticks t CROSS JOIN (SELECT 't' || g AS member FROM generate_series(1, 20) g) m
  WHERE NOT EXISTS (SELECT 1 FROM tk WHERE tk.tick = t.tick AND tk.member = m.member))
SELECT :'faults' AS faults,
  (SELECT count(*) FROM playguard_cycles) AS cycles,
  (SELECT count(*) FROM acc) AS accepted,
  (SELECT count(*) FROM jepsen_history WHERE NOT accepted) AS refused,
  (SELECT n FROM ovl) AS overlaps,
  (SELECT n FROM reg) AS fence_regressions,
  (SELECT n FROM lost) AS lost_rows,
  (SELECT n FROM starved) AS never_written,
  (SELECT count(*) FROM jepsen_pushed) AS pushed,
  (SELECT count(*) FROM jepsen_pushed WHERE confirmed) AS confirmed,
  (SELECT count(*) FROM ran) AS jobs_ran,
  (SELECT count(*) FROM gone WHERE confirmed) AS lost_jobs,
  (SELECT coalesce(sum(runs - 1), 0) FROM ran) AS duplicates,
  (SELECT count(*) FROM gone WHERE NOT confirmed) AS unconfirmed_gone,
  (SELECT coalesce(sum(jobs - 1), 0) FROM tk, span WHERE tick BETWEEN lo AND hi) AS tick_dups,
  (SELECT n FROM missed) AS tick_missed,
  (SELECT n FROM stale) AS stale_accepted;
SELECT outcome, count(*) FROM playguard_cycles GROUP BY 1 ORDER BY 1;

-- The verdict, from PostgreSQL only. Holder = (jid, fence): one lock acquisition.
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
starved AS (SELECT count(*) n FROM jepsen_marquees WHERE version = 0)
SELECT :'faults' AS faults,
  (SELECT count(*) FROM playguard_cycles) AS cycles,
  (SELECT count(*) FROM acc) AS accepted,
  (SELECT count(*) FROM jepsen_history WHERE NOT accepted) AS refused,
  (SELECT n FROM ovl) AS overlaps,
  (SELECT n FROM reg) AS fence_regressions,
  (SELECT n FROM lost) AS lost,
  (SELECT n FROM starved) AS never_written;
SELECT outcome, count(*) FROM playguard_cycles GROUP BY 1 ORDER BY 1;

-- Reliable fetch: move up to ARGV[1] jobs from the queues, in the order given, into this
-- process's working lists, all in one atomic step (no moment where a job is only in memory).
-- Each queue's jobs go into its working list with one LPUSH, not one per job.
-- KEYS[1..n]    = queue:<q> in fetch order
-- KEYS[n+1..2n] = playguard:working:<identity>:<q>, same order
-- KEYS[2n+1]    = playguard:alive:<identity>: nothing is fetched while it is missing (our
--                 liveness lapsed, we may have been swept: wait until a heartbeat registers
--                 us again, so no job lands in a working list no sweep would look at)
-- Returns {index, {job, ...}, index, {job, ...}, ...}: per queue that gave jobs its 1-based
-- position in KEYS[1..n] and its jobs oldest first (one index per queue, not per job: the
-- client parses fewer replies). A queue whose key or working list holds another type than a
-- list is skipped and reported as {-index, {key, type}}: every type is checked before the
-- first pop, so no popped job can meet a push that fails (it would be written nowhere).
local n = (#KEYS - 1) / 2
local want = tonumber(ARGV[1])
local out = {}
if redis.call('EXISTS', KEYS[2 * n + 1]) == 0 then
  return out
end
local skip = {}
for i = 1, n do
  for _, key in ipairs({KEYS[i], KEYS[n + i]}) do
    local t = redis.call('TYPE', key).ok
    if t ~= 'list' and t ~= 'none' then
      skip[i] = true
      out[#out + 1] = -i
      out[#out + 1] = {key, t}
      break
    end
  end
end
for i = 1, n do
  if want <= 0 then break end
  -- RPOP with a count takes the oldest jobs first (the client LPUSHes on the left).
  local jobs = not skip[i] and redis.call('RPOP', KEYS[i], want)
  if jobs then
    -- Several values in one LPUSH leave the same order as one LPUSH each: oldest rightmost.
    redis.call('LPUSH', KEYS[n + i], unpack(jobs))
    out[#out + 1] = i
    out[#out + 1] = jobs
    want = want - #jobs
  end
end
return out

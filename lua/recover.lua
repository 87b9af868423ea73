-- Return a dead process's working lists to the heads of their queues (RPUSH: next popped),
-- counting recoveries per payload; a payload recovered ARGV[2] times goes to the poison list
-- instead (the caller turns it into a proper dead-set entry without re-encoding it here).
-- KEYS[1] = playguard:fetchers   KEYS[2] = playguard:alive:<identity>
-- KEYS[3] = playguard:recovered (hash: sha1 of a payload -> times recovered)
-- KEYS[4] = playguard:recovered:at (zset: sha1 -> when last recovered; counts are forgotten
--           after 7 days without a recovery)
-- KEYS[5] = playguard:poison
-- KEYS[6..] = pairs {playguard:working:<identity>:<q>, queue:<q>}
-- ARGV[1] = identity  ARGV[2] = max recoveries  ARGV[3] = '1' to skip the liveness check
-- ARGV[4] = now (seconds)  ARGV[5] = forget counts last touched before this
-- A queue whose `queue:<q>` holds another type than a list is skipped (an RPUSH there would fail
-- after the LPOP and lose the job): its jobs stay in the working list and the entry is kept, so
-- a later sweep recovers them once the key is fixed.
-- Returns {moved, skipped queue key, ...}; -1 / -2 as a bare number.
if ARGV[3] ~= '1' and redis.call('EXISTS', KEYS[2]) == 1 then
  return -1
end
-- Without its queue names we cannot find its working lists: keep the entry, forget nothing.
if #KEYS < 7 then
  return -2
end
-- Forget old counts (a bounded number per call, so one call never walks a huge set).
local old = redis.call('ZRANGE', KEYS[4], '-inf', ARGV[5], 'BYSCORE', 'LIMIT', 0, 1000)
if #old > 0 then
  redis.call('HDEL', KEYS[3], unpack(old))
  redis.call('ZREM', KEYS[4], unpack(old))
end
local moved = 0
local skipped = {}
for i = 6, #KEYS, 2 do
  local wk, qk = KEYS[i], KEYS[i + 1]
  local t = redis.call('TYPE', qk)['ok']
  if t ~= 'list' and t ~= 'none' then
    skipped[#skipped + 1] = qk
  end
  while t == 'list' or t == 'none' do
    -- newest first, so the oldest ends up rightmost and runs first
    local job = redis.call('LPOP', wk)
    if not job then break end
    local sha = redis.sha1hex(job)
    local n = redis.call('HINCRBY', KEYS[3], sha, 1)
    redis.call('ZADD', KEYS[4], ARGV[4], sha)
    if n >= tonumber(ARGV[2]) then
      redis.call('HDEL', KEYS[3], sha)
      redis.call('ZREM', KEYS[4], sha)
      redis.call('LPUSH', KEYS[5], job)
    else
      redis.call('RPUSH', qk, job)
    end
    moved = moved + 1
  end
end
if #skipped == 0 then
  redis.call('HDEL', KEYS[1], ARGV[1])
end
return {moved, unpack(skipped)}

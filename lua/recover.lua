-- Return a dead process's working lists to the heads of their queues (RPUSH: next popped),
-- counting recoveries per payload; a payload recovered ARGV[2] times goes to the poison list
-- instead (the caller turns it into a proper dead-set entry without re-encoding it here).
-- KEYS[1] = playguard:fetchers   KEYS[2] = playguard:alive:<identity>
-- KEYS[3] = prefix of the per-payload counters (playguard:recovered:<sha1>, 7-day TTL each)
-- KEYS[4] = playguard:poison
-- ARGV[1] = identity  ARGV[2] = max recoveries  ARGV[3] = '1' to skip the liveness check
-- ARGV[4..] = queue names
-- A queue whose `queue:<q>` holds another type than a list is skipped (an RPUSH there would fail
-- after the LPOP and lose the job): its jobs stay in the working list and the entry is kept, so
-- a later sweep recovers them once the key is fixed.
-- Returns {moved, skipped queue, ...}; -1 / -2 as a bare number.
if ARGV[3] ~= '1' and redis.call('EXISTS', KEYS[2]) == 1 then
  return -1
end
-- Without its queue names we cannot find its working lists: keep the entry, forget nothing.
if #ARGV < 4 then
  return -2
end
local moved = 0
local skipped = {}
for i = 4, #ARGV do
  local q = ARGV[i]
  local wk = 'playguard:working:' .. ARGV[1] .. ':' .. q
  local t = redis.call('TYPE', 'queue:' .. q)['ok']
  if t ~= 'list' and t ~= 'none' then
    skipped[#skipped + 1] = q
  end
  while t == 'list' or t == 'none' do
    -- newest first, so the oldest ends up rightmost and runs first
    local job = redis.call('LPOP', wk)
    if not job then break end
    local counter = KEYS[3] .. redis.sha1hex(job)
    local n = redis.call('INCR', counter)
    redis.call('EXPIRE', counter, 604800)
    if n >= tonumber(ARGV[2]) then
      redis.call('DEL', counter)
      redis.call('LPUSH', KEYS[4], job)
    else
      redis.call('RPUSH', 'queue:' .. q, job)
    end
    moved = moved + 1
  end
end
if #skipped == 0 then
  redis.call('HDEL', KEYS[1], ARGV[1])
end
return {moved, unpack(skipped)}

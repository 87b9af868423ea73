-- Move due jobs from `schedule` or `retry` onto their queues atomically: a job leaves the
-- sorted set only in the same step that pushes it, and only the process whose ZREM wins pushes.
-- KEYS[1] = schedule | retry
-- ARGV = repeated triples {member, payload, queue}; an empty queue means: bury it, the member
-- leaves the set and `payload` (the raw member, or a dead entry with the reason) goes to `dead`
-- (ARGV[#ARGV] = now, for the score).
-- A member whose `queue:<q>` holds something other than a list is not touched (an LPUSH there
-- would fail after the ZREM and lose it): it is returned for the caller to bury with the reason.
-- Returns {moved, member, type, member, type, ...}.
local now = ARGV[#ARGV]
local moved = 0
local out = {0}
for i = 1, #ARGV - 1, 3 do
  local member, payload, queue = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if queue == '' then
    if redis.call('ZREM', KEYS[1], member) == 1 then
      redis.call('ZADD', 'dead', now, payload)
      moved = moved + 1
    end
  else
    local t = redis.call('TYPE', 'queue:' .. queue)['ok']
    if t ~= 'list' and t ~= 'none' then
      out[#out + 1] = member
      out[#out + 1] = t
    elseif redis.call('ZREM', KEYS[1], member) == 1 then
      redis.call('SADD', 'queues', queue)
      redis.call('LPUSH', 'queue:' .. queue, payload)
      moved = moved + 1
    end
  end
end
out[1] = moved
return out

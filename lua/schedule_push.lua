-- Move due jobs from `schedule` or `retry` onto their queues atomically: a job leaves the
-- sorted set only in the same step that pushes it, and only the process whose ZREM wins pushes.
-- KEYS[1] = schedule | retry   KEYS[2] = dead   KEYS[3] = queues (the set of queue names)
-- KEYS[4..] = the distinct `queue:<q>` keys of this batch
-- ARGV[1] = now (the dead score)   ARGV[2], ARGV[3] = the dead set's trim bounds (by score, by
-- rank), as retry.rs add_dead uses them
-- ARGV[4..] = triples {member, payload, k}: k is the index in KEYS of the member's queue key,
-- or 0 to bury it (the member leaves the set and `payload`, the raw member or a dead entry with
-- the reason, goes to `dead`).
-- A member whose queue key holds something other than a list is not touched (an LPUSH there
-- would fail after the ZREM and lose it): it is returned for the caller to bury with the reason.
-- Returns {moved, member, type, member, type, ...}.
local now = ARGV[1]
local moved = 0
local buried = 0
local out = {0}
for i = 4, #ARGV, 3 do
  local member, payload, k = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  if k == 0 then
    if redis.call('ZREM', KEYS[1], member) == 1 then
      redis.call('ZADD', KEYS[2], now, payload)
      moved = moved + 1
      buried = buried + 1
    end
  else
    local qkey = KEYS[k]
    local t = redis.call('TYPE', qkey)['ok']
    if t ~= 'list' and t ~= 'none' then
      out[#out + 1] = member
      out[#out + 1] = t
    elseif redis.call('ZREM', KEYS[1], member) == 1 then
      -- the queue's name is its key without the `queue:` prefix
      redis.call('SADD', KEYS[3], string.sub(qkey, 7))
      redis.call('LPUSH', qkey, payload)
      moved = moved + 1
    end
  end
end
if buried > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[2])
  redis.call('ZREMRANGEBYRANK', KEYS[2], 0, ARGV[3])
end
out[1] = moved
return out

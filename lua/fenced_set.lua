-- Keys: KEYS[1] = a hash {fence, value} guarded by fencing numbers.
-- Write only when the stored fence is <= ours: a writer whose lease ran out (and whose number
-- is therefore older than the current holder's) is refused, whatever else changed meanwhile.
-- The same rule as SQL `... WHERE id = $id AND fence <= $fence`.
--   ARGV[1] = fence (decimal integer), ARGV[2] = value.
-- Reply: 1 = written, 0 = refused (a newer fence already wrote).
-- Fences are at most about the Redis clock in microseconds (~1.8e15 in 2026), far below 2^53,
-- so Lua numbers compare them exactly.
local given = tonumber(ARGV[1])
if given == nil then
  return redis.error_reply('fenced_set: fence is not a number')
end
local stored = redis.call('HGET', KEYS[1], 'fence')
if stored == false or tonumber(stored) <= given then
  redis.call('HSET', KEYS[1], 'fence', ARGV[1], 'value', ARGV[2])
  return 1
end
return 0

-- One periodic tick, claimed and enqueued atomically: the fingerprint is set only in the same
-- step that pushes the tick's jobs, so a Redis error cannot leave a tick claimed without them,
-- and a retried attempt after one that landed finds the fingerprint taken and pushes nothing.
-- KEYS[1] = playguard:periodic:<name>:<tick> (the fingerprint), KEYS[2] = queues,
-- KEYS[3] = queue:<q>
-- ARGV[1] = identity (the fingerprint's value), ARGV[2] = fingerprint TTL in seconds,
-- ARGV[3] = the queue name <q> (added to `queues`), ARGV[4..] = the job payloads.
-- Returns the number of payloads pushed, or -1 when the tick was already taken.
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then
  return -1
end
if #ARGV > 3 then
  redis.call('SADD', KEYS[2], ARGV[3])
  -- One LPUSH per 1,000 payloads rather than one each (the same order; unpack stays well
  -- under Lua's C stack limit).
  for i = 4, #ARGV, 1000 do
    redis.call('LPUSH', KEYS[3], unpack(ARGV, i, math.min(i + 999, #ARGV)))
  end
end
return #ARGV - 3

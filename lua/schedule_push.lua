-- Move due jobs from `schedule` or `retry` onto their queues atomically: a job leaves the
-- sorted set only in the same step that pushes it, and only the process whose ZREM wins pushes.
-- KEYS[1] = schedule | retry
-- ARGV = repeated triples {member, new_payload, queue}; an empty queue means the member is not
-- a job we can read: it goes to `dead` as the raw string (ARGV[#ARGV] = now, for the score).
local now = ARGV[#ARGV]
local moved = 0
for i = 1, #ARGV - 1, 3 do
  local member, payload, queue = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if redis.call('ZREM', KEYS[1], member) == 1 then
    if queue == '' then
      redis.call('ZADD', 'dead', now, member)
    else
      redis.call('SADD', 'queues', queue)
      redis.call('LPUSH', 'queue:' .. queue, payload)
    end
    moved = moved + 1
  end
end
return moved

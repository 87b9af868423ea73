-- Put an unfinished job back at the head of its queue (RPUSH: it is the next one popped, as
-- Sidekiq's hard shutdown does), but only if it is still in our working list, so a job is never
-- pushed back twice.
-- KEYS[1] = playguard:working:<identity>:<q>, KEYS[2] = queue:<q>; ARGV[1] = the exact payload
-- ARGV[2] (optional) = what goes back instead (the payload with its shutdown count raised)
-- Returns 1 (pushed back), 0 (not ours any more), -1 (KEYS[2] holds another type than a list:
-- the job stays in the working list rather than being removed and then failing to push).
local t = redis.call('TYPE', KEYS[2])['ok']
if t ~= 'list' and t ~= 'none' then
  return -1
end
if redis.call('LREM', KEYS[1], -1, ARGV[1]) == 1 then
  redis.call('RPUSH', KEYS[2], ARGV[2] or ARGV[1])
  return 1
end
return 0

-- Reliable fetch: record a finished job's outcome (a retry, or dead) together with its
-- acknowledgement, but only while the job is still in our working list. A job that left it
-- was returned to its queue by another process's orphan sweep (our liveness lease lapsed)
-- and may be running there now: a retry written for our copy would make it run once more.
-- KEYS[1] = playguard:working:<identity>:<q>   KEYS[2] = retry   KEYS[3] = dead
-- KEYS[4] = schedule (a snoozed job)
-- ARGV[1] = the exact payload as fetched   ARGV[2] = 'retry' | 'dead' | 'schedule' | 'none'
-- ARGV[3] = the score   ARGV[4] = the entry to write
-- ARGV[5], ARGV[6] = the dead set's trim bounds (by score, by rank), as retry.rs add_dead
-- Returns 1 (recorded), 0 (no longer ours: nothing written), -1 (the target key holds another
-- type than a sorted set: nothing removed either, the job stays in the working list).
local target = nil
if ARGV[2] == 'retry' then target = KEYS[2] elseif ARGV[2] == 'dead' then target = KEYS[3]
elseif ARGV[2] == 'schedule' then target = KEYS[4] end
if target then
  local t = redis.call('TYPE', target)['ok']
  if t ~= 'zset' and t ~= 'none' then
    return -1
  end
end
if redis.call('LREM', KEYS[1], -1, ARGV[1]) == 0 then
  return 0
end
if target then
  redis.call('ZADD', target, ARGV[3], ARGV[4])
end
if ARGV[2] == 'dead' then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', ARGV[5])
  redis.call('ZREMRANGEBYRANK', KEYS[3], 0, ARGV[6])
end
return 1

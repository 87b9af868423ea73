-- Enqueue one sidekiq-cron tick, as the gem's Job#test_and_enque_for_time! does, in one step.
-- The gate is the gem's own: the process whose ZADD adds the tick's member to
-- `cron_job:<name>:enqueued` pushes the job; every other process (Ruby or playguard) finds the
-- member there and pushes nothing. The gem sends the same commands one by one; here they run
-- as one script, so a crash between the ZADD and the push cannot lose the tick.
-- KEYS[1] = cron_job:<name>:enqueued   KEYS[2] = cron_job:<name>   KEYS[3] = cron_job:<name>:jid_history
-- KEYS[4] = queues   KEYS[5] = queue:<q>
-- ARGV[1] = the tick's score   ARGV[2] = the tick's member   ARGV[3] = the payload
-- ARGV[4] = last_enqueue_time   ARGV[5] = the jid-history entry   ARGV[6] = the history's last index
-- ARGV[7] = the prune bound (exclusive, "(<now - 24 h>")   ARGV[8] = the queue's name
-- Returns {1} (pushed), {0} (another process has the tick, or the entry was disabled or
-- removed since it was read), or {-1, key, type} when a key holds another type (nothing written).
local expect = {[1] = 'zset', [2] = 'hash', [3] = 'list', [4] = 'set', [5] = 'list'}
for i = 1, 5 do
  local t = redis.call('TYPE', KEYS[i])['ok']
  if t ~= expect[i] and t ~= 'none' then
    return {-1, KEYS[i], t}
  end
end
-- Read again here, so an entry disabled or destroyed (the Web UI) after the poll read it stays quiet.
if redis.call('EXISTS', KEYS[2]) == 0 then
  return {0}
end
local status = redis.call('HGET', KEYS[2], 'status')
if status and status ~= 'enabled' then
  return {0}
end
if redis.call('ZADD', KEYS[1], ARGV[1], ARGV[2]) == 0 then
  return {0}
end
redis.call('SADD', KEYS[4], ARGV[8])
redis.call('LPUSH', KEYS[5], ARGV[3])
redis.call('HSET', KEYS[2], 'last_enqueue_time', ARGV[4])
redis.call('LPUSH', KEYS[3], ARGV[5])
redis.call('LTRIM', KEYS[3], 0, ARGV[6])
redis.call('ZREMRANGEBYSCORE', KEYS[1], 0, ARGV[7])
return {1}

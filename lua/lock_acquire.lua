-- Keys: KEYS[1] = the lock key (holds the owner's token), KEYS[2] = KEYS[1]..":fence" (counter).
-- Take the lock and hand out a fencing number in one step, so no caller can own the lock
-- without a fence or hold a fence it never owned.
--   ARGV[1] = token (fresh UUIDv4), ARGV[2] = lease length in whole milliseconds.
-- Optional holder record (a worker with a liveness lease; the library API passes none):
--   KEYS[3] = playguard:locks:<identity>, ARGV[3]/ARGV[4] = the record JSON before/after the
--   fence; HSET KEYS[3] KEYS[1] <ARGV[3] fence ARGV[4]> in the same step as the SET NX, so
--   the orphan sweep can release the lock if the holder dies.
-- Reply: {token, fence} on success; false (nil to a RESP2 client) when someone holds the lock.
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  -- fence = max(counter + 1, Redis clock in microseconds): a counter Redis lost (restart
  -- without persistence, FLUSHALL, failover to a lagging replica) cannot start again below
  -- fences already handed out, as long as the server clock never steps back. The clock is
  -- built as a string (seconds .. 6-digit microseconds) so no float formatting rounds it.
  local t = redis.call('TIME')
  local clock = t[1] .. string.format('%06d', tonumber(t[2]))
  local counter = tonumber(redis.call('GET', KEYS[2]) or '0')
  local fence
  if counter ~= nil and counter >= tonumber(clock) then
    fence = redis.call('INCR', KEYS[2])
  else
    redis.call('SET', KEYS[2], clock)
    fence = tonumber(clock)
  end
  if KEYS[3] then
    redis.call('HSET', KEYS[3], KEYS[1], ARGV[3] .. string.format('%d', fence) .. ARGV[4])
  end
  return {ARGV[1], fence}
end
return false

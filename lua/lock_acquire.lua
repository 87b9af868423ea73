-- Keys: KEYS[1] = the lock key (holds the owner's token), KEYS[2] = KEYS[1]..":fence" (counter).
-- Take the lock and hand out a fencing number in one step, so no caller can own the lock
-- without a fence or hold a fence it never owned.
--   ARGV[1] = token (fresh UUIDv4), ARGV[2] = lease length in whole milliseconds.
-- Reply: {token, fence} on success; false (nil to a RESP2 client) when someone holds the lock.
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local fence = redis.call('INCR', KEYS[2])
  return {ARGV[1], fence}
end
return false

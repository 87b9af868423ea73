-- Keys: KEYS[1] = the lock key. Push its expiry forward only while it still holds our token.
-- It never creates the key: a vanished lock stays vanished, and the caller must stop.
--   ARGV[1] = token, ARGV[2] = lease length in whole milliseconds (the TTL is reset, not added).
-- Reply (an integer, compared exactly by the caller):
--    1 = renewed, 0 = the key is gone (expired, deleted, or Redis lost it), -1 = another token.
local current = redis.call('GET', KEYS[1])
if current == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
elseif current == false then
  return 0
end
return -1

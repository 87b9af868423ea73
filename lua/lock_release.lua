-- Keys: KEYS[1] = the lock key. Delete it only while it still holds our token, so a holder
-- whose lease ran out cannot delete the lock a newer owner took in the meantime.
--   ARGV[1] = token.
-- Optional KEYS[2] = playguard:locks:<identity>: our holder record of KEYS[1] is dropped from
-- it either way (the lock is no longer ours to release).
-- Reply (an integer, compared exactly by the caller), as lock_renew.lua's, so a release can
-- also prove that the lock was ours up to this moment:
--    1 = deleted, 0 = already gone, -1 = another token holds it (left untouched).
if KEYS[2] then
  redis.call('HDEL', KEYS[2], KEYS[1])
end
local current = redis.call('GET', KEYS[1])
if current == ARGV[1] then
  return redis.call('DEL', KEYS[1])
elseif current == false then
  return 0
end
return -1

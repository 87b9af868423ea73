-- Keys: KEYS[1] = the lock key. Delete it only while it still holds our token, so a holder
-- whose lease ran out cannot delete the lock a newer owner took in the meantime.
--   ARGV[1] = token.
-- Optional KEYS[2] = playguard:locks:<identity>: our holder record of KEYS[1] is dropped from
-- it either way (the lock is no longer ours to release).
-- Reply: 1 = deleted, 0 = not ours (or already gone); nothing else was changed.
if KEYS[2] then
  redis.call('HDEL', KEYS[2], KEYS[1])
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0

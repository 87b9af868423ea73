-- Keys: KEYS[1] = the lock key. Delete it only while it still holds our token, so a holder
-- whose lease ran out cannot delete the lock a newer owner took in the meantime.
--   ARGV[1] = token.
-- Reply: 1 = deleted, 0 = not ours (or already gone); nothing was changed.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0

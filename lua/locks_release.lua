-- Release the locks a dead process recorded at acquisition (playguard:locks:<identity>), so a
-- job recovered from it is not skipped as "already locked" for the rest of the dead lease.
-- Compare-and-delete: a lock key is deleted only while it still holds the recorded token (a
-- newer owner's lock survives); every processed field is dropped from the record, and the
-- record hash vanishes with its last field.
-- KEYS[1] = playguard:alive:<identity>   KEYS[2] = playguard:locks:<identity>
-- KEYS[3..] = the recorded lock keys     ARGV[1] = '1' to skip the liveness check
-- ARGV[2..] = the recorded tokens, in the order of KEYS[3..]
-- Reply: locks released (>= 0), or -1 when the process is alive (nothing changed).
if ARGV[1] ~= '1' and redis.call('EXISTS', KEYS[1]) == 1 then
  return -1
end
local released = 0
for i = 3, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[i - 1] then
    redis.call('DEL', KEYS[i])
    released = released + 1
  end
  redis.call('HDEL', KEYS[2], KEYS[i])
end
return released

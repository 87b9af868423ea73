-- Reliable fetch's acknowledgement of the oldest finished jobs of one working list at once:
-- trim the ARGV[1] elements at its old (right) end, but only if that end holds exactly the
-- payloads the process expects there (ARGV[2] the oldest, ARGV[3] the ARGV[1]-th oldest).
-- Jobs are unique by jid, so two matching ends mean the list is as the process pictured it;
-- anything else (a sweep returned our jobs while we were frozen, a lost fetch reply, a
-- failover) answers 0 and the process removes each payload by LREM instead.
-- KEYS[1] = playguard:working:<identity>:<q>
-- Returns 1 (trimmed) or 0 (not as expected; nothing changed).
local n = tonumber(ARGV[1])
if redis.call('LINDEX', KEYS[1], -1) ~= ARGV[2] or redis.call('LINDEX', KEYS[1], -n) ~= ARGV[3] then
  return 0
end
redis.call('LTRIM', KEYS[1], 0, -n - 1)
return 1

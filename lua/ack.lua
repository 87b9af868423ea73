-- Acknowledge finished jobs in one call: remove each from its working list.
-- KEYS[i] = playguard:working:<identity>:<q>, ARGV[i] = the exact payload of the i-th job.
local removed = 0
for i = 1, #KEYS do
  removed = removed + redis.call('LREM', KEYS[i], -1, ARGV[i])
end
return removed

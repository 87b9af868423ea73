-- After a failover, make the new primary agree with what this process did on the old one in
-- its last seconds (writes the old primary took that may never have replicated):
--   ARGV[2] = 'done': the job finished. Its copy still in its queue (our pop did not
--     replicate) or in our working list (our ack did not) is removed, so it does not run again.
--   ARGV[2] = 'running': the job still runs here. Its copy in its queue is removed and it is
--     listed in our working list, so it is not run beside us and is not lost if we die.
-- KEYS[1] = queue:<q>; KEYS[2] = playguard:working:<identity>:<q> (reliable fetch only).
-- ARGV[1] = the exact payload.
-- Returns the copies removed from the queue (0 or 1), or -1 when a key holds another type than
-- a list (nothing is touched then).
for _, k in ipairs(KEYS) do
  local t = redis.call('TYPE', k)['ok']
  if t ~= 'list' and t ~= 'none' then
    return -1
  end
end
-- Our pop took it from the right end (RPOP, LMOVE RIGHT): its copy is nearest that end.
local removed = redis.call('LREM', KEYS[1], -1, ARGV[1])
if KEYS[2] then
  if ARGV[2] == 'done' then
    redis.call('LREM', KEYS[2], -1, ARGV[1])
  elseif not redis.call('LPOS', KEYS[2], ARGV[1]) then
    redis.call('LPUSH', KEYS[2], ARGV[1])
  end
end
return removed

-- Reliable fetch, after a fetch whose reply was lost (the script ran, the client timed out):
-- the jobs it moved sit at the left (newest) end of our working list, as nothing has been
-- fetched since. ARGV[1] is how many elements the process knows to be in the list (its
-- running and finished-but-unacknowledged jobs, counted high when unsure); the rest, taken
-- from the left, go back to the head of their queue, oldest last pushed (it is popped next).
-- KEYS[1] = playguard:working:<identity>:<q>, KEYS[2] = queue:<q>; ARGV[1] = known count
-- Returns how many moved, or -1 (KEYS[2] holds another type than a list: nothing moved).
local t = redis.call('TYPE', KEYS[2])['ok']
if t ~= 'list' and t ~= 'none' then
  return -1
end
local n = redis.call('LLEN', KEYS[1]) - tonumber(ARGV[1])
local moved = 0
while moved < n do
  local job = redis.call('LPOP', KEYS[1])
  if not job then break end
  redis.call('RPUSH', KEYS[2], job)
  moved = moved + 1
end
return moved

-- Clean stop: push whatever is still in our own working lists back to the heads of their
-- queues. Each job is in exactly one place at every moment.
-- KEYS = pairs {playguard:working:<identity>:<q>, queue:<q>}
local moved = 0
for i = 1, #KEYS, 2 do
  while true do
    local job = redis.call('LPOP', KEYS[i])
    if not job then break end
    redis.call('RPUSH', KEYS[i + 1], job)
    moved = moved + 1
  end
end
return moved

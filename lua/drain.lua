-- Clean stop: push whatever is still in our own working lists back to the heads of their
-- queues. Each job is in exactly one place at every moment.
-- KEYS = pairs {playguard:working:<identity>:<q>, queue:<q>}
-- A queue key holding another type than a list is skipped (an RPUSH would fail after the LPOP
-- and lose the job): its jobs stay in the working list, for the orphan sweep.
-- Returns {moved, skipped queue key, ...}.
local moved = 0
local out = {0}
for i = 1, #KEYS, 2 do
  local t = redis.call('TYPE', KEYS[i + 1])['ok']
  if t ~= 'list' and t ~= 'none' then
    out[#out + 1] = KEYS[i + 1]
  else
    while true do
      local job = redis.call('LPOP', KEYS[i])
      if not job then break end
      redis.call('RPUSH', KEYS[i + 1], job)
      moved = moved + 1
    end
  end
end
out[1] = moved
return out

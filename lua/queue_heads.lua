-- The heartbeat's read of each served queue: its oldest job (for the queue-latency gauge) and
-- whether its keys hold a list at all. Read only; a wrong type is reported, never an error, so
-- one bad key cannot fail the read of the others.
-- KEYS[1..n]    = queue:<q>
-- KEYS[n+1..2n] = playguard:working:<identity>:<q>, same order (reliable fetch only: absent
--                 with basic fetch)
-- ARGV[1]       = n
-- Returns one entry per queue: its oldest job (the right end; false when empty), or
-- {key, type} when the queue's key or its working list holds another type than a list.
local n = tonumber(ARGV[1])
local out = {}
for i = 1, n do
  local entry = false
  for _, key in ipairs({KEYS[i], KEYS[n + i]}) do
    local t = redis.call('TYPE', key).ok
    if t ~= 'list' and t ~= 'none' then
      entry = {key, t}
      break
    end
  end
  if not entry then
    entry = redis.call('LINDEX', KEYS[i], -1)
  end
  out[i] = entry
end
return out

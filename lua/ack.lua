-- Acknowledge finished jobs in one call: remove each from its working list.
-- KEYS[i] = playguard:working:<identity>:<q>, ARGV[i] = the exact payload of the i-th job.
-- Jobs mostly finish in the order they were fetched, and the oldest sit rightmost, so the
-- finished jobs of a key are usually its tail: those go with one LRANGE and one LTRIM instead
-- of one LREM each; any others (a job that overtook a slower one) with LREM as before.
local byKey = {}
local keys = {}
for i = 1, #KEYS do
  local k = KEYS[i]
  local set = byKey[k]
  if not set then
    set = { count = 0, jobs = {} }
    byKey[k] = set
    keys[#keys + 1] = k
  end
  set.jobs[ARGV[i]] = (set.jobs[ARGV[i]] or 0) + 1
  set.count = set.count + 1
end
local removed = 0
for _, k in ipairs(keys) do
  local set = byKey[k]
  local tail = redis.call('LRANGE', k, -set.count, -1)
  local trimmed = 0
  for j = #tail, 1, -1 do
    local left = set.jobs[tail[j]]
    if not left or left == 0 then break end
    set.jobs[tail[j]] = left - 1
    trimmed = trimmed + 1
  end
  if trimmed > 0 then
    redis.call('LTRIM', k, 0, -trimmed - 1)
    removed = removed + trimmed
  end
  if trimmed < set.count then
    for job, left in pairs(set.jobs) do
      for _ = 1, left do
        removed = removed + redis.call('LREM', k, -1, job)
      end
    end
  end
end
return removed

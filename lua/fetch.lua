-- Move up to ARGV[1] jobs from the queues, in the order given, in one atomic step.
-- Reliable fetch (ARGV[2] = '0'): each queue's jobs go into this process's working list with
-- one LPUSH (no moment where a job is only in memory).
--   KEYS[1..n]    = queue:<q> in fetch order
--   KEYS[n+1..2n] = playguard:working:<identity>:<q>, same order
-- Basic fetch (ARGV[2] = '1'): KEYS = queue:<q> only; the jobs are just popped, as BRPOP
-- would pop them one by one (Sidekiq OSS keeps a popped job only in memory too).
-- Returns a flat array {index, job, index, job, ...} (index = 1-based position in KEYS[1..n]).
local basic = ARGV[2] == '1'
local n = basic and #KEYS or #KEYS / 2
local want = tonumber(ARGV[1])
local out = {}
for i = 1, n do
  if want <= 0 then break end
  -- RPOP with a count takes the oldest jobs first (the client LPUSHes on the left).
  local jobs = redis.call('RPOP', KEYS[i], want)
  if jobs then
    if not basic then
      -- Several values in one LPUSH leave the same order as one LPUSH each: oldest rightmost.
      redis.call('LPUSH', KEYS[n + i], unpack(jobs))
    end
    for _, job in ipairs(jobs) do
      out[#out + 1] = i
      out[#out + 1] = job
    end
    want = want - #jobs
  end
end
return out

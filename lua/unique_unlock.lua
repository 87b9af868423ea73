-- Releases one job's hold on a sidekiq-unique-jobs lock, in the gem's key layout: the
-- server side's unlock after (until_executed) or before (until_executing, the outer lock
-- of until_and_while_executing) a run, and the runtime lock (`<digest>:RUN`) after one.
-- Called by src/job/unique_jobs.rs.
--
-- KEYS[1] <digest>  KEYS[2] <digest>:QUEUED  KEYS[3] <digest>:PRIMED  KEYS[4] <digest>:LOCKED
-- KEYS[5] <digest>:INFO  KEYS[6] uniquejobs:changelog  KEYS[7] uniquejobs:digests
-- ARGV[1] jid  ARGV[2] lock type  ARGV[3] limit  ARGV[4] now (float seconds)
-- ARGV[5] how many changelog entries to keep (0: write none)
--
-- Returns the jid once released, false when another job holds the lock (left untouched).
local digest, queued, primed, locked, info, changelog, digests =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local jid, lock_type, limit, now, keep = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])

local function note(message)
  if keep <= 0 then return end
  local entry = cjson.encode({digest = digest, job_id = jid, script = "unique_unlock.lua",
    message = message, time = now})
  redis.call("ZADD", changelog, now, entry)
  redis.call("ZREMRANGEBYRANK", changelog, 0, -1 * keep)
  redis.call("PUBLISH", changelog, entry)
end

if redis.call("HEXISTS", locked, jid) == 0 then
  -- Not ours: leave someone else's lock alone; a lock nobody holds any more is cleaned.
  if redis.call("LLEN", queued) > 0 or redis.call("LLEN", primed) > 0
      or redis.call("HLEN", locked) > 0 then
    note("Yielding to: " .. locked)
    return false
  end
end

redis.call("LREM", queued, -1, jid)
redis.call("LREM", primed, -1, jid)
-- until_expired leaves its lock to the TTL.
if lock_type ~= "until_expired" then
  redis.call("DEL", digest, info)
  redis.call("HDEL", locked, jid)
end
if redis.call("LLEN", primed) == 0 then redis.call("DEL", primed) end
local holders = redis.call("HLEN", locked)
if holders < 1 then redis.call("DEL", locked) end
if holders <= 1 and (limit == nil or limit <= 1) then
  redis.call("ZREM", digests, digest)
end
-- The gem's waiters block on QUEUED: one token tells the next of them it may lock now.
redis.call("LPUSH", queued, "1")
redis.call("PEXPIRE", queued, 5000)
note("Unlocked")
return jid

-- Takes (or confirms) one job's hold on a sidekiq-unique-jobs lock, in the gem's key layout:
-- the runtime lock (`<digest>:RUN`) of while_executing and until_and_while_executing before a
-- run, until_executed's lock when its job runs without it (a retry after the unlock), and the
-- relock after a failed until_executing run. Called by src/job/unique_jobs.rs.
--
-- KEYS[1] <digest>  KEYS[2] <digest>:QUEUED  KEYS[3] <digest>:PRIMED  KEYS[4] <digest>:LOCKED
-- KEYS[5] <digest>:INFO  KEYS[6] uniquejobs:changelog  KEYS[7] uniquejobs:digests
-- ARGV[1] jid  ARGV[2] ttl in ms (0: none)  ARGV[3] limit  ARGV[4] score ("" : now)
-- ARGV[5] now (float seconds)  ARGV[6] how many changelog entries to keep (0: write none)
--
-- Returns the jid when this job holds the lock, else the jid of one that holds it.
local digest, queued, primed, locked, info, changelog, digests =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local jid, pttl, limit, score, now, keep =
  ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])

local function note(message, prev)
  if keep <= 0 then return end
  local entry = cjson.encode({digest = digest, job_id = jid, script = "unique_lock.lua",
    message = message, time = now, prev_jid = prev})
  redis.call("ZADD", changelog, now, entry)
  redis.call("ZREMRANGEBYRANK", changelog, 0, -1 * keep)
  redis.call("PUBLISH", changelog, entry)
end

if redis.call("HEXISTS", locked, jid) == 1 then return jid end
if redis.call("HLEN", locked) >= limit then
  local holder = redis.call("HKEYS", locked)[1]
  note("Limited", holder)
  return holder
end

redis.call("SET", digest, jid)
if score == "" then score = now end
redis.call("ZADD", digests, score, digest)
redis.call("HSET", locked, jid, now)
redis.call("LREM", queued, -1, jid)
redis.call("LREM", primed, 1, jid)
if pttl > 0 then
  redis.call("PEXPIRE", digest, pttl)
  redis.call("PEXPIRE", locked, pttl)
  redis.call("PEXPIRE", info, pttl)
end
note("Locked")
return jid

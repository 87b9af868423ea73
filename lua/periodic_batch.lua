-- One bounded step of a periodic tick (src/loops/periodic_tick.rs): at most one batch of the
-- tick's payloads, pushed in the same step that claims the tick (the first batch) or that
-- checks and advances the tick's recorded progress (every later one). So a tick is never
-- claimed without its first jobs, no batch is pushed twice, and a retried step whose earlier
-- attempt landed (lost reply) pushes nothing.
-- KEYS[1] = playguard:periodic:<name>:<tick> (the fingerprint: the claimer's identity)
-- KEYS[2] = playguard:periodic-progress:<name>:<tick> (hash: owner, lease (Redis ms), step,
--           cursor, skip, pushed, done; written only for a tick longer than one batch)
-- KEYS[3] = queues, KEYS[4] = queue:<q>
-- ARGV[1] = identity, ARGV[2] = TTL of both keys (s), ARGV[3] = the queue name <q>,
-- ARGV[4] = the step this batch continues from (0: the claim),
-- ARGV[5] = the owner whose lapsed lease this batch takes over ('' for none),
-- ARGV[6] = the owner lease (ms) this batch grants (0: leave the tick to a peer now),
-- ARGV[7], ARGV[8] = the SSCAN cursor and the number of that reply's members pushed once this
--   batch landed ('0', '0': the tick is done), ARGV[9..] = the payloads (at most 1,000).
-- Returns {code, pushed}: 1 pushed (pushed = the tick's total so far), 2 this step had landed
-- already (a retry), -1 a peer claimed the tick, -2 this process does not own the tick (taken
-- over, or its record is gone), -3 the owner's lease still holds.
local me, ttl, step = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[4])
local from, lease = ARGV[5], tonumber(ARGV[6])
local n = #ARGV - 8
local done = ARGV[7] == '0' and ARGV[8] == '0'
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function push()
  if n > 0 then
    redis.call('SADD', KEYS[3], ARGV[3])
    for i = 9, #ARGV, 1000 do
      redis.call('LPUSH', KEYS[4], unpack(ARGV, i, math.min(i + 999, #ARGV)))
    end
  end
end

local function record(pushed)
  redis.call('HSET', KEYS[2], 'owner', me, 'lease', now + lease, 'step', step + 1,
    'cursor', ARGV[7], 'skip', ARGV[8], 'pushed', pushed, 'done', done and 1 or 0)
  redis.call('EXPIRE', KEYS[2], ttl)
end

if step == 0 then
  if not redis.call('SET', KEYS[1], me, 'NX', 'EX', ttl) then
    if redis.call('GET', KEYS[1]) ~= me then
      return {-1, 0}
    end
    -- Ours: an earlier attempt of this very step landed, unless a peer took over since.
    local p = redis.call('HMGET', KEYS[2], 'owner', 'step', 'pushed')
    if not p[1] then
      return {2, n}
    end
    if p[1] == me and tonumber(p[2]) == 1 then
      return {2, tonumber(p[3])}
    end
    return {-2, 0}
  end
  push()
  if not done then
    record(n)
  end
  return {1, n}
end

local p = redis.call('HMGET', KEYS[2], 'owner', 'lease', 'step', 'pushed', 'done')
if not p[1] then
  return {-2, 0}
end
local at = tonumber(p[3])
if p[1] == me then
  if at == step + 1 then
    return {2, tonumber(p[4])}
  end
elseif from == '' or p[1] ~= from then
  return {-2, 0}
elseif tonumber(p[2]) > now then
  return {-3, 0}
end
if at ~= step or p[5] == '1' then
  return {-2, 0}
end
push()
local pushed = tonumber(p[4]) + n
record(pushed)
redis.call('EXPIRE', KEYS[1], ttl)
return {1, pushed}

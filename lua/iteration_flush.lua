-- Keys: KEYS[1] = it-<jid>, the hash Sidekiq 8.1's iterable jobs keep their state in.
-- Writes a cycle's progress as Sidekiq's Iterable#flush_state does (lib/sidekiq/job/iterable.rb,
-- v8.1.7: HSET ex c rt, EXPIRE STATE_TTL NX, HGET cancelled, in one MULTI). EXPIRE's NX needs
-- Redis 7.0; this script gives the same "set the TTL only when the key has none" on 6.2.
--   ARGV[1] = ex (executions, integer), ARGV[2] = c (the cursor as JSON: the phase name),
--   ARGV[3] = rt (runtime in seconds, a float), ARGV[4] = the TTL in seconds.
-- Reply: the `cancelled` field (Unix seconds as a string), or nil when the job is not cancelled.
redis.call('HSET', KEYS[1], 'ex', ARGV[1], 'c', ARGV[2], 'rt', ARGV[3])
if redis.call('TTL', KEYS[1]) == -1 then
  redis.call('EXPIRE', KEYS[1], ARGV[4])
end
return redis.call('HGET', KEYS[1], 'cancelled')

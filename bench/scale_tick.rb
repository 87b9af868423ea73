# bench/scale.rb's tick curve: one `[[periodic]]` tick over a set of TICK_MEMBERS (1,000,000)
# Marquees with 4 playguard processes. It reads only what any fan-out must produce (the
# manifest, the member set, the queue), never how the processes split the work: the tick's
# wall time runs from its boundary until `queue:marquee` holds one job per member, and
# SLOWLOG (every command over 1 ms, reset just before the boundary) gives the longest single
# Redis command in that window, which every other client of that Redis waited behind.
# Ruby Sidekiq has no equivalent (sidekiq-cron enqueues one job per cron entry; it does not
# fan out over a set). Uses scale.rb's helpers (R, spawn_worker, stop, wait_for, redis_cpu).
TICK_SET = 'playguard:marquees:launchable'

# Every job in `queue:marquee` names one member, each member once (the args are [member]).
def one_job_per_member?(members)
  seen = Array.new(members + 1, false)
  total = 0
  (0...R.llen('queue:marquee')).step(10_000) do |i|
    R.lrange('queue:marquee', i, i + 9_999).each do |job|
      args = JSON.parse(job)['args']
      m = args.first
      return false unless args.size == 1 && m.is_a?(Integer) && m.between?(1, members) && !seen[m]
      seen[m] = true
      total += 1
    end
  end
  total == members
end

# The processes start with an empty set (they fire the tick they start in with no members);
# the set is filled 2 s after a boundary (past every process's read of the empty set), so the
# next tick is the first with members and is measured whole.
def fill_after_boundary(members, every)
  boundary = ((Time.now.to_f / every).floor + 1) * every
  sleep(boundary - Time.now.to_f + 2)
  (1..members).each_slice(10_000) { |s| R.sadd(TICK_SET, s) }
  next_boundary = boundary + every
  if Time.now.to_f > next_boundary - 1
    raise "filling #{members} members took past the next tick's boundary: raise TICK_EVERY (#{every})"
  end
  raise "a tick pushed #{R.llen('queue:marquee')} jobs before the measured one" unless R.llen('queue:marquee').zero?
  next_boundary
end

def tick_once(members, every, dir)
  R.flushdb
  pids = (1..4).map { spawn_worker(%w[-q bench -c 5], "tick-#{_1}", dir: dir) }
  wait_for('4 registered', 60, 0.01) { R.scard('processes') >= 4 }
  boundary = fill_after_boundary(members, every)
  R.config(:set, 'slowlog-log-slower-than', 1000)
  R.config(:set, 'slowlog-max-len', 100_000)
  R.slowlog(:reset)
  r0 = redis_cpu
  wait_for("the tick of #{members} members", every + 300, 0.001) { R.llen('queue:marquee') >= members }
  secs = Time.now.to_f - boundary
  cpu = redis_cpu - r0
  slow = R.slowlog(:get, 100_000)
  pids.each { stop(_1) }
  worst = slow.max_by { _1[2] }
  { secs: secs, redis_s: cpu, worst_ms: worst ? worst[2] / 1000.0 : 0.0, worst_cmd: worst ? worst[3].first.to_s.downcase : '-',
    over10: slow.count { _1[2] > 10_000 }, once: one_job_per_member?(members) }
end

# Table lines for scale.md.
def tick_curve
  members = Integer(ENV.fetch('TICK_MEMBERS', '1000000'))
  every = Integer(ENV.fetch('TICK_EVERY', '30'))
  warn "== periodic tick: #{members} members, 4 processes, every_secs = #{every}"
  dir = Dir.mktmpdir('scale-tick', OUT)
  FileUtils.mkdir_p(File.join(dir, 'jobs'))
  File.write(File.join(dir, 'jobs', 'tick.toml'), <<~TOML)
    [[periodic]]
    name = "scale-tick"
    every_secs = #{every}
    class = "PlayguardJob"
    queue = "marquee"
    for_each_member_of = "#{TICK_SET}"
  TOML
  r = tick_once(members, every, dir)
  warn format('   boundary → %d jobs pushed: %.2f s; slowest Redis command %.1f ms (%s); %d over 10 ms; one job per member: %s',
              members, r[:secs], r[:worst_ms], r[:worst_cmd], r[:over10], r[:once] ? 'yes' : 'NO')
  ["One periodic tick over a set of #{members} members with 4 playguard processes (`every_secs = #{every}`; " \
   'the set filled after the processes started, 2 s after a boundary; SLOWLOG reset before the measured ' \
   'boundary, every command over 1 ms kept). Ruby Sidekiq has no equivalent: sidekiq-cron enqueues one job ' \
   'per cron entry and does not fan out over a set.', '',
   '| members | boundary → all pushed, s | slowest Redis command, ms | its command | commands over 10 ms | Redis CPU in the tick, s | one job per member |',
   '|---:|---:|---:|---|---:|---:|---|',
   "| #{members} | #{format('%.2f', r[:secs])} | #{format('%.1f', r[:worst_ms])} | #{r[:worst_cmd]} | #{r[:over10]} | " \
   "#{format('%.2f', r[:redis_s])} | #{r[:once] ? 'yes' : 'no'} |", ''] + outlasted(r, every)
end

# A tick longer than its period overlaps the next one, whose jobs then count toward this one.
def outlasted(r, every)
  return [] if r[:secs] < every
  warn "   the tick outlasted its period (every_secs = #{every}): run again with a larger TICK_EVERY"
  ["The tick outlasted its period (#{format('%.1f', r[:secs])} s against every_secs = #{every}), so the " \
   'next tick overlapped it: run again with a larger TICK_EVERY.', '']
end

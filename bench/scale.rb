# Driver for bench/scale.sh: does a cost per job (or per tick) stay flat as the fleet and its
# data grow? Each curve measures the same thing at two sizes against the private redis-server
# scale.sh started, and prints both and their ratio. Two more are measured once, in tables of
# their own: scheduled-job lateness beside Ruby Sidekiq (scale_lateness.rb) and the 1,000,000-
# member periodic tick (scale_tick.rb). CPU figures are CPU time (worker: user +
# system of the process and its reaped children, from /proc; Redis: used_cpu_sys + user), so
# they move less with machine load than wall-clock rates do. Every wait has a deadline.
require_relative 'common'
require 'fileutils'
require 'etc'

BIN = ENV.fetch('PG_BIN')
OUT = ENV.fetch('OUT_DIR')
M = Integer(ENV.fetch('SCALE_JOBS', '20000'))
CLK_TCK = Integer(`getconf CLK_TCK`.strip) rescue 100

# CPU seconds of a process: its live threads' run time in ns (schedstat: finer than the
# 10 ms ticks of /proc/<pid>/stat), plus its reaped children.
def proc_cpu(pid)
  threads = Dir["/proc/#{pid}/task/*/schedstat"].sum { |f| File.read(f).split.first.to_i rescue 0 } / 1e9
  f = File.read("/proc/#{pid}/stat").split(') ', 2).last.split
  threads + (f[13].to_i + f[14].to_i).to_f / CLK_TCK
end

# proc_cpu of a process plus its live descendants (the command guardian and what it reaped):
# a child's CPU reaches its parent's counters only once it is reaped.
def tree_cpu(pid)
  kids = Dir["/proc/#{pid}/task/*/children"].flat_map { |f| File.read(f).split.map(&:to_i) rescue [] }
  proc_cpu(pid) + kids.sum { |k| tree_cpu(k) rescue 0 }
end

def spawn_worker(args, tag, dir: OUT, log: 'warn')
  Process.spawn({ 'REDIS_URL' => URL, 'RUST_LOG' => log }, BIN, 'run', '-r', URL, *args,
                out: File.join(OUT, "#{tag}.log"), err: [:child, :out], chdir: dir, pgroup: true)
end

def stop(pid)
  Process.kill('TERM', pid)
  deadline = now + 40
  until Process.waitpid(pid, Process::WNOHANG)
    if now > deadline
      Process.kill('KILL', pid)
      Process.waitpid(pid)
      break
    end
    sleep 0.005
  end
end

def payload(klass, queue, jid, extra = {})
  t = Time.now.to_f
  JSON.generate({ 'class' => klass, 'args' => [], 'retry' => true, 'queue' => queue, 'jid' => jid,
                  'created_at' => t, 'enqueued_at' => t }.merge(extra))
end

# LPUSH n copies of one payload (or, with `%d` in it, n numbered ones) server-side, in chunks.
FILL_LIST = <<~LUA
  for i = tonumber(ARGV[2]), tonumber(ARGV[3]) do
    redis.call('LPUSH', KEYS[1], (string.gsub(ARGV[1], '%%d', tostring(i))))
  end
LUA
FILL_ZSET = <<~LUA
  for i = tonumber(ARGV[2]), tonumber(ARGV[3]) do
    redis.call('ZADD', KEYS[1], tonumber(ARGV[4]) + i * 0.000001, (string.gsub(ARGV[1], '%%d', tostring(i))))
  end
LUA

def fill(script, key, template, n, *extra)
  (1..n).each_slice(50_000) { |s| R.eval(script, keys: [key], argv: [template, s.first, s.last, *extra]) }
  R.sadd('queues', key.delete_prefix('queue:')) if key.start_with?('queue:')
end

# Run `m` jobs through a fresh worker; CPU per job from its first pop until `done` holds.
# skip: jobs run before the measurement starts (a one-time cost such as the dead set's first trim).
def per_job(args, m, tag, left:, log: 'warn', skip: 0)
  pid = spawn_worker(args, tag, log: log)
  start = left.call
  wait_for("#{tag}: first pop", 60) { left.call < start }
  if skip > 0
    wait_for("#{tag}: #{skip} warm-up jobs", 60) { left.call <= start - skip }
    start = left.call
    m = [m, start].min
  end
  c0 = proc_cpu(pid)
  r0 = redis_cpu
  t0 = now
  wait_for("#{tag}: #{m} jobs done", 600) { left.call <= start - m }
  secs = now - t0
  res = { worker_us: (proc_cpu(pid) - c0) * 1e6 / m, redis_us: (redis_cpu - r0) * 1e6 / m, rate: m / secs }
  stop(pid)
  res
end

ROWS = []

def row(curve, unit, small, a, big, b, key)
  x = a[key]
  y = b[key]
  ratio = y / x
  ROWS << [curve, unit, small, format('%.2f', x), big, format('%.2f', y), format('%.2f', ratio),
           ratio <= 1.2 ? 'yes' : 'no']
  warn "   #{curve}: #{small} #{format('%.2f', x)} #{unit}, #{big} #{format('%.2f', y)} #{unit} (×#{format('%.2f', ratio)})"
end

LEFT = "local n = 0 for _, k in ipairs(KEYS) do n = n + redis.call('LLEN', k) end " \
       "for _, k in ipairs(redis.call('KEYS', 'playguard:working:*')) do n = n + redis.call('LLEN', k) end return n"
LEN_SUM = "local n = 0 for _, k in ipairs(KEYS) do n = n + redis.call('LLEN', k) end return n"
def left_in(*keys) = -> { R.eval(LEFT, keys: keys) }

only = ENV['CURVES']&.split(',')
want = ->(c) { only.nil? || only.include?(c) }

if want.('depth')
  warn "== queue depth: #{M} jobs taken from a queue #{M} + 1,000 vs #{M} + 1,000,000 deep (reliable, -c 50)"
  r = [1_000, 1_000_000].map do |depth|
    R.flushdb
    fill(FILL_LIST, 'queue:bench', payload('NoopJob', 'bench', 'j%d'), depth + M)
    pid = spawn_worker(%w[-q bench -c 50 --fetch reliable], "depth-#{depth}")
    wait_for('first pop', 60) { R.llen('queue:bench') < depth + M }
    c0 = proc_cpu(pid)
    r0 = redis_cpu
    wait_for("#{M} jobs taken", 300) { R.llen('queue:bench') <= depth }
    res = { worker_us: (proc_cpu(pid) - c0) * 1e6 / M, redis_us: (redis_cpu - r0) * 1e6 / M }
    stop(pid)
    res
  end
  row('queue depth', 'worker µs/job', '1,000', r[0], '1,000,000', r[1], :worker_us)
  row('queue depth', 'Redis µs/job', '1,000', r[0], '1,000,000', r[1], :redis_us)
end

if want.('dead')
  n = M / 4
  warn "== dead set: #{n} jobs of an unknown class with retry: 0 (each goes to dead), dead set 0 vs 100,000"
  r = [0, 100_000].map do |size|
    R.flushdb
    fill(FILL_ZSET, 'dead', payload('OldJob', 'bench', 'dead%d'), size, Time.now.to_f - 3600) if size > 0
    fill(FILL_LIST, 'queue:bench', payload('NoSuchJob', 'bench', 'x%d', 'retry' => 0), n + 500)
    # The first kills trim a 100,000-entry set to Sidekiq's 10,000 once: measured apart.
    per_job(%w[-q bench -c 50 --fetch reliable], n, "dead-#{size}", left: left_in('queue:bench'),
            log: 'error', skip: 500).merge(size: R.zcard('dead'))
  end
  warn "   dead set after each run: #{r.map { _1[:size] }.join(' and ')} entries"
  row('dead set, after the first trim of 100,000', 'worker µs/job', '0', r[0], '100,000', r[1], :worker_us)
  row('dead set, after the first trim of 100,000', 'Redis µs/job', '0', r[0], '100,000', r[1], :redis_us)
end

if want.('schedule')
  secs = Float(ENV.fetch('SCHEDULE_SECS', '10'))
  warn "== schedule set: an idle worker polling every ~0.05 s (so each size has some 200 polls to average) for #{secs}s, 1,000 vs 1,000,000 future jobs"
  r = [1_000, 1_000_000].map do |size|
    R.flushdb
    fill(FILL_ZSET, 'schedule', payload('NoopJob', 'bench', 's%d'), size, Time.now.to_f + 86_400)
    pid = spawn_worker(%w[-q bench -c 5 --poll-interval 0.05], "schedule-#{size}")
    wait_for('registered', 30, 0.01) { R.scard('processes') > 0 }
    sleep 2
    R.config(:resetstat)
    r0 = redis_cpu
    sleep secs
    cpu = redis_cpu - r0
    polls = commandstats.fetch('zrange', 0) / 2.0 # one ZRANGE for retry, one for schedule
    zrange_us = commandstats('usec').fetch('zrange', 0) / [polls, 1].max
    stop(pid)
    { redis_us_s: cpu * 1e6 / secs, zrange_us: zrange_us }
  end
  row('schedule set', 'Redis time in the poller\'s ZRANGEs, µs per poll', '1,000', r[0], '1,000,000', r[1], :zrange_us)
  row('schedule set', 'Redis CPU µs/s, idle worker (Redis\'s own cron included)', '1,000', r[0], '1,000,000', r[1], :redis_us_s)
end

if want.('queues')
  warn "== weighted queues: #{M} jobs over 1 queue vs spread over 100 queues of weight 1 (reliable, -c 50)"
  r = [1, 100].map do |nq|
    R.flushdb
    qs = (0...nq).map { "w#{_1}" }
    qs.each { |q| fill(FILL_LIST, "queue:#{q}", payload('NoopJob', q, "#{q}-%d"), M / nq) }
    args = qs.flat_map { ['-q', nq == 1 ? _1 : "#{_1},1"] } + %w[-c 50 --fetch reliable]
    per_job(args, M, "queues-#{nq}", left: left_in(*qs.map { "queue:#{_1}" }))
  end
  row('queues', 'worker µs/job', '1', r[0], '100 weighted', r[1], :worker_us)
  row('queues', 'Redis µs/job', '1', r[0], '100 weighted', r[1], :redis_us)
end

if want.('idle')
  secs = Float(ENV.fetch('IDLE_SECS', '10'))
  warn "== idle processes: 1 vs 50 idle workers against one Redis, #{secs}s each (minus Redis alone)"
  R.flushdb
  r0 = redis_cpu
  sleep secs
  alone = (redis_cpu - r0) * 1e6 / secs
  r = [1, 50].map do |np|
    R.flushdb
    pids = (1..np).map { spawn_worker(%w[-q bench -c 10], "idle-#{np}-#{_1}") }
    wait_for("#{np} registered", 120, 0.05) { R.scard('processes') >= np }
    sleep 6 # past every process's first beat, sweep and poll
    R.config(:resetstat)
    r0 = redis_cpu
    sleep secs
    cpu = redis_cpu - r0
    n = commandstats.reject { |c, _| %w[config info].include?(c) }.values.sum
    pids.each { stop(_1) }
    { cmds: n / secs / np, redis_us: (cpu * 1e6 / secs - alone) / np }
  end
  row('idle processes', 'Redis cmds/s per process', '1', r[0], '50', r[1], :cmds)
  row('idle processes', 'Redis CPU µs/s per process', '1', r[0], '50', r[1], :redis_us)
end

if want.('periodic')
  every = Integer(ENV.fetch('PERIODIC_EVERY', '2'))
  ticks = Integer(ENV.fetch('PERIODIC_TICKS', '4'))
  warn "== periodic dispatch: 4 processes, every #{every}s, 1,000 vs 10,000 Marquees, #{ticks} ticks each"
  dir = Dir.mktmpdir('scale-periodic', OUT)
  FileUtils.mkdir_p(File.join(dir, 'jobs'))
  File.write(File.join(dir, 'jobs', 'dispatch.toml'), <<~TOML)
    [[periodic]]
    name = "scale-dispatch"
    every_secs = #{every}
    class = "PlayguardJob"
    queue = "marquee"
    for_each_member_of = "playguard:marquees:launchable"
  TOML
  r = [1_000, 10_000].map do |marquees|
    R.flushdb
    (1..marquees).each_slice(10_000) { |s| R.sadd('playguard:marquees:launchable', s) }
    pids = (1..4).map { spawn_worker(%w[-q bench -c 5], "periodic-#{marquees}-#{_1}", dir: dir) }
    wait_for('4 registered', 60, 0.01) { R.scard('processes') >= 4 }
    wait_for('first tick', every * 3 + 10, 0.005) { R.llen('queue:marquee') >= marquees }
    R.del('queue:marquee')
    lat = []
    r0 = redis_cpu
    ticks.times do
      boundary = (Time.now.to_f / every).floor * every + every
      wait_for('tick pushed', every * 3 + 10, 0.0005) { R.llen('queue:marquee') >= marquees }
      lat << Time.now.to_f - boundary
      R.del('queue:marquee')
    end
    cpu = redis_cpu - r0
    pids.each { stop(_1) }
    { tick_ms: lat.sort[lat.size / 2] * 1000, redis_ms: cpu * 1000 / ticks,
      redis_us_per_marquee: cpu * 1e6 / ticks / marquees, tick_us_per_marquee: lat.sort[lat.size / 2] * 1e6 / marquees }
  end
  ROWS << ['periodic tick, 4 processes', 'boundary → all pushed, ms', '1,000', format('%.1f', r[0][:tick_ms]),
           '10,000', format('%.1f', r[1][:tick_ms]), format('%.2f', r[1][:tick_ms] / r[0][:tick_ms]), 'n/a']
  row('periodic tick, 4 processes', 'boundary → all pushed, µs per Marquee', '1,000', r[0], '10,000', r[1], :tick_us_per_marquee)
  ROWS << ['periodic tick, 4 processes', 'Redis CPU ms per tick (4 idle processes included)', '1,000',
           format('%.1f', r[0][:redis_ms]), '10,000', format('%.1f', r[1][:redis_ms]),
           format('%.2f', r[1][:redis_ms] / r[0][:redis_ms]), 'n/a']
  marginal = (r[1][:redis_ms] - r[0][:redis_ms]) * 1000 / 9_000
  warn format('   Redis CPU per 10,000-Marquee tick: %.1f ms (%.2f%% of a core at one tick a minute); %.1f µs per extra Marquee',
              r[1][:redis_ms], r[1][:redis_ms] / 600.0, marginal)
end

# The machine's busy and total CPU ticks (all cores) from /proc/stat: how much of the machine
# a run used, whoever used it.
def machine_ticks
  f = File.readlines('/proc/stat').first.split.drop(1).map(&:to_i)
  idle = f[3] + f[4]
  [f.sum - idle, f.sum]
end

# The command guardian of worker `pid` (its child named playguard-shepherd:<pid>).
def guardian_of(pid)
  Dir["/proc/#{pid}/task/*/children"].flat_map { |f| File.read(f).split.map(&:to_i) rescue [] }
    .find { |k| File.read("/proc/#{k}/cmdline").include?('playguard-shepherd:') rescue false }
end

# A guardian's own threads (schedstat) and the commands it reaped (cutime + cstime), seconds.
def guardian_cpu(gpid)
  return [0.0, 0.0] unless gpid
  own = Dir["/proc/#{gpid}/task/*/schedstat"].sum { |f| File.read(f).split.first.to_i rescue 0 } / 1e9
  f = File.read("/proc/#{gpid}/stat").split(') ', 2).last.split
  [own, (f[13].to_i + f[14].to_i).to_f / CLK_TCK]
rescue Errno::ENOENT
  [0.0, 0.0]
end

# Context switches (voluntary + involuntary) of a process's live threads: each is a wakeup.
def ctx_switches(pid)
  Dir["/proc/#{pid}/task/*/status"].sum do |f|
    File.read(f).scan(/^(?:non)?voluntary_ctxt_switches:\s+(\d+)/).flatten.sum(&:to_i)
  rescue Errno::ENOENT
    0
  end
end

if want.('reconcile')
  n = Integer(ENV.fetch('CYCLES', '2000'))
  phase_counts = ENV.fetch('RECONCILE_PHASES', '1,6').split(',').map { Integer(_1) }
  warn "== reconcile cycles: #{n} Marquees, #{phase_counts.join(' vs ')} /bin/true phases (-c 25)"
  # The machine's own ceiling, measured here in the same run: bare spawns of /bin/true on every
  # core with nothing else running. A one-phase cycle is one such spawn plus the rest.
  floor_bin = File.join(File.dirname(BIN), 'spawn_floor')
  ceiling_once = lambda do
    c = Float(IO.popen([floor_bin, Etc.nprocessors.to_s, n.to_s], &:read))
    warn format('   ceiling: %.0f bare /bin/true spawns/s (%d threads, nothing else running)', c, Etc.nprocessors)
    c
  end
  cycles_once = lambda do |phases|
    dir = Dir.mktmpdir("scale-reconcile-#{phases}", OUT)
    FileUtils.mkdir_p(File.join(dir, 'jobs'))
    File.write(File.join(dir, 'jobs', 'reconcile.toml'), <<~TOML + (1..phases).map { |i| <<~PHASE }.join)
      [[job]]
      class = "PlayguardJob"
      lock = { key = "playguard:marquee:{args.0}", ttl_secs = 60, when_locked = "skip" }
      on_lock_lost = "abort"
    TOML
      [[job.phase]]
      name = "p#{i}"
      run = ["/bin/true"]
    PHASE
    R.flushdb
    fill(FILL_LIST, 'queue:marquee', '{"class":"PlayguardJob","args":[%d],"retry":true,"queue":"marquee","jid":"m%d"}', n)
    pid = spawn_worker(%w[-q marquee -c 25], "reconcile-#{phases}", dir: dir)
    wait_for('first pop', 60) { R.llen('queue:marquee') < n }
    # The worker's working list, named once: polling with KEYS over every lock and fence key
    # every 5 ms cost this Redis a quarter of what the cycles did.
    working = []
    wait_for('the working list', 60) { !(working = R.keys('playguard:working:*')).empty? }
    gpid = nil
    wait_for('the command guardian', 60) { gpid = guardian_of(pid) }
    # Every reading, taken the same way before and after the cycles.
    readings = lambda do
      [tree_cpu(pid), proc_cpu(pid), guardian_cpu(gpid), redis_cpu, commandstats, machine_ticks,
       [ctx_switches(pid), ctx_switches(gpid)], Process.clock_gettime(Process::CLOCK_PROCESS_CPUTIME_ID)]
    end
    c0, w0, g0, rc0, cs0, m0, x0, b0 = readings.call
    t0 = now
    wait_for("#{n} cycles", 600, 0.005) { R.eval(LEN_SUM, keys: ['queue:marquee', *working]).zero? }
    secs = now - t0
    c1, w1, g1, rc1, cs1, m1, x1, b1 = readings.call
    res = { rate: n / secs, cpu_ms: (c1 - c0) * 1000 / n, cpu_ms_phase: (c1 - c0) * 1000 / n / phases }
    warn format('   %d phase(s): %.0f cycles/s, %.2f CPU ms per cycle (worker + guardian + commands; the worker alone %.2f)',
                phases, res[:rate], res[:cpu_ms], (w1 - w0) * 1000 / n)
    per = ->(x) { x * 1000 / n }
    warn format('     per cycle, CPU ms: worker %.3f, guardian %.3f, commands %.3f (reaped by the guardian), ' \
                'redis-server %.3f, this driver %.3f',
                per.((w1 - w0)), per.(g1[0] - g0[0]), per.(g1[1] - g0[1]), per.(rc1 - rc0), per.(b1 - b0))
    calls = cs1.keys.to_h { |k| [k, cs1[k] - cs0.fetch(k, 0)] }.select { |_, v| v.positive? }
    warn '     Redis calls per cycle (the driver\'s polling EVAL included): ' +
         calls.sort_by { -_2 }.map { |k, v| format('%s %.2f', k.delete_prefix('cmdstat_'), v / n) }.join(', ')
    warn format('     context switches per cycle: worker %.1f, guardian %.1f', (x1[0] - x0[0]).to_f / n, (x1[1] - x0[1]).to_f / n)
    busy = m1[0] - m0[0]
    warn format('     machine: %.0f%% of %d cores busy over the run (everyone, not only this bench), load %s',
                100.0 * busy / (m1[1] - m0[1]), Etc.nprocessors, File.read('/proc/loadavg').split.first)
    stop(pid)
    res
  end
  # This curve moves most with the machine's hour (a shared VM: ±10% between runs minutes
  # apart), so it runs RECONCILE_ROUNDS interleaved rounds (ceiling, then each phase count)
  # and reports medians with min-max.
  rounds = Integer(ENV.fetch('RECONCILE_ROUNDS', '3'))
  ceilings = []
  per_round = Array.new(phase_counts.size) { [] }
  rounds.times do |i|
    warn "   round #{i + 1}/#{rounds}"
    ceilings << ceiling_once.call
    phase_counts.each_with_index { |phases, j| per_round[j] << cycles_once.call(phases) }
  end
  med = ->(xs) { xs.sort[(xs.size - 1) / 2] }
  spread = ->(xs, f) { format("#{f} (#{f}–#{f})", med.(xs), xs.min, xs.max) }
  ceiling = med.(ceilings)
  r = per_round.map { |rs| %i[rate cpu_ms cpu_ms_phase].to_h { |k| [k, med.(rs.map { _1[k] })] } }
  rates = per_round.map { |rs| rs.map { _1[:rate] } }
  warn "   medians of #{rounds}: ceiling #{spread.(ceilings, '%.0f')} spawns/s; " +
       phase_counts.each_with_index.map { |ph, j| "#{ph} phase(s) #{spread.(rates[j], '%.0f')} cycles/s" }.join(', ')
  if r.size == 2
    ROWS << ['reconcile', "cycles/s (wall clock), median of #{rounds} rounds (min–max)", '1 phase', spread.(rates[0], '%.0f'),
             '6 phases', spread.(rates[1], '%.0f'), format('%.2f', r[1][:rate] / r[0][:rate]), 'n/a']
    ROWS << ['reconcile', "the machine's ceiling: bare /bin/true spawns/s on #{Etc.nprocessors} threads, then one-phase cycles/s (medians)",
             'spawns/s', spread.(ceilings, '%.0f'), 'cycles/s', format('%.0f', r[0][:rate]),
             format('%.2f', r[0][:rate] / ceiling), 'n/a']
    row('reconcile', 'CPU ms per phase (worker + guardian + commands), medians', '1 phase', r[0], '6 phases', r[1], :cpu_ms_phase)
  end
end

# Curves measured once, not at two sizes: tables of their own, after the main one.
require_relative 'scale_lateness'
require_relative 'scale_tick'
extra = []
extra += lateness_curve if want.('lateness')
extra += tick_curve if want.('tick')

lines = []
unless ROWS.empty?
  lines += ['| curve | cost | size A | at A | size B | at B | B ÷ A | per-unit cost grows ≤ 20% |', '|---|---|---:|---:|---:|---:|---:|---|']
  ROWS.each { lines << "| #{_1.join(' | ')} |" }
  lines << '' unless extra.empty?
end
lines += extra
puts lines.join("\n")
File.write(File.join(OUT, 'scale.md'), lines.join("\n") + "\n")

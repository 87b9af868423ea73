# Benchmark driver for bench/run.sh: Ruby Sidekiq 6.4.1, rusty-sidekiq 0.15.2 and playguard
# (reliable and basic fetch), each both quiet and at INFO, on no-op jobs; then Ruby Sidekiq and
# playguard reliable, quiet, on jobs that work (200 µs of CPU, a /bin/true command). All against
# the private redis-server run.sh started. ROUNDS interleaved rounds (each round runs every kind
# once, in a rotated order); every figure is the median over the rounds with its min-max. Every
# wait has a deadline.
require_relative 'common'
require 'sidekiq/api'
require 'etc'

N = Integer(ENV.fetch('BENCH_JOBS', '100000'))
WORK_N = Integer(ENV.fetch('BENCH_WORK_JOBS', '20000'))
CPU_US = Integer(ENV.fetch('CPU_US', '200'))
ROUNDS = Integer(ENV.fetch('ROUNDS', '3'))
PG_CONC = Integer(ENV.fetch('PG_CONCURRENCY', '50'))
RUBY_CONC = Integer(ENV.fetch('RUBY_CONCURRENCY', '10'))
RUSTY_CONC = Integer(ENV.fetch('RUSTY_CONCURRENCY', '25'))
LAT_SAMPLES = Integer(ENV.fetch('LAT_SAMPLES', '200'))
IDLE_SECS = Float(ENV.fetch('IDLE_SECS', '5'))
BIN = ENV.fetch('PG_BIN')
RUSTY = ENV.fetch('RUSTY_BIN')
OUT = ENV.fetch('OUT_DIR')
HERE = File.expand_path(__dir__)

# "quiet" = no per-job lines: Ruby's logger at ERROR (set in ruby_jobs.rb), RUST_LOG=warn for
# both Rust workers. "info" = every worker's default, with its per-job start/done lines.
def ruby(log) = [{ 'BENCH_RUBY_LOG' => log == :quiet ? 'error' : 'info' },
                 'sidekiq', '-r', File.join(HERE, 'ruby_jobs.rb'), '-c', RUBY_CONC.to_s, '-q', 'bench', '-e', 'production']
def rusty(log) = [{ 'RUST_LOG' => log == :quiet ? 'warn' : 'info' }, RUSTY, URL, 'bench', RUSTY_CONC.to_s]
# No manifest: the shipped jobs/ needs PostgreSQL, and the no-op job is a Rust handler.
NO_JOBS = Dir.mktmpdir('playguard-no-jobs')
def pg(log, fetch, bin = BIN, jobs: NO_JOBS) = [{ 'RUST_LOG' => log == :quiet ? 'warn' : 'info' },
                                                bin, 'run', '-r', URL, '-j', jobs, '-q', 'bench', '-c', PG_CONC.to_s, '--fetch', fetch]
# The command job: /bin/true from a manifest (ruby_jobs.rb's TrueJob runs it with `system`).
TRUE_JOBS = Dir.mktmpdir('playguard-true-job')
File.write(File.join(TRUE_JOBS, 'true.toml'), <<~TOML)
  [[job]]
  class = "TrueJob"
  run = ["/bin/true"]
TOML

# What a kind's jobs do: [class, args, jobs per round, label in the work table].
WORK = {
  noop: ['NoopJob', [], N, 'no-op'],
  cpu: ['CpuJob', [CPU_US], WORK_N, "#{CPU_US} µs of CPU"],
  command: ['TrueJob', [], WORK_N, '/bin/true command'],
}.freeze

KINDS = {
  'ruby-quiet' => ["Ruby Sidekiq 6.4.1 -c #{RUBY_CONC}, logger ERROR", ruby(:quiet)],
  'ruby-info' => ["Ruby Sidekiq 6.4.1 -c #{RUBY_CONC}, logger INFO", ruby(:info)],
  'rusty-quiet' => ["rusty-sidekiq 0.15.2 -c #{RUSTY_CONC}, RUST_LOG=warn", rusty(:quiet)],
  'rusty-info' => ["rusty-sidekiq 0.15.2 -c #{RUSTY_CONC}, RUST_LOG=info", rusty(:info)],
  'reliable-quiet' => ["playguard reliable -c #{PG_CONC}, RUST_LOG=warn", pg(:quiet, 'reliable')],
  'reliable-info' => ["playguard reliable -c #{PG_CONC}, RUST_LOG=info", pg(:info, 'reliable')],
  'basic-quiet' => ["playguard basic -c #{PG_CONC}, RUST_LOG=warn", pg(:quiet, 'basic')],
  'basic-info' => ["playguard basic -c #{PG_CONC}, RUST_LOG=info", pg(:info, 'basic')],
  'ruby-cpu' => ["Ruby Sidekiq 6.4.1 -c #{RUBY_CONC}, logger ERROR", ruby(:quiet), :cpu],
  'reliable-cpu' => ["playguard reliable -c #{PG_CONC}, RUST_LOG=warn", pg(:quiet, 'reliable'), :cpu],
  'ruby-command' => ["Ruby Sidekiq 6.4.1 -c #{RUBY_CONC}, logger ERROR", ruby(:quiet), :command],
  'reliable-command' => ["playguard reliable -c #{PG_CONC}, RUST_LOG=warn", pg(:quiet, 'reliable', jobs: TRUE_JOBS), :command],
}.merge(
  # BASE_BIN: another build of bench_worker (an earlier commit, say), run the same way beside
  # this one, so a change is measured against what it changes in the same run.
  ENV['BASE_BIN'] ? {
    'base-quiet' => ["playguard reliable (BASE_BIN) -c #{PG_CONC}, RUST_LOG=warn", pg(:quiet, 'reliable', ENV['BASE_BIN'])],
    'base-info' => ["playguard reliable (BASE_BIN) -c #{PG_CONC}, RUST_LOG=info", pg(:info, 'reliable', ENV['BASE_BIN'])],
    'base-cpu' => ["playguard reliable (BASE_BIN) -c #{PG_CONC}, RUST_LOG=warn", pg(:quiet, 'reliable', ENV['BASE_BIN']), :cpu],
    'base-command' => ["playguard reliable (BASE_BIN) -c #{PG_CONC}, RUST_LOG=warn",
                       pg(:quiet, 'reliable', ENV['BASE_BIN'], jobs: TRUE_JOBS), :command],
  } : {}
).freeze

def spawn_worker(kind, tag)
  env, *cmd = KINDS.fetch(kind)[1]
  log = File.join(OUT, "#{kind}-#{tag}.log")
  Process.spawn({ 'REDIS_URL' => URL }.merge(env), *cmd, out: log, err: [:child, :out], chdir: OUT,
                pgroup: true)
end

def stop_worker(pid)
  t = now
  Process.kill('TERM', pid)
  deadline = now + 40
  loop do
    return now - t if Process.waitpid(pid, Process::WNOHANG)
    if now > deadline
      Process.kill('KILL', pid)
      Process.waitpid(pid)
      return Float::NAN
    end
    sleep 0.0002
  end
end

# Seconds of CPU the process's live threads have run (schedstat, in ns: finer than the 10 ms
# ticks of /proc/<pid>/stat; every worker here keeps its threads for the whole run).
def proc_cpu(pid)
  Dir["/proc/#{pid}/task/*/schedstat"].sum { |f| File.read(f).split.first.to_i rescue 0 } / 1e9
end

# [user, system] seconds from /proc/<pid>/stat (10 ms ticks): where the CPU above went.
def user_sys(pid)
  f = File.read("/proc/#{pid}/stat").split(') ').last.split
  [f[11].to_i, f[12].to_i].map { _1 / Etc.sysconf(Etc::SC_CLK_TCK).to_f }
rescue Errno::ENOENT
  [0.0, 0.0]
end

# CPU seconds of a process and everything under it: its live threads (schedstat), the children
# it reaped (cutime + cstime, 10 ms ticks: Ruby's `system` children, the guardian's commands)
# and, recursively, its live children (playguard's command guardian).
def tree_cpu(pid)
  f = File.read("/proc/#{pid}/stat").split(') ').last.split
  reaped = (f[13].to_i + f[14].to_i) / Etc.sysconf(Etc::SC_CLK_TCK).to_f
  kids = Dir["/proc/#{pid}/task/*/children"].flat_map { |c| File.read(c).split.map(&:to_i) rescue [] }
  proc_cpu(pid) + reaped + kids.sum { |k| tree_cpu(k) rescue 0 }
rescue Errno::ENOENT
  0.0
end

def work_of(kind) = KINDS.fetch(kind)[2] || :noop

def vmhwm_kb(pid) = File.read("/proc/#{pid}/status")[/^VmHWM:\s+(\d+)/, 1].to_i

# The driver's own commands (its polling script and what that script calls), left out of the
# per-job counts; none of the workers sends these while draining.
OWN = %w[eval llen keys info config config|resetstat flushdb].freeze

# Jobs still queued or in any playguard working list, in one round trip.
LEFT = "local n = redis.call('LLEN', KEYS[1]) " \
       "for _, k in ipairs(redis.call('KEYS', 'playguard:working:*')) do n = n + redis.call('LLEN', k) end " \
       'return n'

def push_jobs(klass, args, n)
  n.times.each_slice(10_000) do |s|
    Sidekiq::Client.push_bulk('class' => klass, 'queue' => 'bench', 'args' => s.map { args })
  end
end

# CPU time counted for a kind: the worker's own threads for no-op jobs (as in every earlier
# run); for jobs that work, the whole tree, since a command's CPU is spent in children.
def kind_cpu(kind, pid) = work_of(kind) == :noop ? proc_cpu(pid) : tree_cpu(pid)

def throughput(kind)
  klass, args, n, = WORK.fetch(work_of(kind))
  R.flushdb
  push_jobs(klass, args, n)
  raise 'push failed' unless R.llen('queue:bench') == n
  R.config(:resetstat)
  pid = spawn_worker(kind, 'throughput')
  wait_for("#{kind}: first pop", 60, 0.0005) { R.llen('queue:bench') < n }
  first = now
  cpu0 = kind_cpu(kind, pid)
  us0 = user_sys(pid)
  rcpu0 = redis_cpu
  wait_for("#{kind}: queue drained", 600, 0.001) { R.eval(LEFT, keys: ['queue:bench']).zero? }
  done = now
  cpu = kind_cpu(kind, pid) - cpu0
  user, sys = user_sys(pid).zip(us0).map { |a, b| (a - b) * 1e6 / n }
  rcpu = redis_cpu - rcpu0
  stats = commandstats.reject { |c, _| OWN.include?(c) }
  rss = vmhwm_kb(pid)
  # Correctness, untimed: the workers' own counters say n, none failed (rusty-sidekiq 0.15.2
  # keeps no counters).
  unless kind.start_with?('rusty')
    wait_for("#{kind}: Stats.processed == #{n}", 30, 0.05) { Sidekiq::Stats.new.processed >= n }
    failed = Sidekiq::Stats.new.failed
    raise "#{kind}: #{failed} of #{n} jobs failed (see #{OUT}/#{kind}-throughput.log)" unless failed.zero?
  end
  stop_worker(pid)
  calls = stats.values.sum
  { rate: n / (done - first), cpu_us: cpu * 1e6 / n, redis_us: rcpu * 1e6 / n,
    cmds: calls.to_f / n, rss_mb: rss / 1024.0, user_us: user, sys_us: sys,
    top: stats.sort_by { -_2 }.first(5).map { |c, k| [c, k.to_f / n] } }
end

def percentile(sorted, p) = sorted[[((sorted.size * p).ceil - 1), 0].max]

def idle(kind)
  R.flushdb
  pid = spawn_worker(kind, 'idle')
  wait_for("#{kind}: registered in processes", 30, 0.01) { R.scard('processes') > 0 }
  # Let start-up work (first sweep, first poll) pass, then count what idling costs.
  sleep 2
  R.config(:resetstat)
  sleep IDLE_SECS
  calls = commandstats.sum { |c, n| %w[config info].include?(c) ? 0 : n }
  R.del('bench:latency')
  lat = []
  LAT_SAMPLES.times do
    sleep 0.005 + rand * 0.01
    sent = (Time.now.to_r * 1_000_000).to_i
    Sidekiq::Client.push('class' => 'LatencyJob', 'queue' => 'bench', 'args' => [sent])
    _k, v = R.blpop('bench:latency', timeout: 10)
    raise "#{kind}: latency job not run within 10s" unless v
    lat << v.to_i
  end
  lat.sort!
  wait_for("#{kind}: idle again", 10, 0.0005) { R.eval(LEFT, keys: ['queue:bench']).zero? }
  sleep 0.5
  stop = stop_worker(pid)
  { idle_cmds: calls / IDLE_SECS, p50_ms: percentile(lat, 0.5) / 1000.0,
    p99_ms: percentile(lat, 0.99) / 1000.0, stop_ms: stop * 1000 }
end

kinds = (ENV['BENCH_KINDS'] || KINDS.keys.join(',')).split(',')
runs = Hash.new { |h, k| h[k] = [] }
ROUNDS.times do |round|
  kinds.rotate(round).each do |k|
    _, _, n, what = WORK.fetch(work_of(k))
    if work_of(k) == :noop
      warn "== round #{round + 1}/#{ROUNDS}, #{k}: throughput (#{n} no-op jobs), then idle"
      r = throughput(k).merge(idle(k))
      warn format('   %d jobs/s, %.1f µs worker CPU/job (user %.1f, system %.1f), %.1f µs Redis CPU/job, %.2f cmds/job, ' \
                  'p99 %.2f ms, stop %.0f ms',
                  r[:rate], r[:cpu_us], r[:user_us], r[:sys_us], r[:redis_us], r[:cmds], r[:p99_ms], r[:stop_ms])
    else
      warn "== round #{round + 1}/#{ROUNDS}, #{k}: throughput (#{n} jobs, each #{what})"
      r = throughput(k)
      warn format('   %d jobs/s, %.1f µs CPU/job (worker and its children), %.1f µs Redis CPU/job, %.2f cmds/job',
                  r[:rate], r[:cpu_us], r[:redis_us], r[:cmds])
    end
    runs[k] << r
  end
end

def median(xs)
  s = xs.sort
  s.size.odd? ? s[s.size / 2] : (s[s.size / 2 - 1] + s[s.size / 2]) / 2.0
end

# Jobs that work, quiet: the same job class on both sides (ruby_jobs.rb, bench_worker.rs).
def work_table(work_runs, med)
  lines = ["Jobs that work, quiet log level both sides: #{WORK_N} jobs per round, pushed with `push_bulk` " \
           "before the worker starts. `#{CPU_US} µs of CPU`: CpuJob spins until its thread has run " \
           "#{CPU_US} µs of CPU time (CLOCK_THREAD_CPUTIME_ID), the same loop in Rust and in Ruby's " \
           "perform. `/bin/true command`: playguard runs it from a manifest (`run = [\"/bin/true\"]`), " \
           "Ruby Sidekiq with `system(\"/bin/true\")` in perform. CPU per job counts the worker and its " \
           "children (the command guardian, the commands).", '']
  lines << '| work | worker | jobs/s | CPU µs/job, worker and children | Redis CPU µs/job | Redis cmds/job | peak RSS MB |'
  lines << '|---|---|---:|---:|---:|---:|---:|'
  work_runs.each do |k, rs|
    lines << "| #{WORK.fetch(work_of(k))[3]} | #{KINDS[k][0]} | #{cell(rs, :rate, '%d')} | #{cell(rs, :cpu_us, '%.1f')} | " \
             "#{cell(rs, :redis_us, '%.1f')} | #{format('%.2f', med[k][:cmds])} | #{format('%.1f', med[k][:rss_mb])} |"
  end
  ratios = %w[reliable base].filter_map do |a|
    cells = %i[cpu command].map do |w|
      med["#{a}-#{w}"] && med["ruby-#{w}"] ? format('%.1f×', med["#{a}-#{w}"][:rate] / med["ruby-#{w}"][:rate]) : 'n/a'
    end
    "| playguard #{a == 'base' ? 'reliable (BASE_BIN)' : a} ÷ Ruby Sidekiq | #{cells.join(' | ')} |" if cells.any? { _1 != 'n/a' }
  end
  unless ratios.empty?
    lines += ['', "| same run, same work | #{WORK[:cpu][3]} | #{WORK[:command][3]} |", '|---|---:|---:|'] + ratios
  end
  lines + ['']
end

# The no-op rows: every worker, quiet and at INFO, with idle costs; ratios in the same run.
def noop_table(noop_runs, med)
  lines = []
  lines << "Medians of #{ROUNDS} interleaved rounds (min–max in brackets); #{N} no-op jobs pushed with `push_bulk` before the worker starts; jobs/s from the first pop to the last ack."
  lines << ''
  lines << '| worker | jobs/s | worker CPU µs/job | of which user / system | Redis CPU µs/job | Redis cmds/job | peak RSS MB | idle pick-up p50 / p99 ms | idle Redis cmds/s | idle TERM → exit ms |'
  lines << '|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|'
  noop_runs.each do |k, rs|
    lines << "| #{KINDS[k][0]} | #{cell(rs, :rate, '%d')} | #{cell(rs, :cpu_us, '%.1f')} | " \
             "#{format('%.1f / %.1f', med[k][:user_us], med[k][:sys_us])} | #{cell(rs, :redis_us, '%.1f')} | " \
             "#{format('%.2f', med[k][:cmds])} | #{format('%.1f', med[k][:rss_mb])} | " \
             "#{format('%.2f / %.2f', med[k][:p50_ms], med[k][:p99_ms])} | #{format('%.1f', med[k][:idle_cmds])} | " \
             "#{cell(rs, :stop_ms, '%.0f')} |"
  end
  ratio = lambda do |a, b|
    next nil unless med[a] && med[b]
    format('%.1f×', med[a][:rate] / med[b][:rate])
  end
  ratios = [%w[reliable ruby], %w[reliable rusty], %w[basic ruby], %w[basic rusty], %w[reliable base]].filter_map do |a, b|
    q = ratio.("#{a}-quiet", "#{b}-quiet")
    i = ratio.("#{a}-info", "#{b}-info")
    them = { 'ruby' => 'Ruby Sidekiq', 'rusty' => 'rusty-sidekiq', 'base' => 'BASE_BIN' }.fetch(b)
    "| playguard #{a} ÷ #{them} | #{q || 'n/a'} | #{i || 'n/a'} |" if q || i
  end
  lines += ['', '| same run, same log level | quiet | INFO |', '|---|---:|---:|'] + ratios unless ratios.empty?
  lines << ''
  costs = %w[ruby rusty reliable basic base].filter_map do |w|
    next unless med["#{w}-quiet"] && med["#{w}-info"]
    format('%s %.0f%%', w, 100.0 * (1 - med["#{w}-info"][:rate] / med["#{w}-quiet"][:rate]))
  end
  lines += ["Throughput lost to INFO logging (1 − INFO ÷ quiet): #{costs.join(', ')}.", ''] unless costs.empty?
  lines
end

def cell(rs, key, fmt)
  xs = rs.map { _1[key] }
  return format(fmt, xs.first) if xs.size == 1
  "#{format(fmt, median(xs))} (#{format(fmt, xs.min)}–#{format(fmt, xs.max)})"
end

noop_runs, work_runs = runs.partition { |k, _| work_of(k) == :noop }.map(&:to_h)
med = runs.transform_values { |rs| rs.first.keys.reject { _1 == :top }.to_h { |k| [k, median(rs.map { _1[k] })] } }
lines = []
lines.concat(noop_table(noop_runs, med)) unless noop_runs.empty?
lines.concat(work_table(work_runs, med)) unless work_runs.empty?
lines << 'Redis commands per job by type (first round; script-internal calls included):'
runs.each do |k, rs|
  lines << "- #{k}: #{rs.first[:top].map { |c, n| format('%s %.2f', c, n) }.join(', ')}"
end
puts lines.join("\n")
File.write(File.join(OUT, 'table.md'), lines.join("\n") + "\n")

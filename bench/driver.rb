# Benchmark driver for bench/run.sh: Ruby Sidekiq 6.4.1 vs playguard (reliable and basic fetch)
# against the private redis-server run.sh started. Every wait has a deadline.
require 'sidekiq'
require 'sidekiq/api'
require 'json'
require 'redis'

URL = ENV.fetch('REDIS_URL')
N = Integer(ENV.fetch('BENCH_JOBS', '100000'))
PG_CONC = Integer(ENV.fetch('PG_CONCURRENCY', '50'))
LAT_SAMPLES = Integer(ENV.fetch('LAT_SAMPLES', '300'))
IDLE_SECS = Float(ENV.fetch('IDLE_SECS', '10'))
BIN = ENV.fetch('PG_BIN')
OUT = ENV.fetch('OUT_DIR')
HERE = File.expand_path(__dir__)
Sidekiq.configure_client { |c| c.redis = { url: URL } }
Sidekiq.logger.level = Logger::WARN
R = Redis.new(url: URL)

def now = Process.clock_gettime(Process::CLOCK_MONOTONIC)

def wait_for(what, secs)
  deadline = now + secs
  until yield
    raise "timed out after #{secs}s waiting for #{what}" if now > deadline
    sleep 0.0005
  end
end

WORKERS = {
  'ruby' => ->(log) { ['sidekiq', '-r', File.join(HERE, 'ruby_jobs.rb'), '-c', '10', '-q', 'bench', '-e', 'production'] },
  # More threads, so Ruby is not judged by a concurrency it would not run with.
  'ruby25' => ->(log) { ['sidekiq', '-r', File.join(HERE, 'ruby_jobs.rb'), '-c', '25', '-q', 'bench', '-e', 'production'] },
  'reliable' => ->(log) { [BIN, 'run', '-r', URL, '-q', 'bench', '-c', PG_CONC.to_s, '--fetch', 'reliable'] },
  'basic' => ->(log) { [BIN, 'run', '-r', URL, '-q', 'bench', '-c', PG_CONC.to_s, '--fetch', 'basic'] },
  # Same as 'reliable' with per-job start/done log lines off (RUST_LOG=warn).
  'reliable-quiet' => ->(log) { [BIN, 'run', '-r', URL, '-q', 'bench', '-c', PG_CONC.to_s, '--fetch', 'reliable'] },
}.freeze

def spawn_worker(kind, tag)
  log = File.join(OUT, "#{kind}-#{tag}.log")
  env = { 'REDIS_URL' => URL, 'RUST_LOG' => kind == 'reliable-quiet' ? 'warn' : ENV.fetch('PG_LOG', 'info') }
  Process.spawn(env, *WORKERS.fetch(kind).call(log), out: log, err: [:child, :out], chdir: OUT,
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

# Jobs still queued or in any playguard working list, in one round trip.
LEFT = "local n = redis.call('LLEN', KEYS[1]) " \
       "for _, k in ipairs(redis.call('KEYS', 'playguard:working:*')) do n = n + redis.call('LLEN', k) end " \
       'return n'

def push_noops(n)
  n.times.each_slice(10_000) do |s|
    Sidekiq::Client.push_bulk('class' => 'NoopJob', 'queue' => 'bench', 'args' => s.map { [] })
  end
end

def throughput(kind)
  R.flushdb
  push_noops(N)
  raise 'push failed' unless R.llen('queue:bench') == N
  t0 = now
  pid = spawn_worker(kind, 'throughput')
  first = nil
  wait_for("#{kind}: first pop", 60) { R.llen('queue:bench') < N }
  first = now
  wait_for("#{kind}: queue drained", 300) { R.eval(LEFT, keys: ['queue:bench']).zero? }
  done = now
  # Correctness, untimed: the workers' own counters (flushed by their heartbeat) say N.
  wait_for("#{kind}: Stats.processed == #{N}", 30) { Sidekiq::Stats.new.processed >= N }
  processed = Sidekiq::Stats.new.processed
  stop_worker(pid)
  { rate: N / (done - first), wall_rate: N / (done - t0), secs: done - first, processed: processed }
end

def percentile(sorted, p) = sorted[[((sorted.size * p).ceil - 1), 0].max]

def idle(kind)
  R.flushdb
  pid = spawn_worker(kind, 'idle')
  wait_for("#{kind}: registered in processes", 30) { R.scard('processes') > 0 }
  # Let start-up work (first sweep, first poll) pass, then count what idling costs.
  sleep 2
  R.config(:resetstat)
  sleep IDLE_SECS
  stats = R.info(:commandstats)
  calls = stats.sum do |cmd, v|
    next 0 if %w[config info].include?(cmd)
    v.is_a?(Hash) ? v['calls'].to_i : v[/calls=(\d+)/, 1].to_i
  end
  top = stats.map { |cmd, v| [cmd, v.is_a?(Hash) ? v['calls'].to_i : v[/calls=(\d+)/, 1].to_i] }
             .reject { |c, _| %w[config info].include?(c) }.sort_by { -_2 }.first(6)
  # Pick-up latency, one job at a time into an idle worker.
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
  wait_for("#{kind}: idle again", 10) { R.eval(LEFT, keys: ['queue:bench']).zero? }
  sleep 0.5
  shutdown = stop_worker(pid)
  { cmds_per_sec: calls / IDLE_SECS, top: top, p50_ms: percentile(lat, 0.5) / 1000.0,
    p99_ms: percentile(lat, 0.99) / 1000.0, max_ms: lat.last / 1000.0, shutdown_ms: shutdown * 1000 }
end

kinds = (ENV['BENCH_KINDS'] || 'ruby,ruby25,reliable,basic,reliable-quiet').split(',')
results = {}
kinds.each do |k|
  warn "== #{k}: throughput (#{N} no-op jobs)"
  results[k] = throughput(k)
  warn "   #{results[k][:rate].round} jobs/s"
  warn "== #{k}: idle (#{IDLE_SECS}s commandstats, #{LAT_SAMPLES} latency samples, shutdown)"
  results[k].merge!(idle(k))
  warn "   p50 #{results[k][:p50_ms]} ms, p99 #{results[k][:p99_ms]} ms, #{results[k][:cmds_per_sec]} cmd/s"
end

# Ratios are against the faster of the Ruby runs.
base = results.select { |k, _| k.start_with?('ruby') }.map { |_, r| r[:rate] }.max
names = { 'ruby' => 'Ruby Sidekiq 6.4.1, -c 10 (BRPOP)',
          'ruby25' => 'Ruby Sidekiq 6.4.1, -c 25 (BRPOP)',
          'reliable' => "playguard --fetch reliable, -c #{PG_CONC}",
          'basic' => "playguard --fetch basic, -c #{PG_CONC}",
          'reliable-quiet' => "playguard --fetch reliable, -c #{PG_CONC}, RUST_LOG=warn" }
lines = []
lines << "| worker | jobs/s (first pop → drained) | × best Ruby | jobs/s incl. start-up | idle pick-up p50 / p99 / max (ms) | idle Redis cmds/s | idle SIGTERM → exit (ms) |"
lines << '|---|---:|---:|---:|---:|---:|---:|'
results.each do |k, r|
  ratio = base ? format('%.1f×', r[:rate] / base) : 'n/a'
  lines << format('| %s | %d | %s | %d | %.2f / %.2f / %.2f | %.1f | %.0f |', names[k], r[:rate], ratio,
                  r[:wall_rate], r[:p50_ms], r[:p99_ms], r[:max_ms], r[:cmds_per_sec], r[:shutdown_ms])
end
if results['reliable'] && results['basic']
  rel = results['reliable'][:rate]
  bas = results['basic'][:rate]
  lines << ''
  lines << format('Reliable fetch vs basic fetch, same run: %.0f vs %.0f jobs/s (reliable = %.2f× basic; %s).',
                  rel, bas, rel / bas,
                  rel >= bas ? 'reliable moves up to one batch per script call, basic pays one BRPOP round trip per job' :
                               format('reliable costs %.1f%%', 100.0 * (1 - rel / bas)))
end
lines << ''
lines << 'Idle commands by type (per 10 s):'
results.each { |k, r| lines << "- #{k}: #{r[:top].map { |c, n| "#{c}=#{n}" }.join(', ')}" }
puts lines.join("\n")
File.write(File.join(OUT, 'table.md'), lines.join("\n") + "\n")

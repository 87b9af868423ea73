# Driver for bench/profile.sh: one worker under callgrind drains JOBS no-op jobs; prints
# instructions per job, Redis commands per job and the top functions by inclusive cost.
require_relative 'common'

N = Integer(ENV.fetch('JOBS', '20000'))
CONC = Integer(ENV.fetch('PG_CONCURRENCY', '50'))
FETCH = ENV.fetch('FETCH', 'reliable')
BIN = ENV.fetch('PG_BIN')
OUT = ENV.fetch('OUT_DIR')
TOP = Integer(ENV.fetch('TOP', '30'))
# Set when profile.sh runs redis-server under callgrind too.
REDIS_PID = ENV['REDIS_CALLGRIND'] && ENV.fetch('REDIS_PID')
# The driver's own commands, left out of the per-job counts.
OWN = %w[info config rename exists smembers scard].freeze

R.flushdb
N.times.each_slice(10_000) do |s|
  Sidekiq::Client.push_bulk('class' => 'NoopJob', 'queue' => 'bench', 'args' => s.map { [] })
end
R.rename('queue:bench', 'bench:staging')
log = File.join(OUT, 'worker.log')
# Callgrind runs the worker about 100 times slower, so its inline-job threshold (50 us of mean
# run time, src/manager/mod.rs) is scaled the same: a no-op job takes the path it takes natively.
env = { 'REDIS_URL' => URL, 'RUST_LOG' => ENV.fetch('PG_LOG', 'info'),
        'PLAYGUARD_INLINE_JOB_MICROS' => '5000' }
# RUSTY_BIN: profile bench/rusty (rusty-sidekiq) instead, for a like-for-like count.
cmd = if ENV['RUSTY_BIN']
        [ENV['RUSTY_BIN'], URL, 'bench', CONC.to_s]
      else
        [BIN, 'run', '-r', URL, '-j', Dir.mktmpdir('playguard-no-jobs'), '-q', 'bench', '-c', CONC.to_s, '--fetch', FETCH]
      end
pid = Process.spawn(env, 'valgrind', '--tool=callgrind', "--callgrind-out-file=#{OUT}/callgrind.out.%p",
                    *cmd, out: log, err: [:child, :out], pgroup: true)
begin
  wait_for('worker registered', 300, 0.05) { R.scard('processes') > 0 }
  identity = R.smembers('processes').first
  sleep 3 # first sweep, first poll and beat pass
  system('callgrind_control', '-z', pid.to_s, out: File::NULL) or raise 'callgrind_control -z failed'
  system('callgrind_control', '-z', REDIS_PID, out: File::NULL) or raise 'callgrind_control -z failed' if REDIS_PID
  R.config(:resetstat)
  cpu0 = redis_cpu
  t0 = now
  R.rename('bench:staging', 'queue:bench')
  wait_for('queue drained and acked', 1100, 0.05) do
    R.exists('queue:bench', "playguard:working:#{identity}:bench").zero?
  end
  secs = now - t0
  cpu = redis_cpu - cpu0
  stats = commandstats.reject { |c, _| OWN.include?(c) }
  usec = commandstats('usec').reject { |c, _| OWN.include?(c) }
  system('callgrind_control', '-d', pid.to_s, out: File::NULL) or raise 'callgrind_control -d failed'
  system('callgrind_control', '-d', REDIS_PID, out: File::NULL) or raise 'callgrind_control -d failed' if REDIS_PID
ensure
  Process.kill('TERM', pid)
  Process.wait(pid)
end
dump = Dir[File.join(OUT, "callgrind.out.#{pid}.*")].reject { |f| f.end_with?('.0') }.max_by { File.mtime(_1) }
dump ||= Dir[File.join(OUT, "callgrind.out.#{pid}*")].max_by { File.mtime(_1) }
def instructions(file) = File.foreach(file).grep(/^(summary|totals):/).first.to_s.split[1].to_i
ir = instructions(dump)
if REDIS_PID
  rdump = Dir[File.join(OUT, "redis.callgrind.#{REDIS_PID}.*")].max_by { File.mtime(_1) }
  redis_ir = instructions(rdump)
end
calls = stats.values.sum
puts format('%s, -c %d, RUST_LOG=%s, %d jobs (%.1f s under callgrind)',
            ENV['RUSTY_BIN'] ? 'rusty-sidekiq' : "playguard #{FETCH} fetch", CONC, env['RUST_LOG'], N, secs)
puts format('worker instructions per job: %d', ir / N)
puts format('Redis commands per job (script-internal calls included): %.2f', calls.to_f / N)
puts '  ' + stats.sort_by { -_2 }.first(10).map { |c, n| format('%s=%.3f', c, n / N) }.join(' ')
puts format('redis-server instructions per job: %d (%s)', redis_ir / N, rdump) if REDIS_PID
puts format('Redis CPU per job: %.2f µs (used_cpu_sys+used_cpu_user); in commands: %.2f µs (commandstats usec)',
            cpu * 1e6 / N, usec.values.sum / N)
puts '  ' + usec.sort_by { -_2 }.first(6).map { |c, u| format('%s=%.3f', c, u / N) }.join(' ')
puts "callgrind dump: #{dump}"
puts
puts "Top #{TOP} functions by inclusive instructions:"
ann = IO.popen(['callgrind_annotate', '--inclusive=yes', dump], &:read)
lines = ann.lines.drop_while { |l| !l.include?('file:function') }.drop(1).reject { _1.strip.empty? }
lines.first(TOP).each { |l| puts l.rstrip.sub(%r{ \[/[^\]]*\]}, '')[0, 200] }

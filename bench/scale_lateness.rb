# bench/scale.rb's lateness curve: how late scheduled jobs start, playguard beside Ruby Sidekiq
# 6.4.1 in the same run. Each worker gets a fresh database and LATE_JOBS LatencyJobs pushed
# with `at` spread evenly over LATE_AHEAD (16-46 s by default) after the push, their due time
# (epoch µs) as the argument; the job records now - due in `bench:latency` (bench_worker.rs and
# ruby_jobs.rb). The first job is due after Ruby's first poll (Sidekiq 6.4's poller waits
# 10-15 s after start), so every poller has run at least once before anything is due.
# Uses scale.rb's helpers (R, spawn_worker, stop, wait_for).

# Sidekiq 6.4.1 running bench/ruby_jobs.rb, quiet (logger ERROR), -c 10 as in bench/run.sh.
def spawn_ruby(tag, env = {})
  Process.spawn({ 'REDIS_URL' => URL, 'BENCH_RUBY_LOG' => 'error' }.merge(env),
                'sidekiq', '-r', File.join(__dir__, 'ruby_jobs.rb'), '-c', '10', '-q', 'bench', '-e', 'production',
                out: File.join(OUT, "#{tag}.log"), err: [:child, :out], chdir: OUT, pgroup: true)
end

def late_percentile(sorted, p) = sorted[[((sorted.size * p).ceil - 1), 0].max]

# One worker: push the jobs once it is registered, wait for every lateness, return them (ms).
def lateness_of(label, n, from, to)
  R.flushdb
  pid = yield
  wait_for("#{label}: registered", 60, 0.01) { R.scard('processes') > 0 }
  t0 = Time.now.to_f
  ats = (0...n).map { |i| t0 + from + (to - from) * (i + 0.5) / n }
  ats.each_slice(1000) do |s|
    Sidekiq::Client.push_bulk('class' => 'LatencyJob', 'queue' => 'bench', 'at' => s,
                              'args' => s.map { [(_1 * 1e6).round] })
  end
  raise "#{label}: #{R.zcard('schedule')} of #{n} jobs scheduled" unless R.zcard('schedule') == n
  wait_for("#{label}: #{n} scheduled jobs run", to + 60, 0.05) { R.llen('bench:latency') >= n }
  stop(pid)
  R.lrange('bench:latency', 0, -1).map { _1.to_i / 1000.0 }.sort
end

# Table lines for scale.md: p50, p99 and max per worker, and Ruby's p99 over playguard's.
def lateness_curve
  n = Integer(ENV.fetch('LATE_JOBS', '200'))
  from, to = ENV.fetch('LATE_AHEAD', '16,46').split(',').map { Float(_1) }
  warn "== scheduled-job lateness: #{n} jobs due #{from}-#{to} s after the push; playguard, then Ruby Sidekiq at 5 s and 1 s"
  workers = [
    ['playguard -c 10, default poll interval (5 s)', -> { spawn_worker(%w[-q bench -c 10], 'lateness-playguard') }],
    ['Ruby Sidekiq 6.4.1 -c 10, default average_scheduled_poll_interval (5 s)', -> { spawn_ruby('lateness-ruby-5') }],
    ['Ruby Sidekiq 6.4.1 -c 10, average_scheduled_poll_interval = 1',
     -> { spawn_ruby('lateness-ruby-1', 'BENCH_RUBY_POLL' => '1') }],
  ]
  res = workers.map do |label, start|
    ms = lateness_of(label, n, from, to) { start.call }
    r = { p50: late_percentile(ms, 0.5), p99: late_percentile(ms, 0.99), max: ms.last }
    warn format('   %s: p50 %.1f ms, p99 %.1f ms, max %.1f ms', label, r[:p50], r[:p99], r[:max])
    [label, r]
  end
  ours = res.first[1][:p99]
  ["Scheduled-job lateness (start − due time), #{n} jobs due #{from.to_i}–#{to.to_i} s after the push, " \
   'one worker process at a time on a fresh database:', '',
   '| worker | lateness p50 ms | p99 ms | max ms | p99 ÷ playguard\'s p99 |', '|---|---:|---:|---:|---:|'] +
    res.map do |label, r|
      "| #{label} | #{format('%.1f', r[:p50])} | #{format('%.1f', r[:p99])} | #{format('%.1f', r[:max])} | " \
        "#{format('%.1f×', r[:p99] / [ours, 0.001].max)} |"
    end + ['']
end

# Job classes for the Ruby Sidekiq 6.4.1 side of bench/run.sh and bench/scale.sh (loaded with
# `sidekiq -r`).
require 'sidekiq'

# bench/driver.rb's "quiet" runs: no per-job start/done lines, like RUST_LOG=warn for the Rust
# workers. Required after the CLI set its logger up, so the level sticks.
Sidekiq.logger.level = Logger::ERROR if ENV['BENCH_RUBY_LOG'] == 'error'

# bench/scale.rb's lateness curve: Sidekiq's average_scheduled_poll_interval (5 s by default).
# Set before the launcher starts its poller, which reads it at every wait.
if (secs = ENV['BENCH_RUBY_POLL'])
  Sidekiq.configure_server { |c| c.average_scheduled_poll_interval = Float(secs) }
end

class NoopJob
  include Sidekiq::Worker
  def perform(*) end
end

# args[0] = enqueue time (or, for a scheduled job, the time it was due) in epoch microseconds;
# records the pick-up delay (the lateness) in bench:latency.
class LatencyJob
  include Sidekiq::Worker
  def perform(sent_us)
    now_us = (Time.now.to_r * 1_000_000).to_i
    Sidekiq.redis { |c| c.rpush('bench:latency', now_us - sent_us) }
  end
end

# Burns args[0] microseconds (200 when absent) of this thread's CPU time, as the CpuJob of
# examples/bench_worker.rs does: a handler that computes and never waits.
class CpuJob
  include Sidekiq::Worker
  def perform(us = 200)
    stop = Process.clock_gettime(Process::CLOCK_THREAD_CPUTIME_ID) + us / 1e6
    nil while Process.clock_gettime(Process::CLOCK_THREAD_CPUTIME_ID) < stop
  end
end

# The command job of bench/run.sh: playguard runs /bin/true from a manifest, Ruby from perform.
class TrueJob
  include Sidekiq::Worker
  def perform(*)
    raise "/bin/true failed: #{$?.inspect}" unless system('/bin/true')
  end
end

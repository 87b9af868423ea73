# Job classes for the Ruby Sidekiq 6.4.1 side of bench/run.sh (loaded with `sidekiq -r`).
require 'sidekiq'

# bench/driver.rb's "quiet" runs: no per-job start/done lines, like RUST_LOG=warn for the Rust
# workers. Required after the CLI set its logger up, so the level sticks.
Sidekiq.logger.level = Logger::ERROR if ENV['BENCH_RUBY_LOG'] == 'error'

class NoopJob
  include Sidekiq::Worker
  def perform(*) end
end

# args[0] = enqueue time in epoch microseconds; records the pick-up delay in bench:latency.
class LatencyJob
  include Sidekiq::Worker
  def perform(sent_us)
    now_us = (Time.now.to_r * 1_000_000).to_i
    Sidekiq.redis { |c| c.rpush('bench:latency', now_us - sent_us) }
  end
end

# What the bench drivers (driver.rb, profile.rb, scale.rb) share: the connection to the private
# redis-server their shell script started, a refusal to touch any other server, deadlines on
# every wait, and the Redis-side readings (CPU time, commandstats).
require 'sidekiq'
require 'redis'
require 'json'
require 'tmpdir'

URL = ENV.fetch('REDIS_URL')
Sidekiq.configure_client { |c| c.redis = { url: URL } }
Sidekiq.logger.level = Logger::WARN
Redis.sadd_returns_boolean = false if Redis.respond_to?(:sadd_returns_boolean=)
R = Redis.new(url: URL, timeout: 30)

# The drivers flush and load this server: only the one their script started (REDIS_PID) will do.
own = ENV.fetch('REDIS_PID', '')
unless !own.empty? && R.info(:server)['process_id'].to_s == own
  abort "bench: #{URL.sub(/:[^:@\/]*@/, ':***@')} is not the redis-server this bench started " \
        '(REDIS_PID); run the bench through its shell script'
end

def now = Process.clock_gettime(Process::CLOCK_MONOTONIC)

def wait_for(what, secs, pause = 0.001)
  deadline = now + secs
  until yield
    raise "timed out after #{secs}s waiting for #{what}" if now > deadline
    sleep pause
  end
end

# Redis's own CPU seconds (user + system).
def redis_cpu
  i = R.info(:cpu)
  i['used_cpu_sys'].to_f + i['used_cpu_user'].to_f
end

# One commandstats field (calls, usec) per command.
def commandstats(field = 'calls')
  R.info(:commandstats).to_h { |cmd, v| [cmd, v.is_a?(Hash) ? v[field].to_f : v[/#{field}=([\d.]+)/, 1].to_f] }
end

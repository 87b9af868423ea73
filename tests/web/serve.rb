# Serves the real Sidekiq Web (ruby-sidekiq 6.4.1) for tests/web_ui.rs on 127.0.0.1:$PORT,
# reading the test's private Redis at $REDIS_URL. Rack 2.2's WEBrick handler (Debian
# ruby-webrick) keeps this to Debian packages only. With PLAYGUARD_TAB=1 the shipped
# ruby/playguard/web.rb is required as a Rails app would (its ledger: $DATABASE_URL).
require "securerandom"
require "sidekiq"
require "sidekiq/web"
require "rack"
require "rack/session/cookie"
require "rack/handler/webrick"
if ENV["PLAYGUARD_TAB"] == "1"
  $LOAD_PATH.unshift File.expand_path("../../ruby", __dir__)
  require "playguard/web"
end

Sidekiq.configure_client { |c| c.redis = {url: ENV.fetch("REDIS_URL")} }
Sidekiq.logger.level = Logger::WARN

app = Rack::Builder.new do
  # 6.4.1 needs a Rack session for its CSRF protection (csrf_protection.rb fails without one);
  # the cookie session needs a secret of at least 64 hex characters.
  use Rack::Session::Cookie, secret: SecureRandom.hex(32), same_site: true, max_age: 86400
  run Sidekiq::Web
end

Rack::Handler::WEBrick.run(
  app,
  Host: "127.0.0.1",
  Port: Integer(ENV.fetch("PORT")),
  AccessLog: [],
  Logger: WEBrick::Log.new($stderr, WEBrick::Log::WARN)
)

//! The real Ruby Sidekiq (and foreman): whether they are installed (skip, or fail under
//! PLAYGUARD_REQUIRE_RUBY=1), and running a Ruby snippet with Sidekiq pointed at a test's Redis.

use super::RedisServer;
use std::process::{Command, Stdio};

/// Whether the real Ruby Sidekiq is here. With PLAYGUARD_REQUIRE_RUBY=1 (as .ci/run sets) its
/// absence fails the test instead of skipping it.
pub fn ruby_available() -> bool {
    ruby_can("require 'sidekiq'; require 'sidekiq/api'", "ruby-sidekiq")
}

/// Whether Ruby can run `requires`; skips (or fails under PLAYGUARD_REQUIRE_RUBY=1) naming the
/// Debian `packages` that provide it.
pub fn ruby_can(requires: &str, packages: &str) -> bool {
    let ok = Command::new("ruby")
        .args(["-e", requires])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !ok && std::env::var("PLAYGUARD_REQUIRE_RUBY").as_deref() == Ok("1") {
        panic!("{packages} required (PLAYGUARD_REQUIRE_RUBY=1) but `ruby -e \"{requires}\"` fails");
    }
    if !ok {
        eprintln!("skipping: `ruby -e \"{requires}\"` fails (apt-get install {packages})");
    }
    ok
}

/// Run a Ruby snippet with Sidekiq loaded and pointed at `redis`; returns stdout, panics on failure.
pub fn ruby(redis: &RedisServer, script: &str) -> String {
    let prelude = "require 'sidekiq'\nrequire 'sidekiq/api'\nrequire 'json'\n\
        Sidekiq.configure_client { |c| c.redis = { url: ENV['REDIS_URL'] } }\n\
        Sidekiq.logger.level = Logger::WARN\n";
    let out = Command::new("ruby")
        .args(["-e", &format!("{prelude}{script}")])
        .env("REDIS_URL", redis.url())
        .output()
        .expect("run ruby");
    assert!(
        out.status.success(),
        "ruby failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Whether foreman is here; with PLAYGUARD_REQUIRE_RUBY=1 its absence fails the test.
pub fn foreman_available() -> bool {
    let ok = Command::new("foreman")
        .arg("version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok && std::env::var("PLAYGUARD_REQUIRE_RUBY").as_deref() == Ok("1") {
        panic!("foreman required (PLAYGUARD_REQUIRE_RUBY=1): apt-get install ruby-foreman");
    }
    if !ok {
        eprintln!("skipping: foreman is not installed (apt-get install ruby-foreman)");
    }
    ok
}

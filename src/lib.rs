//! playguard: a Sidekiq-compatible background worker.
//!
//! The Rails app enqueues with the real Sidekiq gem; playguard fetches from the same Redis
//! keys (`queue:<q>`, `schedule`, `retry`, `dead`, `processes`, `stat:*`), runs Rust handlers or
//! manifest command jobs, and retries them the way Sidekiq's `job_retry.rb` does.

pub mod cli;
pub mod config;
pub mod lock;
pub mod redis_conn;

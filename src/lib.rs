//! playguard: a Sidekiq-compatible background worker.
//!
//! The Rails app enqueues with the real Sidekiq gem; playguard fetches from the same Redis
//! keys (`queue:<q>`, `schedule`, `retry`, `dead`, `processes`, `stat:*`), runs Rust handlers or
//! manifest command jobs, and retries them the way Sidekiq's `job_retry.rb` does.

pub mod acker;
pub mod cli;
pub mod command;
pub mod command_job;
pub mod config;
pub mod db;
pub mod db_tls;
pub mod enqueue;
pub mod fence_store;
pub mod fetch;
pub mod handler;
pub mod heartbeat;
pub mod job_metrics;
pub mod launcher;
pub mod ledger;
pub mod liveness;
pub mod lock;
pub mod logging;
pub mod manifest;
pub mod metrics;
pub mod ops;
pub mod payload;
pub mod periodic;
pub mod processor;
pub mod reconcile;
pub mod redact;
pub mod redis_conn;
pub mod retry;
pub mod runtime;
pub mod scheduled;
pub mod sentinel;
pub mod shutdown;
pub mod sweeper;
pub mod work;

pub use handler::{JobContext, Outcome, Registry};
pub use retry::Failure;

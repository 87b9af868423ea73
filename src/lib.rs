//! playguard: a Sidekiq-compatible background worker.
//!
//! The Rails app enqueues with the real Sidekiq gem; playguard fetches from the same Redis
//! keys (`queue:<q>`, `schedule`, `retry`, `dead`, `processes`, `stat:*`), runs Rust handlers or
//! manifest command jobs, and retries them the way Sidekiq's `job_retry.rb` does.
//!
//! # Layout
//!
//! (ARCHITECTURE.md has the picture: tasks, the path of one job, who owns which key.)
//!
//! - Start and stop: `cli` (flags) → `config` → `launcher` (builds the `runtime`, starts the
//!   loops, runs the one-way shutdown of `shutdown`).
//! - One job: `fetch` (reliable or basic) → `payload` → `processor` → `handler` (the
//!   registry) → `command_job` / `reconcile` → outcome via `retry` and `acker`.
//! - Commands: `command` (process groups, output lines), `guardian` (the helper process that
//!   starts, reaps and kills them), `manifest` (jobs/*.toml).
//! - Locks and fences: `lock` (token lease), `fence_store` (where fences come from), `ledger`
//!   and `db` / `db_tls` (PostgreSQL).
//! - Liveness and recovery: `heartbeat` (Sidekiq's process keys), `liveness` (our lease),
//!   `sweeper` (orphaned jobs and dead holders' locks), `work` (the slot table).
//! - Side loops: `scheduled` (retry and schedule sets), `periodic` (the fan-out),
//!   `job_metrics` (Sidekiq 7/8 Metrics keys), `metrics` (Prometheus endpoint).
//! - Connections: `redis_conn` (shared and blocking connections), `sentinel`.
//! - Clients of the same keys: `enqueue`, `ops` (`playguard locks`, `playguard cycles`).
//! - `logging`, `redact` (no secret in any printed line).

pub mod acker;
pub mod cli;
pub mod command;
pub mod command_job;
pub mod config;
pub mod db;
pub mod db_tls;
pub mod enqueue;
pub mod error_class;
pub mod fence_store;
pub mod fetch;
pub mod guardian;
pub mod handler;
pub mod heartbeat;
pub mod identity;
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
pub mod queues;
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

//! playguard: a Sidekiq-compatible background worker.
//!
//! The Rails app enqueues with the real Sidekiq gem; playguard fetches from the same Redis
//! keys (`queue:<q>`, `schedule`, `retry`, `dead`, `processes`, `stat:*`), runs Rust handlers or
//! manifest command jobs, and retries them the way Sidekiq's `job_retry.rb` does.
//!
//! # Layout
//!
//! ARCHITECTURE.md has the picture (tasks, the path of one job, who owns which key). Read the
//! modules in this order; each depends only on those above it or beside it in its group.
//!
//! **Leaves** (no other module of ours): `payload` (a popped job, Sidekiq's JSON rules),
//! `queues` (queue order, `queue:<q>`), `error_class`, `identity`, `shutdown` (the one-way
//! quiet/stop state), `slots` (what each slot runs, unflushed counters), `logging` (line
//! formats) over `job_scope` (which job a line belongs to) and `job_lines` (a job's
//! start/done lines) over `log_writer` (one buffer, one writer thread), `redact`.
//!
//! **Connections and stores**: `redis_client` (one server's client, TLS) ← `sentinel` ←
//! `redis_conn` (the shared and the blocking connections, re-resolving behind sentinels);
//! `db_tls` ← `db` (PostgreSQL pool, schema) ← `ledger` (cycle records);
//! `lock` (token lease, fences in Redis) ← `fence_store` (fences from Redis or PostgreSQL).
//!
//! **One worker process** (`worker::Worker` is the shared data, no behaviour):
//! - start and stop: `cli` (flags, subcommands) → `config` → `launcher` (builds the worker,
//!   starts the loops, runs the shutdown) with `manifest` / `manifest_jobs` (jobs/*.toml into
//!   the registry);
//! - one job: `fetch` (the loop feeding free slots, `fetch/blockers`) → `processor` →
//!   `handler` (the registry) → `command_job` / `reconcile` (manifest cycles) over `cycle`
//!   (the phased-lock engine) and `child` (one command's run: env, stdin, output lines,
//!   stop) through `guardian` (the one process per worker that spawns and guards commands) →
//!   `retry` (Sidekiq's failure rules) → settled through `fetch_strategy` (reliable or
//!   basic: the unit of work's take, acknowledge, settle, requeue, drain), on a
//!   `unit_of_work::UnitOfWork`;
//! - side loops: `heartbeat` (Sidekiq's process keys), `liveness` (our lease), `sweeper`
//!   (dead processes' jobs and locks), `scheduled` (retry and schedule sets), `periodic` (the
//!   fan-out), `job_metrics` (Sidekiq 7/8 Metrics keys), `metrics` and `metrics_http`
//!   (Prometheus).
//!
//! **Clients of the same keys**: `enqueue` (`playguard enqueue`), `ops` (`playguard locks`,
//! `playguard cycles`).
//!
//! Public modules are the library API of README's "Library use"; the rest are private.

// The library API (README "Library use", examples/, benches/).
pub mod cli;
pub mod config;
pub mod db;
pub mod fence_store;
pub mod handler;
pub mod launcher;
pub mod lock;
pub mod reconcile;
pub mod redis_conn;
pub mod retry;
pub mod shutdown;

mod child;
mod command_job;
mod cycle;
mod db_tls;
mod enqueue;
mod error_class;
mod fetch;
mod fetch_strategy;
mod guardian;
mod heartbeat;
mod identity;
mod job_lines;
mod job_metrics;
mod job_scope;
mod ledger;
mod liveness;
mod log_writer;
mod logging;
mod manifest;
mod manifest_jobs;
mod metrics;
mod metrics_http;
mod ops;
mod payload;
mod periodic;
mod processor;
mod queues;
mod redact;
mod redis_client;
mod scheduled;
mod sentinel;
mod slots;
mod sweeper;
#[cfg(test)]
mod test_lines;
mod unit_of_work;
mod worker;

pub use handler::{JobContext, Outcome, Registry};
pub use retry::Failure;

/// A map looked up by class or queue name on every job: foldhash, seeded per process, instead
/// of SipHash (see Cargo.toml).
pub(crate) type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// Internals the integration tests drive directly. Not a stable API.
#[doc(hidden)]
pub mod test_support {
    pub use crate::job_metrics::{JobMetrics, Mode};
    pub use crate::payload::{new_jid, now_f64};
    pub use crate::periodic::{member_arg, tick_of};
}

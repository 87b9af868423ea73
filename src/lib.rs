//! playguard: a Sidekiq-compatible background worker.
//!
//! The Rails app enqueues with the real Sidekiq gem; playguard fetches from the same Redis
//! keys (`queue:<q>`, `schedule`, `retry`, `dead`, `processes`, `stat:*`), runs Rust handlers or
//! manifest command jobs, and retries them the way Sidekiq's `job_retry.rb` does.
//!
//! # Layout
//!
//! ARCHITECTURE.md has the picture (tasks, the path of one job, who owns which key). Each
//! folder is a layer; a folder imports only folders below it in this list (`tests/layers.rs`
//! checks it), from the top down:
//!
//! - `cli/`: flags and subcommands.
//! - `launcher/`: builds a worker, starts its loops, stops it (Sidekiq's Launcher).
//! - `ops/`: the operator commands `playguard locks` and `playguard cycles`.
//! - `loops/`: the side loops: heartbeat (with its queue and eviction checks), sweeper,
//!   scheduled poller, periodic fan-out, systemd's status and watchdog.
//! - `manager/`: the loop that feeds free slots (Sidekiq's Manager) and the processor that
//!   runs one job and settles it through the fetch strategy (Sidekiq's Processor).
//! - `worker/`: the state one worker shares between its loops, its configuration, and the
//!   one Redis opener and error-to-exit-code map of every subcommand (`error.rs`).
//! - `manifest/`: `jobs/*.toml`, parsed, checked and turned into registry entries.
//! - `cycle/`: the phased-lock engine, the lock and its fences, the ledger, key templates,
//!   the manifest's reconcile phases.
//! - `report/`: failure reports leave here: Sentry (rate-limited) and the manifest's hooks.
//! - `commands/`: one command's run, the guardian that spawns and guards commands, command
//!   jobs.
//! - `fetch/`: the fetch strategies (reliable, basic) and the unit of work (Sidekiq's
//!   fetch.rb).
//! - `job/`: the payload, its queue, the handler registry, retry and dead, the push.
//! - `metrics/`: Prometheus and its HTTP server (with the Redis-state gauges); the Sidekiq
//!   Metrics tab.
//! - `process/`: this process's identity, shutdown state, slot table, liveness lease, what it
//!   knows of Redis's state, and sd_notify.
//! - `traces/`: OpenTelemetry spans (a job's, a phase's) and their OTLP export, when an
//!   endpoint is set; the trace context in payloads and commands' environments.
//! - `connections/`: Redis (one server, following the primary by name or through Sentinel,
//!   the shared and blocking connections), PostgreSQL and its TLS, redaction of secrets.
//! - `logging/`: line formats, a job's log scope and lines, the one writer thread.
//!
//! The library API of README's "Library use" keeps its short paths (`playguard::lock`,
//! `playguard::reconcile`, ...): they are re-exported below from their folders.

pub mod cli;
mod commands;
mod connections;
mod cycle;
mod fetch;
mod job;
pub mod launcher;
mod logging;
mod loops;
mod manager;
mod manifest;
mod metrics;
mod ops;
mod process;
mod report;
mod traces;
mod worker;

// The library API (README "Library use", examples/, benches/), at its documented paths.
pub use connections::{db, redis_conn};
pub use cycle::{fences as fence_store, lock, reconcile};
pub use job::{handler, retry};
pub use process::shutdown;
pub use worker::config;

pub use job::handler::{JobContext, Outcome, Registry};
pub use job::retry::Failure;

/// A map looked up by class or queue name on every job: foldhash, seeded per process, instead
/// of SipHash (see Cargo.toml).
pub(crate) type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// Internals the integration tests drive directly. Not a stable API.
#[doc(hidden)]
pub mod test_support {
    pub use crate::job::payload::{new_jid, now_f64};
    pub use crate::loops::periodic::tick_of;
    pub use crate::loops::periodic_tick::member_arg;
    pub use crate::manifest::cron::CronSchedule;
    pub use crate::metrics::sidekiq_tab::{JobMetrics, Mode};
    pub use crate::worker::erb::render_with as erb_render_with;
}

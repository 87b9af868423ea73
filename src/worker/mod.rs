//! The state one worker process shares between its loops: connections, identity, registry,
//! slot table, shutdown state, the fetch strategy, the liveness lease. Data only: what a
//! fetched job goes through belongs to `fetch::FetchStrategy`. Touches no Redis keys itself.

pub mod config;
pub mod erb;
pub mod error;
pub mod fence_advice;

use crate::connections::redis_conn::Conn;
use crate::fetch::FetchStrategy;
use crate::job::handler::Registry;
use crate::process::shutdown::Shutdown;
use crate::process::slots::SlotTable;
use crate::worker::config::Config;
use std::sync::Arc;

pub struct Worker {
    pub conn: Conn,
    pub identity: String,
    pub config: Config,
    pub registry: Registry,
    pub slots: Arc<SlotTable>,
    pub shutdown: Shutdown,
    pub metrics: Arc<crate::metrics::prometheus::Metrics>,
    /// Sidekiq 7/8 Metrics-tab counters, flushed by the heartbeat.
    pub job_metrics: crate::metrics::sidekiq_tab::JobMetrics,
    pub fetch: Arc<FetchStrategy>,
    /// `DATABASE_URL`: fences for `fence = "database"` locks and the cycle ledger.
    pub db: Option<crate::connections::db::Db>,
    pub liveness: crate::process::liveness::Liveness,
    /// `playguard:locks:<identity>`: the locks our cycles hold, for the sweep to release if
    /// we die; None where no sweep recovers our jobs. Named once: every job's context has it.
    pub locks_record: Option<Arc<str>>,
    /// Where failure reports go: Sentry and the manifest's hooks (`report/`).
    pub reporter: Arc<crate::report::FailureReporter>,
    /// When the scheduled poller next wakes; lowered by this process's own retries.
    pub next_due: Arc<crate::job::next_due::NextDue>,
    /// The cancel flags (`it-<jid>`) of the running jobs that watch them (`job/cancel.rs`).
    pub cancels: crate::job::cancel::Cancels,
}

impl Worker {
    /// The `locks_record` a worker with this identity and liveness lease has.
    pub fn locks_record_for(
        identity: &str,
        liveness: &crate::process::liveness::Liveness,
    ) -> Option<Arc<str>> {
        liveness
            .is_kept()
            .then(|| crate::cycle::lock::locks_record_key(identity).into())
    }
}

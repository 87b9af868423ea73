//! What a failure report carries, and the one call every outcome path makes to hand it over
//! ([`Reporter`]): a failed run (retried, dead or dropped), a job that died, a payload
//! buried without a run, a poison pill, a cycle ended by a lost lock. `report/` implements it (Sentry, the manifest's hooks); this
//! layer only names it, so the cycle engine reaches it through `JobContext` without depending
//! on what is above. Touches no Redis keys.

use crate::job::retry::Failure;
use std::sync::Arc;

/// Which path a report comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A run failed (Sidekiq's error handlers run for it).
    Failure,
    /// A payload recovered from dead workers too often, buried by the sweeper.
    Poison,
    /// A phased cycle ended because its lock could no longer be proven ours.
    LockLost,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Failure => "failure",
            Kind::Poison => "poison",
            Kind::LockLost => "lock_lost",
        }
    }
}

/// One failure, as the outcome path saw it.
#[derive(Debug, Clone)]
pub struct Report {
    pub kind: Kind,
    /// Whether the job died with it (went to `dead`, or was dropped after its last retry
    /// under `dead: false`): death hooks run once for it, as Sidekiq's death handlers.
    pub died: bool,
    /// The queue the job was fetched from.
    pub queue: Arc<str>,
    /// The job as written back (retry or dead entry, with Sidekiq's failure fields), or as
    /// popped when nothing was written; a string that is not JSON is kept as it is.
    pub payload: String,
    /// A failed run's payload as it was fetched, before the failure's fields were written:
    /// what Sidekiq hands its error handlers (processor.rb passes the job it parsed before the
    /// run), so a Sentry event shows the retry count the run started with. None elsewhere.
    pub fetched: Option<Arc<str>>,
    pub error: Failure,
    /// The phase a cycle was in, for cycles.
    pub phase: Option<String>,
}

/// Where reports go. Never blocks, never fails: it hands the report to a background sender
/// and to hook tasks, and returns.
pub trait Reporter: Send + Sync {
    fn report(&self, report: Report);
}

/// A shared reporter, as the worker and every job context hold it.
pub type SharedReporter = Arc<dyn Reporter>;

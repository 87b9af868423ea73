//! Job classes: the registry mapping a Sidekiq class name to what runs it (a Rust handler
//! registered through the library API, a manifest command, or a phased job), and the context
//! and outcome every handler shares. Touches no Redis keys.

use crate::job::retry::Failure;
use crate::process::shutdown::Shutdown;
use crate::process::slots::SlotGuard;
use serde_json::Value;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Everything a running job may know about itself.
#[derive(Clone)]
pub struct JobContext {
    pub jid: Arc<str>,
    /// The class dispatched on (ActiveJob's job_class for wrapper payloads).
    pub class: Arc<str>,
    pub queue: Arc<str>,
    /// `args`, or ActiveJob's `arguments`.
    pub args: Vec<Value>,
    pub retry_count: Option<i64>,
    /// The exact popped payload.
    pub payload: Arc<str>,
    pub shutdown: Shutdown,
    pub redis: crate::connections::redis_conn::Conn,
    /// Counters for lock events and phase durations (served on --metrics-addr).
    pub metrics: Arc<crate::metrics::prometheus::Metrics>,
    /// The application's PostgreSQL when `DATABASE_URL` / `--database-url` is set.
    pub db: Option<crate::connections::db::Db>,
    /// The process's liveness lease as of this job's fetch: once it lapses the job may be
    /// recovered elsewhere, so it must stop (commands are killed) and go back to its queue.
    pub liveness: crate::process::liveness::JobLease,
    /// `playguard:locks:<identity>`, where the locks this job takes are recorded so the sweep
    /// can release them if this process dies; None when no sweep would (basic fetch).
    pub locks_record: Option<Arc<str>>,
    /// Where this job's failure reports go (the cycle engine reports a lost lock through it).
    pub(crate) reporter: crate::job::report::SharedReporter,
    /// The process's watch on Sidekiq's cancel flags (`job/cancel.rs`), for jobs that stop on
    /// a cancel.
    pub cancels: crate::job::cancel::Cancels,
    pub(crate) slot: Option<Arc<SlotGuard>>,
}

impl JobContext {
    /// Show the running phase on the Busy page (work hash entry) and in TTIN dumps.
    pub fn set_phase(&self, phase: Option<&str>) {
        if let Some(s) = &self.slot {
            s.set_phase(phase);
        }
    }
}

/// How a job ended.
#[derive(Debug)]
pub enum Outcome {
    /// Finished; acknowledged. Includes "skipped: locked" and "aborted: lock lost".
    Done,
    /// Failed: retried or killed per the payload, as Sidekiq does.
    Failed(Failure),
    /// Interrupted by shutdown: the original payload goes back to the head of its queue.
    Requeue,
}

/// What a class runs. Implemented by closures through [`Registry::register_fn`].
pub trait Handler: Send + Sync + 'static {
    fn perform(&self, ctx: JobContext) -> BoxFuture<'static, Outcome>;

    /// Whether `perform` watches the shutdown deadline itself (stopping its child processes
    /// and returning `Requeue`). Others are abandoned at the deadline, like Sidekiq's
    /// hard shutdown interrupting a thread.
    fn stops_itself(&self) -> bool {
        false
    }

    /// Whether this class cannot run without a database URL (`fence = "database"`); the
    /// worker then refuses to start without one.
    fn needs_database(&self) -> bool {
        false
    }

    /// The class's own failure policy (a manifest job's `retry_in`, `max_retries`).
    fn retry_policy(&self) -> Option<Arc<crate::job::retry_policy::Policy>> {
        None
    }
}

struct FnHandler<F>(F);

impl<F, Fut> Handler for FnHandler<F>
where
    F: Fn(JobContext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), Failure>> + Send + 'static,
{
    fn perform(&self, ctx: JobContext) -> BoxFuture<'static, Outcome> {
        let fut = (self.0)(ctx);
        Box::pin(async move { fut.await.map_or_else(Outcome::Failed, |()| Outcome::Done) })
    }
}

/// Class name -> handler.
#[derive(Default, Clone)]
pub struct Registry {
    map: crate::FastMap<String, Arc<dyn Handler>>,
}

impl Registry {
    pub fn new() -> Registry {
        Registry::default()
    }

    pub fn register(&mut self, class: impl Into<String>, h: impl Handler) -> &mut Self {
        self.map.insert(class.into(), Arc::new(h));
        self
    }

    pub fn register_arc(&mut self, class: impl Into<String>, h: Arc<dyn Handler>) -> &mut Self {
        self.map.insert(class.into(), h);
        self
    }

    /// Register an async closure: `Ok(())` = done, `Err(Failure)` = Sidekiq retry.
    pub fn register_fn<F, Fut>(&mut self, class: impl Into<String>, f: F) -> &mut Self
    where
        F: Fn(JobContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), Failure>> + Send + 'static,
    {
        self.register(class, FnHandler(f))
    }

    pub fn get(&self, class: &str) -> Option<Arc<dyn Handler>> {
        self.map.get(class).cloned()
    }

    pub fn contains(&self, class: &str) -> bool {
        self.map.contains_key(class)
    }

    /// Classes that cannot run without a database URL, sorted.
    pub fn needing_database(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .map
            .iter()
            .filter(|(_, h)| h.needs_database())
            .map(|(c, _)| c.clone())
            .collect();
        v.sort();
        v
    }

    pub fn classes(&self) -> Vec<String> {
        let mut v: Vec<String> = self.map.keys().cloned().collect();
        v.sort();
        v
    }
}

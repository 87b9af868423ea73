//! The phase API a cycle's users implement: what a phase is told ([`PhaseContext`]), how it
//! ends ([`PhaseEnd`]) or is stopped ([`StopCause`]), the [`Phase`] trait and [`FnPhase`] for
//! an async closure. The engine that runs phases under the lock is `engine.rs`. Touches no
//! Redis keys itself (a cancel arrives through `job/cancel.rs`).

use crate::job::handler::{BoxFuture, JobContext};
use crate::job::retry::Failure;
use tokio::time::Instant;

/// What a phase is told about its run: the job's context plus the lease facts.
#[derive(Clone)]
pub struct PhaseContext {
    pub job: JobContext,
    pub phase: String,
    pub lock_key: String,
    /// The fencing token: pass it to every downstream write (see lock.rs).
    pub fence: i64,
    /// The lease's local deadline: the phase must be done by then.
    pub lease_deadline: Instant,
    /// When this phase must stop: the lease deadline or, earlier, its own timeout.
    pub stop_at: Instant,
    /// The latest a phase's commands may live: past the lease's local deadline by half its
    /// safety margin, so still before the lock can expire in Redis. Their guardian kills them
    /// then even when this process is frozen (`commands/guardian/`).
    pub kill_by: Instant,
    /// With `on_cancel = "kill"`: resolves when the job is cancelled (`cycle/cancel.rs`).
    pub cancel: Option<crate::job::cancel::CancelSignal>,
}

impl std::ops::Deref for PhaseContext {
    type Target = JobContext;
    fn deref(&self) -> &JobContext {
        &self.job
    }
}

/// Why a phase was stopped from outside.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StopCause {
    LeaseDeadline,
    PhaseTimeout,
    Shutdown,
    /// The process's liveness lease lapsed: the job may be recovered elsewhere.
    Liveness,
    /// Sidekiq's cancel, with `on_cancel = "kill"`: the job ends, not retried.
    Cancelled,
}

/// How one phase ended.
#[derive(Debug)]
pub enum PhaseEnd {
    Ok,
    Failed(Failure),
    Stopped(StopCause),
}

impl PhaseEnd {
    /// What a phase's span records as its error (None: it went well).
    pub(crate) fn trace_error(&self) -> Option<String> {
        match self {
            PhaseEnd::Ok => None,
            PhaseEnd::Failed(f) => Some(f.message.clone()),
            PhaseEnd::Stopped(c) => Some(format!("stopped: {c:?}")),
        }
    }
}

/// One phase of a cycle. Command phases come from manifests (`reconcile::CommandPhase`); Rust
/// phases implement this.
pub trait Phase: Send + Sync + 'static {
    fn name(&self) -> &str;
    /// Run the phase. Stop by `ctx.stop_at` and at the shutdown deadline; a Rust phase that
    /// does not is abandoned (its future dropped) at those moments.
    fn run(&self, ctx: PhaseContext) -> BoxFuture<'static, PhaseEnd>;
}

/// When a phase must stop and why: the earliest of lease deadline, phase timeout, shutdown,
/// a lapsed liveness lease and (kill on cancel) a cancel.
pub(crate) async fn stop_signal(ctx: &PhaseContext) -> StopCause {
    let cause_at = if ctx.stop_at < ctx.lease_deadline {
        StopCause::PhaseTimeout
    } else {
        StopCause::LeaseDeadline
    };
    tokio::select! {
        _ = tokio::time::sleep_until(ctx.stop_at) => cause_at,
        _ = ctx.shutdown.hard_deadline() => StopCause::Shutdown,
        _ = ctx.job.liveness.lapse() => StopCause::Liveness,
        _ = cancelled(ctx.cancel.as_ref()) => StopCause::Cancelled,
    }
}

/// Resolves on the cancel; never without a signal.
async fn cancelled(signal: Option<&crate::job::cancel::CancelSignal>) {
    match signal {
        Some(s) => s.cancelled().await,
        None => std::future::pending().await,
    }
}

/// A Rust phase from an async closure: `Ok(())` = done, `Err(Failure)` = the job fails.
pub struct FnPhase<F> {
    name: String,
    f: F,
}

impl<F> FnPhase<F> {
    /// The phase `name` running `f` (`Cycle::phase_fn` builds one).
    pub(crate) fn new(name: String, f: F) -> FnPhase<F> {
        FnPhase { name, f }
    }
}

impl<F, Fut> Phase for FnPhase<F>
where
    F: Fn(PhaseContext) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<(), Failure>> + Send + 'static,
{
    fn name(&self) -> &str {
        &self.name
    }

    fn run(&self, ctx: PhaseContext) -> BoxFuture<'static, PhaseEnd> {
        let fut = (self.f)(ctx);
        Box::pin(async move { fut.await.map_or_else(PhaseEnd::Failed, |()| PhaseEnd::Ok) })
    }
}

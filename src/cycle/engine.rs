//! The phased-lock engine: a [`Cycle`] runs its phases one after another under a token lock.
//! Keys: the cycle's lock key, `<key>:fence` and the holder record `playguard:locks:<identity>`
//! (through `lock.rs`); with database fences, tables `playguard_fences` and `playguard_cycles`
//! (through `fences.rs`).
//!
//! The cycle: take the token lock first, and if someone else holds it, log and finish without
//! retry (the next tick reconciles). Then run phase after phase and renew the lease after
//! each one, never before: the TTL only has to cover one phase. A renewal that cannot prove
//! ownership (another token, no key, any Redis error) stops the cycle: no further phase starts.
//! After the last phase, without a database, the release's compare-and-delete gives that
//! proof itself (the same token comparison), so no separate renewal is sent.
//! A phase is never left running past the lease's local deadline: it is stopped (a command
//! phase's process group is killed, KILL, no grace) and the cycle ends as "lock lost". However
//! the cycle ends, the lease is released with compare-and-delete, so a newer owner's lock
//! survives; a cycle ended by a lost lock is also reported (Sentry, `lock_lost` hooks). At
//! shutdown the cycle stops at the next boundary (or its phase is stopped at the deadline),
//! releases, and the processor pushes the original payload back to the head of the queue.
//!
//! A cancel (Sidekiq's `cancel!`, `cancel.rs`) stops the cycle at its next boundary, or with
//! `on_cancel = "kill"` stops the running phase as a timeout does; the cycle ends `cancelled`,
//! a database fence is retired first (`fences.rs`), and the job is not retried. Its progress
//! is kept where Sidekiq 8.1's Busy page reads it (`progress.rs`).
//!
//! Where the fence comes from (Redis or PostgreSQL) and the cycle's ledger row are the fence
//! store's business (`fences.rs`): the cycle only asks it to hold, renew and finish.
//! What a phase runs is not: the phase API is `phase.rs`; manifest command phases are in
//! `reconcile.rs`, Rust phases are [`FnPhase`] or any [`Phase`].

use crate::commands::child;
use crate::cycle::cancel::{CycleCancel, OnCancel};
use crate::cycle::fences::{self, FenceSource, Held};
use crate::cycle::keys::{render_key, render_template};
use crate::cycle::ledger::End;
use crate::cycle::lock;
use crate::cycle::phase::stop_signal;
use crate::cycle::phase::{FnPhase, Phase, PhaseContext, PhaseEnd, StopCause};
use crate::cycle::release_guard::ReleaseGuard;
use crate::job::error_class;
use crate::job::handler::{BoxFuture, Handler, JobContext, Outcome};
use crate::job::report::{Kind, Report};
use crate::job::retry::Failure;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tracing::Instrument;

/// Lock settings of a phased job.
#[derive(Debug, Clone)]
pub struct LockConfig {
    /// Key template: `{args.N}`, `{class}`, `{queue}`.
    pub key: String,
    pub ttl: Duration,
    /// How logs name the guarded thing ("Marquee {args.0}"); default: the key.
    pub label: Option<String>,
    /// Where fences come from (`fence = "redis"`, the default, or `"database"`).
    pub fence: FenceSource,
}

/// A cycle: a lock and its phases, each with an optional timeout.
pub struct Cycle {
    pub lock: LockConfig,
    pub phases: Vec<(Arc<dyn Phase>, Option<Duration>)>,
    /// What Sidekiq's cancel does to a running phase (default: let it finish).
    pub on_cancel: OnCancel,
}

impl Cycle {
    /// A cycle under `key` (a template such as "playguard:marquee:{args.0}") with `ttl`.
    pub fn new(key: impl Into<String>, ttl: Duration) -> Cycle {
        Cycle {
            lock: LockConfig {
                key: key.into(),
                ttl,
                label: None,
                fence: FenceSource::Redis,
            },
            phases: Vec::new(),
            on_cancel: OnCancel::Boundary,
        }
    }

    /// Stop the running phase on a cancel (`OnCancel::Kill`) instead of at its end.
    pub fn on_cancel(mut self, on_cancel: OnCancel) -> Cycle {
        self.on_cancel = on_cancel;
        self
    }

    /// Take fences from PostgreSQL (`playguard_fences`) instead of Redis; the worker then
    /// needs a database URL.
    pub fn fence(mut self, source: FenceSource) -> Cycle {
        self.lock.fence = source;
        self
    }

    /// Name the guarded thing in logs, e.g. "Marquee {args.0}".
    pub fn label(mut self, label: impl Into<String>) -> Cycle {
        self.lock.label = Some(label.into());
        self
    }

    pub fn phase(mut self, phase: impl Phase, timeout: Option<Duration>) -> Cycle {
        self.phases.push((Arc::new(phase), timeout));
        self
    }

    /// Add a phase from an async closure.
    pub fn phase_fn<F, Fut>(self, name: impl Into<String>, f: F) -> Cycle
    where
        F: Fn(PhaseContext) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<(), Failure>> + Send + 'static,
    {
        self.phase(FnPhase::new(name.into(), f), None)
    }
}

impl Handler for Cycle {
    fn stops_itself(&self) -> bool {
        true
    }

    fn needs_database(&self) -> bool {
        self.lock.fence == FenceSource::Database
    }

    fn perform(&self, ctx: JobContext) -> BoxFuture<'static, Outcome> {
        let lock = self.lock.clone();
        let phases = self.phases.clone();
        let on_cancel = self.on_cancel;
        Box::pin(async move {
            // Cancelled before it started: no lock, no phase.
            let Some(mut cancel) = CycleCancel::start(&ctx, on_cancel).await else {
                return Outcome::Done;
            };
            let (outcome, cancelled) = run_cycle(lock, phases, &mut cancel, ctx).await;
            cancel.end(cancelled, &outcome).await;
            outcome
        })
    }
}

type Phases = Vec<(Arc<dyn Phase>, Option<Duration>)>;

/// The cycle's outcome, and whether a cancel ended it.
async fn run_cycle(
    lock: LockConfig,
    phases: Phases,
    cancel: &mut CycleCancel,
    ctx: JobContext,
) -> (Outcome, bool) {
    // Job data must not pick another key (`9:fence`, another class's lock): refused before
    // any Redis write, and dead at once, since no retry can change the arguments.
    let key = match render_key(&lock.key, &ctx.jid, &ctx.class, &ctx.queue, &ctx.args) {
        Ok(k) => k,
        Err(why) => {
            tracing::error!(error_class = crate::job::error_class::BAD_LOCK_KEY, lock_key = %lock.key,
                "refused: the job's arguments cannot form its lock key: {why}");
            let f = Failure::new(
                crate::job::error_class::BAD_LOCK_KEY,
                format!("lock key {:?}: {why}", lock.key),
            );
            return (Outcome::Failed(f), false);
        }
    };
    let label = lock
        .label
        .as_deref()
        .map(|l| render_template(l, &ctx.jid, &ctx.class, &ctx.queue, &ctx.args))
        .unwrap_or_else(|| key.clone());
    let held = match take_lock(&lock, &key, &label, &ctx).await {
        Ok(h) => h,
        Err(outcome) => return (outcome, false),
    };
    let mut run = Running {
        cancel,
        fence: held.fence(),
        guard: ReleaseGuard::new(held),
        ctx: &ctx,
        key: &key,
        label: &label,
        last: None,
    };
    let ending = run.phases(&lock, &phases).await;
    let cancelled = ending.end == End::Cancelled;
    (run.finish(ending).await, cancelled)
}

/// Take the token lock, then its fence and ledger row. Err: the job's outcome without a
/// cycle (already locked: done, no retry; Redis or PostgreSQL failed: retried).
async fn take_lock(
    lock: &LockConfig,
    key: &str,
    label: &str,
    ctx: &JobContext,
) -> Result<Held, Outcome> {
    let holder = ctx.locks_record.as_deref().map(|record| lock::Holder {
        record: record.to_string(),
        jid: ctx.jid.to_string(),
        class: ctx.class.to_string(),
        label: lock.label.as_ref().map(|_| label.to_string()),
    });
    let lease = match lock::acquire_as(&ctx.redis, key, lock.ttl, holder.as_ref()).await {
        Ok(Some(l)) => l,
        Ok(None) => {
            ctx.metrics.lock_event(&ctx.class, "skipped");
            tracing::info!(lock_key = %key, "{label} is already locked; skipping this run (no retry)");
            return Err(Outcome::Done);
        }
        Err(e) => {
            return Err(Outcome::Failed(Failure::new(
                error_class::LOCK_ERROR,
                format!("cannot take lock {key}: {e}"),
            )));
        }
    };
    // The fence (Redis or PostgreSQL) and the ledger row; fail closed: without them, no phase.
    let held = match fences::hold(lease, lock.fence, ctx.db.as_ref(), &ctx.jid).await {
        Ok(h) => h,
        Err((held, e)) => {
            let mut guard = ReleaseGuard::new(held);
            guard.release("the acquisition was not recorded").await;
            let db = ctx.db.as_ref().map(|d| d.shown_url()).unwrap_or("-");
            tracing::warn!(lock_key = %key, error = %e, database = %db,
                "{label}: could not record the acquisition in PostgreSQL; lock released, the job is retried");
            return Err(Outcome::Failed(Failure::new(
                error_class::LOCK_ERROR,
                format!("cannot record lock {key} in PostgreSQL: {e}"),
            )));
        }
    };
    ctx.metrics.lock_event(&ctx.class, "acquired");
    crate::traces::lock_event("lock acquired", key, held.fence());
    tracing::info!(lock_key = %key, fence = held.fence(), cycle_id = ?held.cycle_id(), ttl_secs = lock.ttl.as_secs_f64(), "{label}: lock acquired");
    Ok(held)
}

/// How a cycle ends, whichever way: what the ledger records (while the lock is still ours),
/// why the lock is released, and what becomes of the job. Every way out of a cycle goes
/// through `Running::finish` with one of these.
struct Ending {
    end: End,
    phase: Option<String>,
    error: Option<String>,
    why: &'static str,
    then: Then,
}

/// The job's outcome once the cycle ended.
enum Then {
    Is(Outcome),
    /// Done, unless the process's liveness lease lapsed by then: the job goes back (the sweep
    /// may already have it), so its Marquee is not left to the next tick.
    DoneUnlessLapsed,
}

impl Ending {
    /// Sidekiq's cancel: recorded as `cancelled`, released, done (not retried).
    fn cancelled(phase: Option<&str>) -> Ending {
        Ending::new(End::Cancelled, phase, None, "cancelled", Outcome::Done)
    }

    fn shutdown(phase: Option<&str>) -> Ending {
        Ending::new(End::Interrupted, phase, None, "shutdown", Outcome::Requeue)
    }

    /// The process's liveness lease lapsed: the job goes back, recorded as interrupted.
    fn lapsed(phase: Option<&str>) -> Ending {
        let error = Some("liveness lease lapsed".to_string());
        Ending::new(
            End::Interrupted,
            phase,
            error,
            "liveness lapsed",
            Outcome::Requeue,
        )
    }

    /// The lock can no longer be proven ours: recorded as `lock_lost`, then released.
    fn lost(phase: Option<&str>, error: String, then: Then) -> Ending {
        Ending {
            then,
            ..Ending::new(
                End::LockLost,
                phase,
                Some(error),
                "lock lost",
                Outcome::Done,
            )
        }
    }

    fn new(
        end: End,
        phase: Option<&str>,
        error: Option<String>,
        why: &'static str,
        outcome: Outcome,
    ) -> Ending {
        Ending {
            end,
            phase: phase.map(str::to_string),
            error,
            why,
            then: Then::Is(outcome),
        }
    }
}

/// A cycle that holds its lock: the phases run through it, and it ends through `finish`.
struct Running<'a> {
    ctx: &'a JobContext,
    /// The cancel flag and the progress record (`cancel.rs`).
    cancel: &'a mut CycleCancel,
    key: &'a str,
    label: &'a str,
    fence: i64,
    guard: ReleaseGuard,
    /// The phase the cycle is in, or last finished: the ledger's `phase`.
    last: Option<String>,
}

impl Running<'_> {
    /// Phase after phase, each checked at its boundary, judged at its end and proven by a
    /// renewal (or, after the last, by the release).
    async fn phases(&mut self, lock: &LockConfig, phases: &Phases) -> Ending {
        for (i, (phase, timeout)) in phases.iter().enumerate() {
            let name = phase.name().to_string();
            if self.cancel.at_boundary(&name).await {
                tracing::info!(next_phase = %name, "cancelled: stopping at the phase boundary");
                return Ending::cancelled(self.last.as_deref());
            }
            if let Some(ending) = self.at_boundary(&name) {
                return ending;
            }
            self.last = Some(name.clone());
            let (end, took) = self.run_one(phase, *timeout, (i, phases.len()), lock).await;
            if let Some(ending) = self.judge(&name, end, took) {
                return ending;
            }
            if let Some(ending) = self.prove(&name, i + 1 == phases.len()).await {
                return ending;
            }
        }
        Ending::new(
            End::Complete,
            self.last.as_deref(),
            None,
            "cycle complete",
            Outcome::Done,
        )
    }

    /// Whether the next phase may start: not at shutdown, not with a lapsed liveness lease,
    /// not without lease time left.
    fn at_boundary(&self, name: &str) -> Option<Ending> {
        let last = self.last.as_deref();
        if self.ctx.shutdown.is_stopping() {
            tracing::info!(next_phase = %name, "shutdown: stopping at the phase boundary");
            return Some(Ending::shutdown(last));
        }
        if self.ctx.liveness.lapsed() {
            tracing::warn!(next_phase = %name, "liveness lease lapsed: stopping at the phase boundary");
            return Some(Ending::lapsed(last));
        }
        if !self.guard.held().remaining().is_zero() {
            return None;
        }
        // A slow renewal ate the whole lease: starting a phase now would be unguarded.
        self.ctx.metrics.lock_event(&self.ctx.class, "lost");
        tracing::warn!(next_phase = %name, lock_key = %self.key,
            "aborted: lock lost (no lease time left to start the phase)");
        let error = "no lease time left to start the next phase".to_string();
        Some(Ending::lost(last, error, Then::Is(Outcome::Done)))
    }

    /// Run phase `step.0` of `step.1` until it ends or is stopped; how it ended and how long
    /// it took.
    async fn run_one(
        &self,
        phase: &Arc<dyn Phase>,
        timeout: Option<Duration>,
        step: (usize, usize),
        lock: &LockConfig,
    ) -> (PhaseEnd, Duration) {
        let ctx = self.ctx;
        let name = phase.name();
        let lease_deadline = self.guard.held().deadline();
        let started = Instant::now();
        let stop_at = match timeout {
            Some(t) => lease_deadline.min(started + t),
            None => lease_deadline,
        };
        ctx.set_phase(Some(name));
        tracing::info!(phase = %name, step = step.0 + 1, of = step.1, fence = self.fence, "phase start");
        let mut job = ctx.clone();
        job.slot = None;
        let pctx = PhaseContext {
            job,
            phase: name.to_string(),
            lock_key: self.key.to_string(),
            fence: self.fence,
            lease_deadline,
            stop_at,
            kill_by: lease_deadline + lock::safety_margin(lock.ttl) / 2,
            cancel: self.cancel.for_phase(),
        };
        // Phase output lines carry the jid (job scope), the guarded thing and the phase.
        let span = tracing::info_span!("phase", lock = %self.label, phase = %name);
        let end = run_phase(phase.clone(), pctx).instrument(span);
        let names = crate::traces::PhaseNames {
            phase: name,
            lock_key: self.key,
            fence: self.fence,
            step: (step.0 + 1, step.1),
        };
        let end = crate::traces::phase(names, end, PhaseEnd::trace_error).await;
        let took = started.elapsed();
        ctx.metrics
            .phase_finished(&ctx.class, name, took.as_secs_f64());
        tracing::info!(phase = %name, elapsed_ms = took.as_millis() as u64, result = ?end, "phase end");
        if took > lock.ttl / 2 {
            tracing::warn!(phase = %name, elapsed_ms = took.as_millis() as u64, ttl_ms = lock.ttl.as_millis() as u64,
                "phase took more than half the lock ttl; raise ttl_secs or split the phase");
        }
        (end, took)
    }

    /// What a phase's end means for the cycle: None goes on to the renewal.
    fn judge(&self, name: &str, end: PhaseEnd, took: Duration) -> Option<Ending> {
        let phase = Some(name);
        Some(match end {
            PhaseEnd::Ok => return None,
            PhaseEnd::Failed(mut f) => {
                f.phase = Some(name.to_string());
                let error = Some(f.message.clone());
                Ending::new(
                    End::Failed,
                    phase,
                    error,
                    "phase failed",
                    Outcome::Failed(f),
                )
            }
            PhaseEnd::Stopped(StopCause::PhaseTimeout) => {
                let message = format!("phase {name} timed out after {:.1}s", took.as_secs_f64());
                let mut f = Failure::new(error_class::TIMEOUT, message.clone());
                f.phase = Some(name.to_string());
                Ending::new(
                    End::Failed,
                    phase,
                    Some(message),
                    "phase timeout",
                    Outcome::Failed(f),
                )
            }
            PhaseEnd::Stopped(StopCause::Shutdown) => Ending::shutdown(phase),
            PhaseEnd::Stopped(StopCause::Cancelled) => {
                tracing::info!(phase = %name, "cancelled: the running phase was stopped");
                Ending::cancelled(phase)
            }
            PhaseEnd::Stopped(StopCause::Liveness) => {
                tracing::warn!(phase = %name, lock_key = %self.key,
                    "liveness lease lapsed: phase killed, job handed back");
                Ending::lapsed(phase)
            }
            PhaseEnd::Stopped(StopCause::LeaseDeadline) => {
                self.ctx.metrics.lock_event(&self.ctx.class, "lost");
                tracing::warn!(phase = %name, lock_key = %self.key,
                    "aborted: lock lost (the phase outlived its lease and was killed)");
                let error = "the phase outlived its lease and was killed".to_string();
                Ending::lost(phase, error, Then::Is(Outcome::Done))
            }
        })
    }

    /// Renew after the phase, not before: this proves we held the lock through it (and, with
    /// database fences, that playguard_fences still holds our fence). None: go on.
    ///
    /// After the last phase no lease is needed, only the proof that the phase ran under it.
    /// Without a database (no fence to check there, no ledger row to write while the lock is
    /// ours) that proof is the release itself: its compare-and-DEL makes the renewal's
    /// comparison of our token, so the cycle's last renewal is folded into it (one round trip
    /// fewer per cycle, the same verdict).
    async fn prove(&mut self, name: &str, last: bool) -> Option<Ending> {
        let held = self.guard.held_mut();
        let lost = if last && held.release_proves() {
            self.ctx.set_phase(None);
            let Err(lost) = self.guard.release_proving().await else {
                let last = self.last.as_deref();
                return Some(Ending::new(
                    End::Complete,
                    last,
                    None,
                    "cycle complete",
                    Outcome::Done,
                ));
            };
            lost.to_string()
        } else {
            let renewed = held.renew().await;
            let event = if renewed.is_ok() {
                "lock renewed"
            } else {
                "lock renewal failed"
            };
            crate::traces::lock_event(event, self.key, held.fence());
            renewed.err()?.to_string()
        };
        self.ctx.metrics.lock_event(&self.ctx.class, "lost");
        tracing::warn!(phase = %name, lock_key = %self.key, reason = %lost,
            "aborted: lock lost; no further phase starts");
        // After a failed release the lock is still held only when Redis could not be asked:
        // the key may still be ours, and is released as after a failed renewal.
        if !self.guard.is_held() {
            tracing::info!(lock_key = %self.key,
                "lock was no longer ours at release (lock lost); the newer owner's lock is untouched");
        }
        Some(Ending::lost(Some(name), lost, Then::DoneUnlessLapsed))
    }

    /// The one way out of a held cycle: record, release, clear the phase, then the outcome.
    async fn finish(mut self, e: Ending) -> Outcome {
        if e.end == End::Cancelled && self.guard.is_held() {
            // Before the ledger says `cancelled`: from then on no write with our fence lands.
            self.guard.held().retire_fence().await;
        }
        self.guard
            .end(e.end, e.phase.as_deref(), e.error.as_deref(), e.why)
            .await;
        self.ctx.set_phase(None);
        if matches!(e.end, End::LockLost) {
            self.report_lost(&e);
        }
        if e.end == End::Cancelled {
            tracing::info!(lock_key = %self.key, "{}: cycle cancelled (no retry)", self.label);
        }
        match e.then {
            Then::Is(outcome) => outcome,
            Then::DoneUnlessLapsed if self.ctx.liveness.lapsed() => Outcome::Requeue,
            Then::DoneUnlessLapsed => Outcome::Done,
        }
    }
}

impl Running<'_> {
    /// Tell the failure reporter (Sentry, `lock_lost` hooks) the cycle lost its lock.
    fn report_lost(&self, e: &Ending) {
        let message = e.error.as_deref().unwrap_or("lock lost");
        self.ctx.reporter.report(Report {
            kind: Kind::LockLost,
            died: false,
            queue: self.ctx.queue.clone(),
            payload: self.ctx.payload.to_string(),
            fetched: None,
            error: Failure::new(error_class::LOCK_LOST, format!("{}: {message}", self.key)),
            phase: e.phase.clone(),
        });
    }
}

/// Run one phase on its own task (a panic is contained), abandoning it if it ignores its stop.
async fn run_phase(phase: Arc<dyn Phase>, ctx: PhaseContext) -> PhaseEnd {
    let backstop_ctx = ctx.clone();
    // Its lines keep the job's context (the scope) and the phase's (the span).
    let run = crate::traces::carry(crate::logging::scope::carry(phase.run(ctx)));
    let mut task = tokio::spawn(run.in_current_span());
    tokio::select! {
        r = &mut task => match r {
            Ok(end) => end,
            Err(e) if e.is_panic() => PhaseEnd::Failed(Failure::new(error_class::PANIC, "phase panicked")),
            Err(_) => PhaseEnd::Stopped(StopCause::Shutdown),
        },
        cause = stop_signal(&backstop_ctx) => {
            // Command phases kill their group and return at once; a Rust phase that ignores its
            // stop is dropped. Never wait past the lease for either (margin is >= 50 ms).
            let lease_left = backstop_ctx.lease_deadline.saturating_duration_since(Instant::now());
            let grace = if matches!(cause, StopCause::LeaseDeadline | StopCause::Liveness) {
                Duration::from_millis(25)
            } else {
                (child::KILL_GRACE + Duration::from_millis(100)).min(lease_left)
            };
            match tokio::time::timeout(grace, &mut task).await {
                Ok(Ok(end)) => end,
                _ => {
                    // Let the abort's drop (which SIGKILLs the command's group) happen before
                    // the caller releases the lock.
                    task.abort();
                    let _ = tokio::time::timeout(Duration::from_millis(50), &mut task).await;
                    PhaseEnd::Stopped(cause)
                }
            }
        }
    }
}

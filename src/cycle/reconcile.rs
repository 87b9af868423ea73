//! The manifest's phased jobs (the per-Marquee reconcile cycle): a `jobs/*.toml` entry
//! with a `lock` and `[[job.phase]]` commands becomes a [`Cycle`] of [`CommandPhase`]s. Each
//! phase runs as a command under the job's `env` allow-list, told its lock key and fence
//! through the environment, and is stopped (TERM, or KILL at the lease deadline) when the
//! engine says so. Touches no keys itself: the lock key and `<key>:fence` are the engine's
//! (`engine.rs`, through `lock.rs`).
//!
//! The engine's types are re-exported here: `playguard::reconcile::Cycle` is the library's
//! path for Rust-phased cycles (README, "Library").

use crate::commands::child::{Exit, Stop};
use crate::commands::command_job::{exit_failure, job_env, run_for, LockEnv};
pub use crate::cycle::engine::{Cycle, LockConfig};
use crate::cycle::phase::stop_signal;
pub use crate::cycle::phase::{FnPhase, Phase, PhaseContext, PhaseEnd, StopCause};
use crate::job::handler::BoxFuture;
use tokio::time::Instant;

/// Cut a stop's TERM grace so the KILL still lands before the lease deadline.
fn within_lease(mut stop: Stop, ctx: &PhaseContext) -> Stop {
    let left = ctx.lease_deadline.saturating_duration_since(Instant::now());
    stop.grace = stop.grace.min(left);
    stop
}

/// A manifest phase: one command.
pub struct CommandPhase {
    pub name: String,
    pub argv: Vec<String>,
    /// The job's `env` allow-list (None = the worker's whole environment).
    pub inherit: Option<Vec<String>>,
}

impl Phase for CommandPhase {
    fn name(&self) -> &str {
        &self.name
    }

    fn run(&self, ctx: PhaseContext) -> BoxFuture<'static, PhaseEnd> {
        let argv = self.argv.clone();
        let inherit = self.inherit.clone();
        Box::pin(async move {
            let env = job_env(
                &ctx.job,
                Some(&ctx.phase),
                Some(LockEnv {
                    key: &ctx.lock_key,
                    fence: ctx.fence,
                }),
            );
            let cause = std::sync::Mutex::new(None);
            let stop = async {
                let c = stop_signal(&ctx).await;
                *cause.lock().unwrap() = Some(c);
                match c {
                    // The lease is the safety guarantee: no grace past it.
                    StopCause::LeaseDeadline => Stop::kill("lease deadline passed"),
                    StopCause::Liveness => Stop::kill("liveness lease lapsed"),
                    // TERM first, but KILL no later than the lease deadline.
                    StopCause::PhaseTimeout => within_lease(Stop::term("phase timeout"), &ctx),
                    StopCause::Shutdown => {
                        within_lease(Stop::term("shutdown deadline reached"), &ctx)
                    }
                    // As a timeout: TERM, then KILL, never past the lease.
                    StopCause::Cancelled => within_lease(Stop::term("cancelled"), &ctx),
                }
            };
            let kill_by = Some(ctx.kill_by);
            let exit = run_for(&ctx.job, &argv, inherit.as_deref(), env, kill_by, stop).await;
            // Killed by its guardian while we were frozen, or by us: not a phase failure.
            if !matches!(exit, Exit::Success) && ctx.job.liveness.lapsed() {
                return PhaseEnd::Stopped(StopCause::Liveness);
            }
            // Killed by its guardian at the lock's deadline while we were frozen.
            if !matches!(exit, Exit::Success) && Instant::now() >= ctx.kill_by {
                return PhaseEnd::Stopped(StopCause::LeaseDeadline);
            }
            if let Exit::Killed { .. } = exit {
                if let Some(c) = *cause.lock().unwrap() {
                    return PhaseEnd::Stopped(c);
                }
            }
            match exit_failure(exit) {
                None => PhaseEnd::Ok,
                Some(f) => PhaseEnd::Failed(f),
            }
        })
    }
}

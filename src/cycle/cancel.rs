//! How a cycle meets Sidekiq's cancel (`Sidekiq::Client#cancel!`, the `cancelled` field of
//! `it-<jid>`): checked before the lock is taken, at every phase boundary (read in the same
//! step that writes the cycle's progress, `progress.rs`), and, with `on_cancel = "kill"`, also
//! while a phase runs (`job/cancel.rs` watches the flag about once a second, and the phase's
//! process group is stopped as at a timeout). Keys: `it-<jid>` (through `progress.rs` and
//! `job/cancel.rs`).

use crate::cycle::progress::{self, Progress};
use crate::job::cancel::{CancelSignal, CancelWatch};
use crate::job::handler::{JobContext, Outcome};

/// What a cancel does to a running cycle (`on_cancel` in a `[[job]]` with phases).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnCancel {
    /// The running phase finishes; no further phase starts (as at shutdown).
    #[default]
    Boundary,
    /// The running phase is stopped at once: its process group gets TERM, then KILL.
    Kill,
}

impl OnCancel {
    pub fn parse(s: &str) -> Result<OnCancel, String> {
        match s {
            "boundary" => Ok(OnCancel::Boundary),
            "kill" => Ok(OnCancel::Kill),
            other => Err(format!(
                "on_cancel = {other:?} is not supported (\"boundary\" or \"kill\")"
            )),
        }
    }
}

/// One cycle run's cancel state and progress record.
pub struct CycleCancel {
    progress: Progress,
    /// Kill mode only: the watch that stops a running phase.
    watch: Option<CancelWatch>,
}

impl CycleCancel {
    /// Read the job's state; None when it was cancelled before it started (logged: it ends
    /// done, no lock taken, no phase run).
    pub async fn start(ctx: &JobContext, mode: OnCancel) -> Option<CycleCancel> {
        let (progress, cancelled) = Progress::start(&ctx.redis, &ctx.jid).await;
        if let Some(at) = cancelled {
            tracing::info!(cancelled_at = %at, "cycle cancelled before its first phase: not run (no retry)");
            progress.end(progress::End::Cancelled).await;
            return None;
        }
        let watch = (mode == OnCancel::Kill).then(|| ctx.cancels.watch(&ctx.jid));
        Some(CycleCancel { progress, watch })
    }

    /// Before phase `next` starts: write the progress (cursor = `next`) and say whether the
    /// job is cancelled by now.
    pub async fn at_boundary(&mut self, next: &str) -> bool {
        let flagged = self.progress.flush(next).await;
        flagged || self.watch.as_ref().is_some_and(CancelWatch::is_cancelled)
    }

    /// What stops a running phase on a cancel (kill mode), for its `PhaseContext`.
    pub fn for_phase(&self) -> Option<CancelSignal> {
        self.watch.as_ref().map(CancelWatch::signal)
    }

    /// The progress record's end, once the cycle's outcome is known.
    pub async fn end(self, cancelled: bool, outcome: &Outcome) {
        let how = match outcome {
            _ if cancelled => progress::End::Cancelled,
            Outcome::Done => progress::End::Done,
            Outcome::Failed(_) | Outcome::Requeue => progress::End::Kept,
        };
        self.progress.end(how).await;
    }
}

//! When this process's scheduled poller (`loops/scheduled.rs`) next has to look at `retry` and
//! `schedule`: the earliest time it plans to wake, lowered by this process's own writes to
//! those sets, which wake it early. The one such write a worker makes is a retry, settled by
//! `fetch/mod.rs`; its own pushes (the periodic dispatcher's) are never scheduled, and
//! `playguard enqueue --at` is another process, seen at the next poll as the Rails app's
//! pushes are. Touches no Redis keys itself.
//!
//! The time is an epoch f64 kept as its bits in one atomic: for times >= 0 the bits order as
//! the numbers do, so `fetch_min` keeps the earliest. A write further ahead than the plan
//! costs one atomic load and a compare, no lock.

use std::sync::atomic::{AtomicU64, Ordering};
use tokio::sync::Notify;

pub struct NextDue {
    /// Epoch seconds, as f64 bits: the poller's planned wake, or an earlier noted score.
    at: AtomicU64,
    /// Told when a note lowered `at`; a permit waits if the poller is not asleep yet.
    nearer: Notify,
}

impl Default for NextDue {
    fn default() -> NextDue {
        NextDue {
            at: AtomicU64::new(f64::INFINITY.to_bits()),
            nearer: Notify::new(),
        }
    }
}

/// A time as ordered bits: negative, -0.0 and NaN become 0.0 ("now").
fn bits(at: f64) -> u64 {
    if at > 0.0 {
        at.to_bits()
    } else {
        0
    }
}

impl NextDue {
    /// A member due at `at` (epoch seconds) was written to `retry` or `schedule` by this
    /// process. Call it once the write landed: a poll it wakes must find the member.
    pub fn note(&self, at: f64) {
        let b = bits(at);
        if b >= self.at.load(Ordering::Relaxed) {
            return;
        }
        if self.at.fetch_min(b, Ordering::AcqRel) > b {
            self.nearer.notify_one();
        }
    }

    /// A poll begins: what it reads from Redis includes every write noted before now, so
    /// those notes are spent; only later ones may lower the next plan.
    pub fn begin_poll(&self) {
        self.at.store(f64::INFINITY.to_bits(), Ordering::Release);
    }

    /// The poller plans to wake at `at`: returns the earliest of it and what was noted since
    /// the poll began.
    pub fn plan(&self, at: f64) -> f64 {
        let b = bits(at);
        f64::from_bits(self.at.fetch_min(b, Ordering::AcqRel).min(b))
    }

    /// The wake planned now (lowered by notes since `plan`).
    pub fn planned(&self) -> f64 {
        f64::from_bits(self.at.load(Ordering::Acquire))
    }

    /// Resolves once a note lowered the plan (or had, since the last call).
    pub async fn lowered(&self) {
        self.nearer.notified().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nearer_note_lowers_the_plan_and_wakes_a_farther_one_does_not() {
        let d = NextDue::default();
        d.begin_poll();
        assert_eq!(d.plan(100.0), 100.0);
        d.note(150.0);
        assert_eq!(d.planned(), 100.0);
        d.note(50.5);
        assert_eq!(d.planned(), 50.5);
        // The permit left by the nearer note resolves at once.
        let woke = futures::FutureExt::now_or_never(d.lowered());
        assert!(woke.is_some());
        let none = futures::FutureExt::now_or_never(d.lowered());
        assert!(none.is_none(), "the farther note left no permit");
    }

    #[test]
    fn notes_during_a_poll_count_for_the_next_plan() {
        let d = NextDue::default();
        d.begin_poll();
        d.note(20.0);
        assert_eq!(d.plan(30.0), 20.0);
        d.begin_poll();
        assert_eq!(d.plan(30.0), 30.0);
        d.note(-1.0);
        d.note(f64::NAN);
        assert_eq!(d.planned(), 0.0);
    }
}

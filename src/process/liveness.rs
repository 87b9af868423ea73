//! The liveness lease of one process. The orphan sweep of other processes judges us dead once
//! `playguard:alive:<identity>` (written by each heartbeat, TTL [`ALIVE_TTL_SECS`]) has lapsed,
//! and then runs our jobs again. So our own jobs must be stopped before that can happen: a
//! beat sent at `t` keeps us live until `t + ALIVE_TTL - LIVENESS_MARGIN` (the key itself lives
//! at least until `t + ALIVE_TTL`), and a process that cannot refresh in time stops its running
//! jobs (keeping them in its working list) and fetches nothing until a beat lands again.
//!
//! A frozen process (SIGSTOP, VM pause) cannot stop anything itself, so our command guardian
//! (`commands/guardian/`, a separate process) gets a countdown per command from us on its socket and
//! kills that command's group when it runs out: that budget is [`Liveness::guardian_budget`],
//! which never lets a command outlive the alive key (a phase's command also gets its lock's
//! deadline as a bound, `commands/child.rs`). Touches no Redis keys itself.

use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// Our own liveness key's TTL: the orphan sweep treats a process as dead once it lapses.
pub const ALIVE_TTL_SECS: i64 = 15;

pub fn alive_key(identity: &str) -> String {
    format!("playguard:alive:{identity}")
}

pub const FETCHERS_KEY: &str = "playguard:fetchers";

/// How much earlier than the alive key we stop our jobs. Covers the guardian's countdown
/// granularity (it fires 1 s to 2 s after our own deadline: the budget is rounded up, plus
/// one), the socket's latency and the kill itself, so a command is gone before the key can
/// expire.
pub const LIVENESS_MARGIN: Duration = Duration::from_secs(4);

#[derive(Debug, Clone, Copy, Default)]
struct State {
    /// Last successful refresh's send time + ALIVE_TTL - margin; None before the first beat.
    deadline: Option<Instant>,
    /// How many times the lease lapsed (a job compares it with the count at its start).
    lapses: u64,
    /// The lease has lapsed and no beat has landed since.
    lapsed: bool,
}

/// A cheap, cloneable handle on the process's liveness lease. A disabled one (basic fetch:
/// nobody recovers our jobs, so nobody can run them beside us) never lapses.
#[derive(Clone)]
pub struct Liveness {
    tx: Option<Arc<watch::Sender<State>>>,
}

impl Liveness {
    pub fn new() -> Liveness {
        let (tx, _rx) = watch::channel(State::default());
        Liveness {
            tx: Some(Arc::new(tx)),
        }
    }

    /// A lease that never lapses and sends no keepalive.
    pub fn disabled() -> Liveness {
        Liveness { tx: None }
    }

    /// Whether the lease is kept (not `disabled`): then the process keeps an alive key and a
    /// fetchers entry, records its locks, and sweeps for dead processes' jobs, as its own can
    /// be found again if it dies.
    pub fn is_kept(&self) -> bool {
        self.tx.is_some()
    }

    fn state(&self) -> State {
        self.tx.as_ref().map(|t| *t.borrow()).unwrap_or_default()
    }

    /// Record a lapse if the deadline has passed (whoever looks first notices it).
    fn observe(&self) {
        if let Some(tx) = &self.tx {
            tx.send_if_modified(|s| match s.deadline {
                Some(d) if !s.lapsed && Instant::now() >= d => {
                    s.lapsed = true;
                    s.lapses += 1;
                    true
                }
                _ => false,
            });
        }
    }

    /// A beat sent at `sent_at` refreshed the alive key. Returns true when it ends a lapse (the
    /// caller then treats its own past as dead: releases its recorded locks, hands back jobs).
    pub fn refreshed(&self, sent_at: Instant) -> bool {
        let Some(tx) = &self.tx else { return false };
        self.observe();
        let ttl = Duration::from_secs(ALIVE_TTL_SECS as u64).saturating_sub(LIVENESS_MARGIN);
        let mut ended = false;
        tx.send_modify(|s| {
            ended = s.lapsed;
            s.lapsed = false;
            s.deadline = Some(sent_at + ttl);
        });
        ended
    }

    /// Our alive key was found gone (it had been refreshed before): a lapse now, whatever
    /// the deadline says. Returns true when that starts a lapse (not on a first beat, nor
    /// when the lease had lapsed already).
    pub fn vanished(&self) -> bool {
        let Some(tx) = &self.tx else { return false };
        self.observe();
        tx.send_if_modified(|s| {
            if s.deadline.is_none() || s.lapsed {
                return false;
            }
            s.lapsed = true;
            s.lapses += 1;
            true
        })
    }

    /// The lapse count now (a lapse in progress counted).
    pub fn epoch(&self) -> u64 {
        self.observe();
        self.state().lapses
    }

    /// Whether the lease lapsed at any moment since `epoch` was taken, or is lapsed now.
    pub fn lapsed_since(&self, epoch: u64) -> bool {
        self.observe();
        let s = self.state();
        s.lapses != epoch || s.lapsed
    }

    /// Live now: a beat has landed and its lease has not run out.
    pub fn is_live(&self) -> bool {
        self.observe();
        !self.state().lapsed
    }

    /// Resolves once the lease lapses after `epoch` (never for a disabled lease). Cancel-safe.
    pub async fn lapse_after(&self, epoch: u64) {
        let Some(tx) = &self.tx else {
            return std::future::pending().await;
        };
        let mut rx = tx.subscribe();
        loop {
            if self.lapsed_since(epoch) {
                return;
            }
            let deadline = rx.borrow_and_update().deadline;
            tokio::select! {
                _ = sleep_until_opt(deadline) => {}
                r = rx.changed() => if r.is_err() { return std::future::pending().await },
            }
        }
    }

    /// Resolves once the lease is live (immediately for a disabled one). Cancel-safe.
    pub async fn live(&self) {
        let Some(tx) = &self.tx else { return };
        let mut rx = tx.subscribe();
        while !self.is_live() {
            let _ = rx.changed().await;
        }
    }

    /// Resolves at the next refresh or lapse. Cancel-safe.
    pub async fn changed(&self) {
        match &self.tx {
            Some(tx) => {
                let mut rx = tx.subscribe();
                let _ = rx.changed().await;
            }
            None => std::future::pending().await,
        }
    }

    /// Whole seconds the guardian may let a command run without hearing from us again: the
    /// countdown it kills at (timed from when it reads the count). `ceil(left) + 1` is more than
    /// `left`, so the guardian never fires before our own deadline (we have stopped the job
    /// first when we are running), and less than `left + 2` s, within LIVENESS_MARGIN. None: no
    /// lease to keep (disabled, or before the first beat).
    pub fn guardian_budget(&self) -> Option<u64> {
        self.tx.as_ref()?;
        let s = self.state();
        let d = s.deadline?;
        let left = d.saturating_duration_since(Instant::now());
        Some(left.as_secs_f64().ceil() as u64 + 1)
    }
}

impl Default for Liveness {
    fn default() -> Self {
        Self::new()
    }
}

async fn sleep_until_opt(d: Option<Instant>) {
    match d {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// A job's view of the lease: the lapse count when the job was fetched.
#[derive(Clone)]
pub struct JobLease {
    pub liveness: Liveness,
    pub epoch: u64,
}

impl JobLease {
    /// Whether the process's lease lapsed since this job was fetched: it may then have been
    /// recovered and be running elsewhere, so it must stop and go back (guarded by LREM).
    pub fn lapsed(&self) -> bool {
        self.liveness.lapsed_since(self.epoch)
    }

    /// Resolves when the lease lapses (never for a disabled lease).
    pub async fn lapse(&self) {
        self.liveness.lapse_after(self.epoch).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn lapses_at_the_deadline_and_a_beat_ends_it() {
        let l = Liveness::new();
        assert!(l.is_live(), "no lease yet is not a lapse");
        assert_eq!(l.guardian_budget(), None);
        let ttl = Duration::from_secs(ALIVE_TTL_SECS as u64) - LIVENESS_MARGIN;
        // A beat sent long enough ago that its lease has 300 ms left.
        let sent = Instant::now() - ttl + Duration::from_millis(300);
        assert!(!l.refreshed(sent));
        let e = l.epoch();
        assert_eq!(l.guardian_budget(), Some(2), "ceil(0.3 s) + 1");
        assert!(!l.lapsed_since(e));
        tokio::time::timeout(Duration::from_secs(5), l.lapse_after(e))
            .await
            .expect("lapses at send + ttl - margin");
        assert!(Instant::now() >= sent + ttl);
        assert!(!l.is_live() && l.lapsed_since(e));
        assert!(l.refreshed(Instant::now()), "this beat ends a lapse");
        assert!(l.is_live());
        assert!(l.lapsed_since(e), "a job from before the lapse still knows");
        assert!(!l.lapsed_since(l.epoch()));
        assert_eq!(l.guardian_budget(), Some(ttl.as_secs() + 1));
    }

    #[tokio::test]
    async fn a_vanished_key_is_a_lapse_now_but_not_on_the_first_beat() {
        let l = Liveness::new();
        assert!(!l.vanished(), "no beat yet: a first beat finds no key");
        l.refreshed(Instant::now());
        let e = l.epoch();
        assert!(l.vanished(), "gone after a beat landed: lapsed now");
        assert!(!l.is_live() && l.lapsed_since(e));
        assert!(!l.vanished(), "counted once");
        tokio::time::timeout(Duration::from_millis(100), l.lapse_after(e))
            .await
            .expect("a job's watch sees it at once");
        assert!(l.refreshed(Instant::now()), "the next landed beat ends it");
        assert!(l.lapsed_since(e));
    }

    #[tokio::test]
    async fn disabled_never_lapses() {
        let l = Liveness::disabled();
        assert!(!l.refreshed(Instant::now()));
        assert!(l.is_live() && !l.lapsed_since(0));
        assert_eq!(l.guardian_budget(), None);
        assert!(
            tokio::time::timeout(Duration::from_millis(20), l.lapse_after(0))
                .await
                .is_err()
        );
    }
}

//! The fetch strategy: which mode takes the jobs, and what it holds beside them (the deferred
//! requeues, the failover window, the liveness lease). Keys: those of `reliable.rs` /
//! `basic.rs`; settling and requeueing are `settle.rs`, the idle wait `blocking.rs`.

use super::basic::BasicFetch;
use super::reliable::ReliableFetch;
use super::unit_of_work::UnitOfWork;
use super::{recent, Batch, FetchMode};
use crate::connections::redis_conn::Conn;
use crate::job::next_due::NextDue;
use crate::process::liveness::Liveness;
use crate::process::redis_state::RedisState;
use crate::process::shutdown::Shutdown;
use std::sync::{Arc, Mutex};

pub(super) enum Mode {
    Reliable(ReliableFetch),
    Basic(BasicFetch),
}

pub struct FetchStrategy {
    pub(super) mode: Mode,
    pub(super) conn: Conn,
    pub(super) shutdown: Shutdown,
    /// Queues whose key holds another type are left out of every fetch and wait.
    pub(super) state: Arc<RedisState>,
    /// Jobs stopped and meant to go back to their queues while Redis could not be reached:
    /// retried after every heartbeat that lands, so none stays in our working list for good.
    pub(super) deferred_requeues: Mutex<Vec<(UnitOfWork, Option<Vec<u8>>)>>,
    /// The jobs finished in the last seconds, re-applied on a new primary after a failover.
    pub(super) recent: recent::Recent,
    /// Told of each retry written, so the scheduled poller wakes at its score.
    pub(super) next_due: Arc<NextDue>,
    /// The process's liveness lease: kept where our jobs can be found again if we die.
    pub(super) liveness: Liveness,
}

impl FetchStrategy {
    pub fn new(
        kind: FetchMode,
        identity: &str,
        (conn, state): (Conn, Arc<RedisState>),
        shutdown: Shutdown,
        next_due: Arc<NextDue>,
    ) -> FetchStrategy {
        let mode = match kind {
            FetchMode::Reliable => {
                Mode::Reliable(ReliableFetch::start(identity, conn.clone(), state.clone()))
            }
            FetchMode::Basic => Mode::Basic(BasicFetch::new(conn.clone())),
        };
        let liveness = match mode {
            Mode::Reliable(_) => Liveness::new(),
            Mode::Basic(_) => Liveness::disabled(),
        };
        FetchStrategy {
            liveness,
            mode,
            conn,
            shutdown,
            state,
            deferred_requeues: Mutex::default(),
            recent: recent::Recent::default(),
            next_due,
        }
    }

    /// "reliable" or "basic", for the start line.
    pub fn name(&self) -> &'static str {
        match self.mode {
            Mode::Reliable(_) => "reliable",
            Mode::Basic(_) => "basic",
        }
    }

    /// The liveness lease this strategy needs: kept where a job of a process that dies can be
    /// found again (its working lists), so the process keeps an alive key and a fetchers
    /// entry, records its locks, and sweeps for dead processes' jobs; disabled otherwise. The
    /// one thing the layers above learn of the mode ([`Liveness::is_kept`]).
    pub fn liveness(&self) -> Liveness {
        self.liveness.clone()
    }

    pub(super) fn recovers_orphans(&self) -> bool {
        self.liveness.is_kept()
    }

    /// Take up to `n` jobs in `order` for the free slots, in one round trip per batch.
    pub async fn take(&self, order: &[&str], n: usize, epoch: u64) -> Batch {
        let order = self.usable(order);
        match &self.mode {
            Mode::Reliable(r) => r.take(&order, n, epoch).await,
            Mode::Basic(b) => b.take(&order, n, epoch).await,
        }
    }

    /// `order` without the queues whose key (or working list) holds another type than a
    /// list: one bad key must not stop the others (see `process/redis_state.rs`).
    pub(super) fn usable<'a>(&self, order: &[&'a str]) -> Vec<&'a str> {
        let mut order = order.to_vec();
        order.retain(|q| !self.state.is_broken(q));
        order
    }

    /// Whether a failed fetch may have moved jobs into our working lists without telling us
    /// (the script ran, its reply was lost), so a rescue `drain` is due once we are idle.
    pub(super) fn lost_reply_may_hide_jobs(&self) -> bool {
        matches!(self.mode, Mode::Reliable(_))
    }

    /// Right after a fetch whose reply was lost, before any other fetch (nothing has been added
    /// to our working lists since): push back to their queues the jobs it moved there. Safe
    /// under load: the jobs we hold stay. Complete when no ack was pending
    /// ([`FetchStrategy::acks_pending`] is 0); otherwise some may stay, for the idle rescue
    /// (`drain`). Returns how many moved.
    pub(super) async fn rescue_lost(&self, queues: &[String]) -> redis::RedisResult<i64> {
        match &self.mode {
            Mode::Reliable(r) => r.rescue_lost(queues).await,
            Mode::Basic(_) => Ok(0),
        }
    }

    /// A job finished: acknowledge it (batched, off the job's path).
    pub fn acknowledge(&self, job: UnitOfWork) {
        self.recent.finished(&job, None);
        if let Mode::Reliable(r) = &self.mode {
            r.acknowledge(job);
        }
    }

    /// Acknowledgements queued or in flight, not yet confirmed by Redis.
    pub(super) fn acks_pending(&self) -> usize {
        match &self.mode {
            Mode::Reliable(r) => r.acks_pending(),
            Mode::Basic(_) => 0,
        }
    }

    /// Stop taking acknowledgements and wait until every queued one was sent.
    pub async fn finish_acks(&self) {
        if let Mode::Reliable(r) = &self.mode {
            r.finish_acks().await;
        }
    }

    /// After a failover, before `conn` (the new primary) is used: re-apply what we finished in
    /// the last seconds and list the `running` jobs (queue, payload) in our working lists
    /// there (`recent.rs`), so neither runs again from a copy the old primary never passed on.
    pub async fn reconcile<C: redis::aio::ConnectionLike + Send>(
        &self,
        conn: &mut C,
        running: &[(std::sync::Arc<str>, std::sync::Arc<str>)],
    ) -> redis::RedisResult<recent::Reconciled> {
        let working = |q: &str| match &self.mode {
            Mode::Reliable(r) => Some(r.working_key(q)),
            Mode::Basic(_) => None,
        };
        self.recent.reconcile(conn, running, working).await
    }

    /// Everything fetched but not finished goes back to its queue (Sidekiq's bulk_requeue):
    /// our working lists are drained. Basic fetch holds nothing outside memory. Returns how
    /// many jobs moved.
    pub async fn drain(&self, queues: &[String]) -> redis::RedisResult<i64> {
        match &self.mode {
            Mode::Reliable(r) => r.drain(queues).await,
            Mode::Basic(_) => Ok(0),
        }
    }
}

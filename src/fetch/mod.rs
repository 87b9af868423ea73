//! The one owner of a fetched job's unit of work, as Sidekiq's fetch.rb is: how jobs are taken
//! (a batch, or an idle blocking pop), acknowledged, settled with their outcome, requeued, and
//! drained at a clean stop. The processor and the fetch loop call these and never ask which
//! mode is on. Keys: those of `reliable.rs` / `basic.rs`.
//!
//! To add a strategy: a module beside `reliable.rs`, a variant of `Mode`, and one arm in each
//! method below and in the blocking-pop methods of `blocking.rs`.

mod acks;
mod basic;
pub mod blocking;
pub mod recent;
mod reliable;
pub mod rescue;
pub mod unit_of_work;
mod working_order;

pub use working_order::working_key;

use crate::connections::redis_conn::Conn;
use crate::fetch::unit_of_work::UnitOfWork;
use crate::job::next_due::NextDue;
use crate::job::retry::Record;
use crate::process::liveness::Liveness;
use crate::process::redis_state::RedisState;
use crate::process::shutdown::Shutdown;
use basic::BasicFetch;
use reliable::ReliableFetch;
use std::sync::{Arc, Mutex};

/// Jobs taken in one round trip, in fetch order.
pub type Batch = redis::RedisResult<Vec<UnitOfWork>>;

/// Pause between attempts to write an outcome (as the acks are retried).
const SETTLE_RETRY_PAUSE: std::time::Duration = std::time::Duration::from_millis(500);

enum Mode {
    Reliable(ReliableFetch),
    Basic(BasicFetch),
}

/// `--fetch`: how jobs are taken from their queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum FetchMode {
    /// Each job sits in our working list until it finished: nothing is lost on SIGKILL.
    #[default]
    Reliable,
    /// Sidekiq OSS's BRPOP: a job popped by a process that dies is lost.
    Basic,
}

impl FetchMode {
    /// Whether its jobs wait in working lists in Redis until they finished, keys an evicting
    /// Redis may drop (`loops/eviction.rs`). Asked before the strategy exists; afterwards the
    /// layers above learn it only as the lease ([`FetchStrategy::liveness`]).
    pub fn keeps_working_lists(self) -> bool {
        self == FetchMode::Reliable
    }
}

pub struct FetchStrategy {
    mode: Mode,
    conn: Conn,
    shutdown: Shutdown,
    /// Queues whose key holds another type are left out of every fetch and wait.
    state: Arc<RedisState>,
    /// Jobs stopped and meant to go back to their queues while Redis could not be reached:
    /// retried after every heartbeat that lands, so none stays in our working list for good.
    deferred_requeues: Mutex<Vec<(UnitOfWork, Option<Vec<u8>>)>>,
    /// The jobs finished in the last seconds, re-applied on a new primary after a failover.
    recent: recent::Recent,
    /// Told of each retry written, so the scheduled poller wakes at its score.
    next_due: Arc<NextDue>,
    /// The process's liveness lease: kept where our jobs can be found again if we die.
    liveness: Liveness,
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

    fn recovers_orphans(&self) -> bool {
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
    fn usable<'a>(&self, order: &[&'a str]) -> Vec<&'a str> {
        let mut order = order.to_vec();
        order.retain(|q| !self.state.is_broken(q));
        order
    }

    /// Whether a failed fetch may have moved jobs into our working lists without telling us
    /// (the script ran, its reply was lost), so a rescue `drain` is due once we are idle.
    fn lost_reply_may_hide_jobs(&self) -> bool {
        matches!(self.mode, Mode::Reliable(_))
    }

    /// Right after a fetch whose reply was lost, before any other fetch (nothing has been added
    /// to our working lists since): push back to their queues the jobs it moved there. Safe
    /// under load: the jobs we hold stay. Complete when no ack was pending
    /// ([`FetchStrategy::acks_pending`] is 0); otherwise some may stay, for the idle rescue
    /// (`drain`). Returns how many moved.
    async fn rescue_lost(&self, queues: &[String]) -> redis::RedisResult<i64> {
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

    /// Record a job's outcome (a retry, dead, or nothing) together with its acknowledgement,
    /// retrying until it lands. Reliable fetch writes it only while the job is still in our
    /// working list (`lua/settle.lua`): a job the orphan sweep took back while our lease
    /// lapsed may run elsewhere now, and a retry written for our copy would run it once more.
    /// Basic fetch writes it in one MULTI. Past the shutdown deadline it gives up (logged);
    /// with reliable fetch a job whose ack did not land either stays in the working list and
    /// runs again rather than being lost.
    /// Whether the outcome was written (false: the job had left our working list, or the
    /// shutdown deadline passed first).
    pub async fn settle(&self, job: &UnitOfWork, record: Record<'_>) -> bool {
        let mut pipe = redis::pipe();
        pipe.atomic();
        record.add_to_pipeline(&mut pipe);
        if matches!(self.mode, Mode::Basic(_)) && pipe.cmd_iter().next().is_none() {
            return true;
        }
        let mut conn = self.conn.clone();
        let mut attempts = 0u32;
        loop {
            let landed = match &self.mode {
                Mode::Reliable(r) => r.settle(job, &record).await,
                Mode::Basic(_) => pipe.query_async::<()>(&mut conn).await.map(|()| true),
            };
            let e = match landed {
                Ok(ours) => {
                    if let Mode::Reliable(r) = &self.mode {
                        r.gone(job);
                    }
                    if ours {
                        if let Record::Retry { at, .. } | Record::Schedule { at, .. } = record {
                            self.next_due.note(at);
                        }
                        let writes = pipe.cmd_iter().next().is_some();
                        self.recent.finished(job, writes.then_some(pipe));
                    } else {
                        tracing::warn!(queue = %job.queue,
                            "outcome not recorded: the job had left our working list (the orphan sweep returned it to its queue while our liveness lease lapsed), so it runs again there, once");
                    }
                    return ours;
                }
                Err(e) => e,
            };
            if self.shutdown.past_deadline() {
                tracing::error!(error = %e, queue = %job.queue, payload = %job.payload_lossy(),
                    "could not record the job's outcome in Redis before the shutdown deadline{}",
                    if self.recovers_orphans() { "; if it is still in the working list it will run again" } else { "" });
                return false;
            }
            // Once, then every 10 s: Redis out of memory can refuse it for minutes.
            attempts += 1;
            if attempts % 20 == 1 {
                tracing::warn!(error = %e, queue = %job.queue, attempts,
                    "could not record the job's outcome in Redis; retrying");
            }
            tokio::time::sleep(SETTLE_RETRY_PAUSE).await;
        }
    }

    /// Push an unfinished job back to its queue, once, as `instead` when given (the job with
    /// its shutdown count raised, `job/interrupted.rs`). `Ok(false)`: it was no longer ours
    /// (the orphan sweep had already returned it), nothing pushed.
    async fn requeue(&self, job: &UnitOfWork, instead: Option<&[u8]>) -> redis::RedisResult<bool> {
        match &self.mode {
            Mode::Reliable(r) => {
                let pushed = r.requeue(job, instead).await?;
                // Pushed back, or returned by the sweep already: out of our list either way.
                r.gone(job);
                Ok(pushed)
            }
            Mode::Basic(b) => b.requeue(job, instead).await,
        }
    }

    /// Requeue, logging instead of failing: with reliable fetch a job we could not push back
    /// stays in the working list and is retried after the next heartbeat that lands.
    pub async fn requeue_logged(&self, job: &UnitOfWork) {
        self.requeue_as_logged(job, None).await
    }

    /// `requeue_logged`, pushing `instead` back in the job's place when given.
    pub async fn requeue_as_logged(&self, job: &UnitOfWork, instead: Option<Vec<u8>>) {
        match self.requeue(job, instead.as_deref()).await {
            Ok(true) => tracing::info!(queue = %job.queue, "pushed 1 job back to Redis"),
            Ok(false) => tracing::info!(queue = %job.queue,
                "not pushed back: the orphan sweep had already returned it to its queue"),
            Err(e) if self.recovers_orphans() => {
                tracing::error!(queue = %job.queue, error = %e,
                    "could not push the job back now; it stays in the working list and is retried after the next heartbeat");
                self.deferred_requeues
                    .lock()
                    .unwrap()
                    .push((job.clone(), instead));
            }
            Err(e) => {
                tracing::error!(queue = %job.queue, error = %e, payload = %job.payload_lossy(),
                "could not push the job back (basic fetch): this job is lost")
            }
        }
    }

    /// Push back the jobs whose requeue failed earlier (after a heartbeat landed). Each stays
    /// deferred until Redis answers; LREM semantics keep a swept job from being pushed twice.
    pub async fn retry_deferred_requeues(&self) {
        let deferred = std::mem::take(&mut *self.deferred_requeues.lock().unwrap());
        for (job, instead) in deferred {
            self.requeue_as_logged(&job, instead).await;
        }
    }

    /// Acknowledgements queued or in flight, not yet confirmed by Redis.
    fn acks_pending(&self) -> usize {
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

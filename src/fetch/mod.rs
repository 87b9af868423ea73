//! The one owner of a fetched job's unit of work, as Sidekiq's fetch.rb is: how jobs are taken
//! (a batch, or an idle blocking pop), acknowledged, settled with their outcome, requeued, and
//! drained at a clean stop. The processor and the fetch loop call these and never ask which
//! mode is on. Keys: those of `reliable.rs` / `basic.rs`.
//!
//! To add a strategy: a module beside `reliable.rs`, a variant of `Mode`, and one arm in each
//! method below.

mod acks;
mod basic;
pub mod recent;
mod reliable;
pub mod unit_of_work;
mod working_order;

pub use working_order::working_key;

use crate::connections::redis_conn::Conn;
use crate::fetch::unit_of_work::UnitOfWork;
use crate::process::shutdown::Shutdown;
use basic::BasicFetch;
use reliable::ReliableFetch;
use std::sync::Mutex;

/// Jobs taken in one round trip, in fetch order.
pub type Batch = redis::RedisResult<Vec<UnitOfWork>>;

/// Pause between attempts to write an outcome (as the acks are retried).
const SETTLE_RETRY_PAUSE: std::time::Duration = std::time::Duration::from_millis(500);

enum Mode {
    Reliable(ReliableFetch),
    Basic(BasicFetch),
}

/// What a blocking pop waits on.
pub enum Wait {
    /// Every queue in this fetch's order (basic fetch: BRPOP).
    AllQueues,
    /// One queue, into its working list (reliable fetch: BLMOVE).
    Queue(String),
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

pub struct FetchStrategy {
    mode: Mode,
    conn: Conn,
    shutdown: Shutdown,
    /// Jobs stopped and meant to go back to their queues while Redis could not be reached:
    /// retried after every heartbeat that lands, so none stays in our working list for good.
    deferred_requeues: Mutex<Vec<UnitOfWork>>,
    /// The jobs finished in the last seconds, re-applied on a new primary after a failover.
    recent: recent::Recent,
}

impl FetchStrategy {
    pub fn new(kind: FetchMode, identity: &str, conn: Conn, shutdown: Shutdown) -> FetchStrategy {
        let mode = match kind {
            FetchMode::Reliable => Mode::Reliable(ReliableFetch::start(identity, conn.clone())),
            FetchMode::Basic => Mode::Basic(BasicFetch::new(conn.clone())),
        };
        FetchStrategy {
            mode,
            conn,
            shutdown,
            deferred_requeues: Mutex::default(),
            recent: recent::Recent::default(),
        }
    }

    /// "reliable" or "basic", for the start line.
    pub fn name(&self) -> &'static str {
        match self.mode {
            Mode::Reliable(_) => "reliable",
            Mode::Basic(_) => "basic",
        }
    }

    /// Whether a job of a process that dies can be found again (its working lists): then the
    /// process keeps an alive key and a fetchers entry, holds a liveness lease, records its
    /// locks, and sweeps for dead processes' jobs.
    pub fn recovers_orphans(&self) -> bool {
        matches!(self.mode, Mode::Reliable(_))
    }

    /// Take up to `n` jobs in `order` for the free slots, in one round trip per batch.
    pub async fn take(&self, order: &[&str], n: usize, epoch: u64) -> Batch {
        match &self.mode {
            Mode::Reliable(r) => r.take(order, n, epoch).await,
            Mode::Basic(b) => b.take(order, n, epoch).await,
        }
    }

    /// The blocking pops an idle process keeps: one BLMOVE per queue (reliable), or one BRPOP
    /// per slot up to `max` (basic, as Sidekiq runs one per thread).
    pub fn waits(&self, queues: &[String], slots: usize, max: usize) -> Vec<Wait> {
        match self.mode {
            Mode::Reliable(_) => queues.iter().cloned().map(Wait::Queue).collect(),
            Mode::Basic(_) => (0..slots.min(max)).map(|_| Wait::AllQueues).collect(),
        }
    }

    /// How many blocking pops to have armed. Reliable: all (one per queue). Basic: one per
    /// free slot, but only one once a round timed out (queues idle), so an idle process costs
    /// 0.5 commands/s, not 0.5 x -c.
    pub fn waits_to_arm(&self, all: usize, free: usize, idle: bool) -> usize {
        match self.mode {
            Mode::Reliable(_) => all,
            Mode::Basic(_) if idle => 1,
            Mode::Basic(_) => free,
        }
    }

    /// Whether one delivery should end the other armed pops: a reliable process waits on
    /// every queue for one job, so the others stop (whatever they moved is delivered too);
    /// basic BRPOPs each wait for a slot of their own.
    pub fn one_delivery_ends_waits(&self) -> bool {
        matches!(self.mode, Mode::Reliable(_))
    }

    /// The command for one blocking pop.
    pub fn wait_cmd(&self, wait: &Wait, order: &[&str], timeout_secs: f64) -> redis::Cmd {
        match (&self.mode, wait) {
            (Mode::Reliable(r), Wait::Queue(q)) => r.blocking_move(q, timeout_secs),
            _ => BasicFetch::blocking_pop(order, timeout_secs),
        }
    }

    /// The job a blocking pop's reply holds, if any.
    pub fn delivered(
        &self,
        wait: &Wait,
        reply: redis::Value,
        epoch: u64,
    ) -> redis::RedisResult<Option<UnitOfWork>> {
        Ok(match wait {
            Wait::Queue(q) => redis::from_redis_value::<Option<Vec<u8>>>(reply)?.map(|raw| {
                let mut job = UnitOfWork {
                    queue: q.as_str().into(),
                    raw,
                    epoch,
                    seq: 0,
                };
                if let Mode::Reliable(r) = &self.mode {
                    r.delivered(&mut job);
                }
                job
            }),
            Wait::AllQueues => {
                redis::from_redis_value::<Option<(String, Vec<u8>)>>(reply)?.map(|(k, raw)| {
                    UnitOfWork {
                        queue: k.strip_prefix("queue:").unwrap_or(&k).into(),
                        raw,
                        epoch,
                        seq: 0,
                    }
                })
            }
        })
    }

    /// Whether a failed fetch may have moved jobs into our working lists without telling us
    /// (the script ran, its reply was lost), so a rescue `drain` is due once we are idle.
    pub fn lost_reply_may_hide_jobs(&self) -> bool {
        matches!(self.mode, Mode::Reliable(_))
    }

    /// A job finished: acknowledge it (batched, off the job's path).
    pub fn acknowledge(&self, job: UnitOfWork) {
        self.recent.finished(&job, None);
        if let Mode::Reliable(r) = &self.mode {
            r.acknowledge(job);
        }
    }

    /// Record a job's outcome (the retry or dead writes in `pipe`) together with its
    /// acknowledgement, in one MULTI, retrying until it lands: a MULTI is not rolled back when
    /// one command fails, so the ack may already be applied and this write is the job's only
    /// copy. Past the shutdown deadline it gives up (logged); with reliable fetch a job whose
    /// ack did not land either stays in the working list and runs again rather than being lost.
    pub async fn settle(&self, job: &UnitOfWork, mut pipe: redis::Pipeline) {
        pipe.atomic();
        if let Mode::Reliable(r) = &self.mode {
            r.add_ack(&mut pipe, job);
        }
        if pipe.cmd_iter().next().is_none() {
            return;
        }
        let mut conn = self.conn.clone();
        loop {
            let Err(e) = pipe.query_async::<()>(&mut conn).await else {
                if let Mode::Reliable(r) = &self.mode {
                    r.gone(job);
                }
                self.recent.finished(job, Some(pipe));
                return;
            };
            if self.shutdown.past_deadline() {
                tracing::error!(error = %e, queue = %job.queue, payload = %job.payload_lossy(),
                    "could not record the job's outcome in Redis before the shutdown deadline{}",
                    if self.recovers_orphans() { "; if it is still in the working list it will run again" } else { "" });
                return;
            }
            tracing::warn!(error = %e, queue = %job.queue,
                "could not record the job's outcome in Redis; retrying");
            tokio::time::sleep(SETTLE_RETRY_PAUSE).await;
        }
    }

    /// Push an unfinished job back to its queue, once. `Ok(false)`: it was no longer ours (the
    /// orphan sweep had already returned it), nothing pushed.
    pub async fn requeue(&self, job: &UnitOfWork) -> redis::RedisResult<bool> {
        match &self.mode {
            Mode::Reliable(r) => {
                let pushed = r.requeue(job).await?;
                // Pushed back, or returned by the sweep already: out of our list either way.
                r.gone(job);
                Ok(pushed)
            }
            Mode::Basic(b) => b.requeue(job).await,
        }
    }

    /// Requeue, logging instead of failing: with reliable fetch a job we could not push back
    /// stays in the working list and is retried after the next heartbeat that lands.
    pub async fn requeue_logged(&self, job: &UnitOfWork) {
        match self.requeue(job).await {
            Ok(true) => tracing::info!(queue = %job.queue, "pushed 1 job back to Redis"),
            Ok(false) => tracing::info!(queue = %job.queue,
                "not pushed back: the orphan sweep had already returned it to its queue"),
            Err(e) if self.recovers_orphans() => {
                tracing::error!(queue = %job.queue, error = %e,
                    "could not push the job back now; it stays in the working list and is retried after the next heartbeat");
                self.deferred_requeues.lock().unwrap().push(job.clone());
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
        for job in deferred {
            self.requeue_logged(&job).await;
        }
    }

    /// Acknowledgements queued or in flight, not yet confirmed by Redis.
    pub fn acks_pending(&self) -> usize {
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

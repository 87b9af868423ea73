//! The state one worker process shares between its loops: connections, identity, registry,
//! slot table, shutdown state, and the ack/requeue writes that depend on the fetch mode.
//! Keys: `playguard:working:<identity>:<q>` (reliable fetch), `queue:<q>` (requeue).

use crate::config::Config;
use crate::handler::Registry;
use crate::redis_conn::Conn;
use crate::shutdown::Shutdown;
use crate::work::WorkState;
use std::sync::Arc;

/// A job as fetched: where it came from and the exact bytes popped. Bytes, not a String:
/// a payload that is not even UTF-8 must still reach the dead set (or go back) unchanged.
#[derive(Debug, Clone)]
pub struct Fetched {
    pub queue: String,
    pub raw: Vec<u8>,
    /// The liveness lapse count when the fetch was sent: a job whose process lapsed since may
    /// already have been recovered by another process (see `liveness.rs`).
    pub epoch: u64,
}

impl Fetched {
    /// The payload for log lines (invalid UTF-8 shown with replacement characters).
    pub fn shown(&self) -> std::borrow::Cow<'_, str> {
        String::from_utf8_lossy(&self.raw)
    }
}

pub struct Runtime {
    pub client: crate::redis_conn::Client,
    pub conn: Conn,
    pub identity: String,
    pub config: Config,
    pub registry: Registry,
    pub work: Arc<WorkState>,
    pub shutdown: Shutdown,
    pub metrics: Arc<crate::metrics::Metrics>,
    /// Sidekiq 7/8 Metrics-tab counters, flushed by the heartbeat.
    pub job_metrics: crate::job_metrics::JobMetrics,
    pub acker: crate::acker::Acker,
    /// `DATABASE_URL`: fences for `fence = "database"` locks and the cycle ledger.
    pub db: Option<crate::db::Db>,
    pub liveness: crate::liveness::Liveness,
    /// Jobs stopped and meant to go back to their queues while Redis could not be reached:
    /// retried after every heartbeat that lands, so none stays in our working list for good.
    pub pending_requeues: std::sync::Mutex<Vec<Fetched>>,
}

static REQUEUE: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("../lua/requeue.lua")));

pub fn working_key(identity: &str, queue: &str) -> String {
    format!("playguard:working:{identity}:{queue}")
}

impl Runtime {
    pub fn reliable(&self) -> bool {
        self.config.reliable_fetch
    }

    pub fn working_key(&self, queue: &str) -> String {
        working_key(&self.identity, queue)
    }

    /// Acknowledge a job that finished successfully: batched, off the job's path.
    pub fn ack_done(&self, f: &Fetched) {
        if self.reliable() {
            self.acker.ack(self.working_key(&f.queue), f.raw.clone());
        }
    }

    /// Add the acknowledgement of a finished job to a pipeline (basic fetch has none).
    pub fn add_ack(&self, pipe: &mut redis::Pipeline, f: &Fetched) {
        if self.reliable() {
            pipe.cmd("LREM")
                .arg(self.working_key(&f.queue))
                .arg(-1)
                .arg(&f.raw)
                .ignore();
        }
    }

    /// `playguard:locks:<identity>`: the locks our cycles hold, for the sweep (reliable fetch).
    pub fn locks_record(&self) -> Option<String> {
        self.reliable()
            .then(|| crate::lock::locks_record_key(&self.identity))
    }

    /// Push an unfinished job back to the head of its queue, once. `Ok(false)`: it was no
    /// longer in our working list (the orphan sweep already returned it), nothing pushed.
    pub async fn requeue(&self, f: &Fetched) -> redis::RedisResult<bool> {
        let mut conn = self.conn.clone();
        if self.reliable() {
            let n: i64 = REQUEUE
                .key(self.working_key(&f.queue))
                .key(format!("queue:{}", f.queue))
                .arg(&f.raw)
                .invoke_async(&mut conn)
                .await?;
            if n < 0 {
                return Err(redis::RedisError::from((
                    redis::ErrorKind::Client,
                    "the queue key holds another type than a list",
                    format!("queue:{}", f.queue),
                )));
            }
            Ok(n == 1)
        } else {
            let pushed: redis::RedisResult<i64> = redis::cmd("RPUSH")
                .arg(format!("queue:{}", f.queue))
                .arg(&f.raw)
                .query_async(&mut conn)
                .await;
            if let Err(e) = pushed {
                if e.code() != Some("WRONGTYPE") {
                    return Err(e);
                }
                // Basic fetch has no working list to leave it in: keep it in `dead`.
                let why = format!(
                    "queue:{} is not a list: the job could not be pushed back",
                    f.queue
                );
                tracing::error!(queue = %f.queue, error_class = crate::error_class::BAD_QUEUE_KEY,
                    "{why}; moved to dead");
                let mut pipe = redis::pipe();
                crate::retry::add_dead(
                    &mut pipe,
                    &crate::retry::dead_entry(&f.raw, crate::error_class::BAD_QUEUE_KEY, &why),
                );
                pipe.query_async::<()>(&mut conn).await?;
            }
            Ok(true)
        }
    }

    /// Requeue, logging instead of failing: with reliable fetch a job we could not push back
    /// stays in the working list and is retried after the next heartbeat that lands.
    pub async fn requeue_logged(&self, f: &Fetched) {
        match self.requeue(f).await {
            Ok(true) => tracing::info!(queue = %f.queue, "pushed 1 job back to Redis"),
            Ok(false) => tracing::info!(queue = %f.queue,
                "not pushed back: the orphan sweep had already returned it to its queue"),
            Err(e) if self.reliable() => {
                tracing::error!(queue = %f.queue, error = %e,
                    "could not push the job back now; it stays in the working list and is retried after the next heartbeat");
                self.pending_requeues.lock().unwrap().push(f.clone());
            }
            Err(e) => tracing::error!(queue = %f.queue, error = %e, payload = %f.shown(),
                "could not push the job back (basic fetch): this job is lost"),
        }
    }

    /// Push back the jobs whose requeue failed earlier (after a heartbeat landed). Each stays
    /// pending until Redis answers; LREM semantics keep a swept job from being pushed twice.
    pub async fn retry_pending_requeues(&self) {
        let pending = std::mem::take(&mut *self.pending_requeues.lock().unwrap());
        for f in pending {
            self.requeue_logged(&f).await;
        }
    }
}

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
    pub acker: crate::acker::Acker,
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

    /// Push an unfinished job back to the head of its queue, once.
    pub async fn requeue(&self, f: &Fetched) -> redis::RedisResult<()> {
        let mut conn = self.conn.clone();
        if self.reliable() {
            let _: i64 = REQUEUE
                .key(self.working_key(&f.queue))
                .key(format!("queue:{}", f.queue))
                .arg(&f.raw)
                .invoke_async(&mut conn)
                .await?;
        } else {
            let _: i64 = redis::cmd("RPUSH")
                .arg(format!("queue:{}", f.queue))
                .arg(&f.raw)
                .query_async(&mut conn)
                .await?;
        }
        Ok(())
    }

    /// Requeue, logging instead of failing: with reliable fetch a job we could not push back
    /// stays in the working list and the orphan sweep returns it later.
    pub async fn requeue_logged(&self, f: &Fetched) {
        match self.requeue(f).await {
            Ok(()) => tracing::info!(queue = %f.queue, "pushed 1 job back to Redis"),
            Err(e) if self.reliable() => tracing::error!(queue = %f.queue, error = %e,
                "could not push the job back now; it stays in the working list and will be recovered"),
            Err(e) => tracing::error!(queue = %f.queue, error = %e, payload = %f.shown(),
                "could not push the job back (basic fetch): this job is lost"),
        }
    }
}

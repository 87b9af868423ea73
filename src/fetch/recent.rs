//! What this process finished in its last seconds, kept in memory so that after a failover it
//! can re-apply on the new primary what the old one may have taken without replicating (acks,
//! outcomes), and list again there the jobs it still runs (`lua/reconcile.lua`). Keys:
//! `queue:<q>`, `playguard:working:<identity>:<q>`, and what an outcome writes (`retry`,
//! `dead`).

use crate::fetch::unit_of_work::UnitOfWork;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How far back a failover looks. Replication lags by milliseconds, but a planned failover
/// promotes the replica about a second before the sentinels announce it; 10 s covers both.
pub const WINDOW: Duration = Duration::from_secs(10);
/// At most this many finished jobs are kept (a very fast process keeps the newest ones): about
/// 2 s of a process running 10,000 jobs/s, and a few MB of payloads, not tens.
const MOST: usize = 20_000;

static RECONCILE: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("../../lua/reconcile.lua")));

/// One finished job: its queue, its bytes, and the outcome's writes (None: done). The writes
/// are boxed: a pipeline takes 96 bytes inline, and most finished jobs have none, so an entry
/// stays at 64 bytes (the window holds up to `MOST`).
#[derive(Clone)]
struct Finished {
    at: Instant,
    queue: Arc<str>,
    raw: Vec<u8>,
    outcome: Option<Box<redis::Pipeline>>,
}

#[derive(Default)]
pub struct Recent {
    finished: Mutex<VecDeque<Finished>>,
}

/// What one reconciliation did, for its log line.
#[derive(Debug, Default)]
pub struct Reconciled {
    pub finished: usize,
    pub running: usize,
    /// Copies removed from their queues: jobs that would otherwise have run again.
    pub unqueued: i64,
}

impl Recent {
    /// `job` finished (`outcome`: the writes of its retry or dead, if it failed).
    pub fn finished(&self, job: &UnitOfWork, outcome: Option<redis::Pipeline>) {
        let now = Instant::now();
        let mut f = self.finished.lock().unwrap_or_else(|e| e.into_inner());
        while f
            .front()
            .is_some_and(|x| now.duration_since(x.at) > WINDOW || f.len() >= MOST)
        {
            f.pop_front();
        }
        f.push_back(Finished {
            at: now,
            queue: job.queue.clone(),
            raw: job.raw.clone(),
            outcome: outcome.map(Box::new),
        });
    }

    /// Re-apply on `conn` (the new primary, not yet in use) the jobs finished within
    /// [`WINDOW`] and list the `running` ones (queue, payload). `working` names a queue's
    /// working list (reliable fetch) or None (basic).
    pub async fn reconcile<C: redis::aio::ConnectionLike + Send>(
        &self,
        conn: &mut C,
        running: &[(Arc<str>, Arc<str>)],
        working: impl Fn(&str) -> Option<String>,
    ) -> redis::RedisResult<Reconciled> {
        let mut done = Reconciled::default();
        for (queue, payload) in running {
            done.unqueued += apply(conn, queue, payload.as_bytes(), "running", &working).await?;
            done.running += 1;
        }
        let jobs: Vec<Finished> = {
            let f = self.finished.lock().unwrap_or_else(|e| e.into_inner());
            let now = Instant::now();
            f.iter()
                .filter(|x| now.duration_since(x.at) <= WINDOW)
                .cloned()
                .collect()
        };
        for Finished {
            queue,
            raw,
            outcome,
            ..
        } in jobs
        {
            if let Some(pipe) = outcome {
                // The same bytes and scores: a ZADD that landed already changes nothing.
                pipe.query_async::<()>(conn).await?;
            }
            done.unqueued += apply(conn, &queue, &raw, "done", &working).await?;
            done.finished += 1;
        }
        Ok(done)
    }
}

async fn apply<C: redis::aio::ConnectionLike + Send>(
    conn: &mut C,
    queue: &str,
    raw: &[u8],
    state: &str,
    working: &impl Fn(&str) -> Option<String>,
) -> redis::RedisResult<i64> {
    let mut inv = RECONCILE.prepare_invoke();
    inv.key(crate::job::queues::queue_key(queue));
    if let Some(w) = working(queue) {
        inv.key(w);
    }
    inv.arg(raw).arg(state);
    let n: i64 = inv.invoke_async(conn).await?;
    if n < 0 {
        tracing::warn!(
            queue,
            "failover reconcile: a key is not a list; skipped this job"
        );
    }
    Ok(n.max(0))
}

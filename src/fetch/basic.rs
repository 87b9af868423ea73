//! Basic fetch, as Sidekiq OSS: a popped job is only in memory. While the queues are busy
//! `RPOP queue:<q> <count>` takes a batch for the free slots; when they are empty BRPOP waits
//! over all of them. Nothing to acknowledge; a requeue is an RPUSH back onto `queue:<q>` (or,
//! when that key holds another type, the job goes to `dead` with the reason).

use super::Batch;
use crate::connections::redis_conn::Conn;
use crate::fetch::unit_of_work::UnitOfWork;
use crate::job::queues::queue_key;

pub struct BasicFetch {
    conn: Conn,
}

impl BasicFetch {
    pub fn new(conn: Conn) -> BasicFetch {
        BasicFetch { conn }
    }

    /// `RPOP queue:<q> <count>` in fetch order until `n` are taken, as BRPOP would take them
    /// one by one. Plain commands, not a script: a payload that passes through Lua costs Redis
    /// several times the instructions (callgrind: 7.7k vs 1.3k per job). With several queues
    /// one pipeline of LLEN says which to pop from, so the empty ones cost no round trip each.
    pub async fn take(&self, order: &[&str], n: usize, epoch: u64) -> Batch {
        let mut conn = self.conn.clone();
        let plan: Vec<(usize, usize)> = if order.len() == 1 {
            vec![(0, n)]
        } else {
            let mut p = redis::pipe();
            for q in order {
                p.cmd("LLEN").arg(queue_key(q));
            }
            let lens: Vec<usize> = p.query_async(&mut conn).await?;
            let mut left = n;
            let mut plan = Vec::new();
            for (i, len) in lens.into_iter().enumerate() {
                let take = len.min(left);
                if take > 0 {
                    plan.push((i, take));
                    left -= take;
                }
            }
            plan
        };
        let mut out = Vec::new();
        if plan.is_empty() {
            return Ok(out);
        }
        let mut p = redis::pipe();
        for (i, take) in &plan {
            p.cmd("RPOP").arg(queue_key(order[*i])).arg(*take);
        }
        let popped: Vec<Option<Vec<Vec<u8>>>> = p.query_async(&mut conn).await?;
        for ((i, _), jobs) in plan.iter().zip(popped) {
            let queue: std::sync::Arc<str> = order[*i].into();
            for raw in jobs.into_iter().flatten() {
                out.push(UnitOfWork {
                    queue: queue.clone(),
                    raw,
                    epoch,
                    seq: 0,
                });
            }
        }
        Ok(out)
    }

    /// The idle wait: BRPOP over every queue in this fetch's order.
    pub fn blocking_pop(order: &[&str], timeout_secs: f64) -> redis::Cmd {
        let keys: Vec<String> = order.iter().map(|q| queue_key(q)).collect();
        let mut c = redis::cmd("BRPOP");
        c.arg(&keys).arg(timeout_secs);
        c
    }

    /// Push an unfinished job back onto its queue. There is no working list to keep it in, so
    /// when the queue key holds another type the job goes to `dead` with the reason.
    /// `instead`: the bytes that go back in its place (the same job, its shutdown count raised).
    pub async fn requeue(
        &self,
        job: &UnitOfWork,
        instead: Option<&[u8]>,
    ) -> redis::RedisResult<bool> {
        let mut conn = self.conn.clone();
        let pushed: redis::RedisResult<i64> = redis::cmd("RPUSH")
            .arg(job.queue_key())
            .arg(instead.unwrap_or(&job.raw))
            .query_async(&mut conn)
            .await;
        match pushed {
            Err(e) if e.code() == Some("WRONGTYPE") => {
                let class = crate::job::error_class::BAD_QUEUE_KEY;
                let why = format!(
                    "queue:{} is not a list: the job could not be pushed back",
                    job.queue
                );
                tracing::error!(queue = %job.queue, error_class = class, "{why}; moved to dead");
                let mut pipe = redis::pipe();
                crate::job::retry::add_dead(
                    &mut pipe,
                    &crate::job::retry::dead_entry(&job.raw, class, &why),
                );
                pipe.query_async::<()>(&mut conn).await?;
                Ok(true)
            }
            Err(e) => Err(e),
            Ok(_) => Ok(true),
        }
    }
}

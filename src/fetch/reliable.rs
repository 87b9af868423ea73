//! Reliable fetch: a job is never only in memory. `lua/fetch.lua` moves up to N jobs from
//! `queue:<q>` into `playguard:working:<identity>:<q>` (refusing while our
//! `playguard:alive:<identity>` is missing), idle waits use BLMOVE into the same lists, the
//! acknowledgements remove finished jobs from them in batches (`acks.rs`, in the lists' order
//! as `working_order.rs` pictures it), a failed job's outcome is written only while it is
//! still ours (`lua/settle.lua`, which also writes `retry` or `dead`), a requeue moves one job back
//! (`lua/requeue.lua`), what a fetch whose reply was lost moved is pushed back before the next
//! fetch (`lua/rescue.lua`), and a clean stop drains them all back (`lua/drain.lua`). Whatever a dead
//! process leaves in its lists the orphan sweep (`loops/sweeper.rs`) returns.

use super::acks::Acks;
use super::working_order::working_key;
use super::Batch;
use crate::connections::redis_conn::Conn;
use crate::fetch::unit_of_work::UnitOfWork;
use crate::job::queues::queue_key;
use crate::job::retry::Record;
use crate::process::redis_state::RedisState;
use std::sync::Arc;

/// Most queues one fetch script call looks at (see `take`).
const FETCH_QUEUES_PER_CALL: usize = 8;

static FETCH: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("../../lua/fetch.lua")));
static REQUEUE: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("../../lua/requeue.lua")));
static SETTLE: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("../../lua/settle.lua")));
static RESCUE: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("../../lua/rescue.lua")));
static DRAIN: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("../../lua/drain.lua")));

pub struct ReliableFetch {
    identity: String,
    conn: Conn,
    acks: Acks,
    /// Where a queue the script skipped for its type is marked (fetch then leaves it out).
    state: Arc<RedisState>,
}

impl ReliableFetch {
    pub fn start(identity: &str, conn: Conn, state: Arc<RedisState>) -> ReliableFetch {
        ReliableFetch {
            identity: identity.to_string(),
            acks: Acks::start(conn.clone(), identity),
            conn,
            state,
        }
    }

    pub fn working_key(&self, queue: &str) -> String {
        working_key(&self.identity, queue)
    }

    /// Move up to `n` jobs, in queue order, into our working lists. Queues go in chunks:
    /// every key of a call costs Redis a Lua string, so with 100 queues a batch the first few
    /// can fill should not pay for all 200 keys. A later chunk is asked only for what the
    /// earlier ones lacked, which keeps the order strict.
    pub async fn take(&self, order: &[&str], n: usize, epoch: u64) -> Batch {
        let mut conn = self.conn.clone();
        let mut out = Vec::new();
        for chunk in order.chunks(FETCH_QUEUES_PER_CALL) {
            let want = n - out.len();
            if want == 0 {
                break;
            }
            let mut inv = FETCH.prepare_invoke();
            for q in chunk {
                inv.key(queue_key(q));
            }
            for q in chunk {
                inv.key(self.working_key(q));
            }
            inv.key(crate::process::liveness::alive_key(&self.identity));
            inv.arg(want);
            let reply: Vec<redis::Value> = inv.invoke_async(&mut conn).await?;
            let mut it = reply.into_iter();
            while let (Some(idx), Some(jobs)) = (it.next(), it.next()) {
                let i: i64 = redis::from_redis_value_ref(&idx)?;
                if i < 0 {
                    self.skipped(chunk[(-i - 1) as usize], &jobs)?;
                    continue;
                }
                let i = i as usize;
                let redis::Value::Array(jobs) = jobs else {
                    return Err(redis::RedisError::from((
                        redis::ErrorKind::Client,
                        "fetch script: a queue's jobs are not an array",
                    )));
                };
                let queue = chunk[i - 1];
                // Oldest first, as the script pushed them: their order in the working list.
                let seq = self.acks.fetched(queue, jobs.len());
                let queue: std::sync::Arc<str> = queue.into();
                out.reserve(jobs.len());
                for (k, job) in jobs.into_iter().enumerate() {
                    // The reply's own buffer becomes the job's bytes: no copy per job.
                    let raw: Vec<u8> = match job {
                        redis::Value::BulkString(b) => b,
                        other => redis::from_redis_value_ref(&other)?,
                    };
                    out.push(UnitOfWork {
                        queue: queue.clone(),
                        raw,
                        epoch,
                        seq: seq + k as u64,
                    });
                }
            }
        }
        Ok(out)
    }

    /// The script skipped `queue`: its key or our working list of it holds another type
    /// (`reply` is `[key, type]`). Marked broken and logged once, naming the key.
    fn skipped(&self, queue: &str, reply: &redis::Value) -> redis::RedisResult<()> {
        let (key, kind): (String, String) = redis::from_redis_value_ref(reply)?;
        let why = format!("{key} holds a {kind}, not a list");
        if self.state.mark_broken(queue, why.clone()) {
            tracing::error!(queue, key = %key,
                "{why}: queue {queue} is skipped by fetch until the key is fixed (deleted or made a list)");
        }
        Ok(())
    }

    /// The idle wait for one queue: BLMOVE its next job into our working list.
    pub fn blocking_move(&self, queue: &str, timeout_secs: f64) -> redis::Cmd {
        let mut c = redis::cmd("BLMOVE");
        c.arg(queue_key(queue))
            .arg(self.working_key(queue))
            .arg("RIGHT")
            .arg("LEFT")
            .arg(timeout_secs);
        c
    }

    /// A blocking move delivered this job into our working list.
    pub fn delivered(&self, job: &mut UnitOfWork) {
        job.seq = self.acks.fetched(&job.queue, 1);
    }

    /// Queue the acknowledgement of a finished job (sent in a batch, off the job's path).
    pub fn acknowledge(&self, job: UnitOfWork) {
        self.acks.ack(job);
    }

    /// The job left our working list another way (settled or pushed back), as Redis confirmed.
    pub fn gone(&self, job: &UnitOfWork) {
        self.acks.gone(job);
    }

    /// Record a failed job's outcome with its acknowledgement, only while the job is still in
    /// our working list (`lua/settle.lua`). Ok(false): it was not (nothing written).
    pub async fn settle(&self, job: &UnitOfWork, record: &Record<'_>) -> redis::RedisResult<bool> {
        let (kind, score, entry, oldest, rank) = record.script_args();
        let mut conn = self.conn.clone();
        let n: i64 = SETTLE
            .key(self.working_key(&job.queue))
            .key("retry")
            .key("dead")
            .key("schedule")
            .arg(&job.raw)
            .arg(kind)
            .arg(score)
            .arg(entry)
            .arg(oldest)
            .arg(rank)
            .invoke_async(&mut conn)
            .await?;
        if n < 0 {
            return Err(redis::RedisError::from((
                redis::ErrorKind::Client,
                "the outcome's key holds another type than a sorted set",
                kind.to_string(),
            )));
        }
        Ok(n == 1)
    }

    /// Acks queued or in flight, not yet confirmed by Redis.
    pub fn acks_pending(&self) -> usize {
        self.acks.pending()
    }

    /// Stop taking acks and wait until every queued one was sent.
    pub async fn finish_acks(&self) {
        self.acks.flush_and_stop().await
    }

    /// Push an unfinished job back to the head of its queue, once. `Ok(false)`: it was no
    /// longer in our working list (the orphan sweep already returned it), nothing pushed.
    /// `instead`: the bytes that go back in its place (the same job, its shutdown count raised).
    pub async fn requeue(
        &self,
        job: &UnitOfWork,
        instead: Option<&[u8]>,
    ) -> redis::RedisResult<bool> {
        let mut conn = self.conn.clone();
        let mut inv = REQUEUE.key(self.working_key(&job.queue));
        inv.key(job.queue_key()).arg(&job.raw);
        if let Some(bytes) = instead {
            inv.arg(bytes);
        }
        let n: i64 = inv.invoke_async(&mut conn).await?;
        if n < 0 {
            return Err(redis::RedisError::from((
                redis::ErrorKind::Client,
                "the queue key holds another type than a list",
                job.queue_key(),
            )));
        }
        Ok(n == 1)
    }

    /// After a fetch whose reply was lost and before any other fetch: push back what it moved
    /// into our working lists, the elements at their left ends beyond the jobs we know
    /// (`lua/rescue.lua`). The count of known jobs is taken right before each list's script and
    /// is never too low (an ack confirmed meanwhile only makes it high), so no job of ours is
    /// pushed back; it is exact when no ack is pending. Returns how many moved.
    pub async fn rescue_lost(&self, queues: &[String]) -> redis::RedisResult<i64> {
        let mut conn = self.conn.clone();
        let mut moved = 0;
        for q in queues {
            let known = self.acks.known(q);
            let n: i64 = RESCUE
                .key(self.working_key(q))
                .key(queue_key(q))
                .arg(known)
                .invoke_async(&mut conn)
                .await?;
            if n < 0 {
                tracing::error!(
                    "queue:{q} is not a list: jobs a lost fetch moved stay in our working list, for the orphan sweep"
                );
            }
            moved += n.max(0);
        }
        Ok(moved)
    }

    /// Push everything still in our own working lists back to the heads of its queues (a
    /// clean stop, or the rescue after a fetch whose reply was lost). Returns how many moved.
    pub async fn drain(&self, queues: &[String]) -> redis::RedisResult<i64> {
        let mut inv = DRAIN.prepare_invoke();
        for q in queues {
            inv.key(self.working_key(q)).key(queue_key(q));
        }
        let mut conn = self.conn.clone();
        let reply: Vec<redis::Value> = inv.invoke_async(&mut conn).await?;
        for key in reply.iter().skip(1) {
            let key: String = redis::from_redis_value_ref(key)?;
            tracing::error!(
                "{key} is not a list: its jobs stay in our working list, for the orphan sweep"
            );
        }
        // Whatever we pictured in the lists has gone back to the queues (a list skipped for
        // its queue key's type stays for the sweep; its jobs were not running either).
        self.acks.drained();
        match reply.first() {
            Some(n) => Ok(redis::from_redis_value_ref(n)?),
            None => Ok(0),
        }
    }
}

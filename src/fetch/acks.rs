//! Reliable fetch's acknowledgements, off the jobs' path: finished jobs leave
//! `playguard:working:<identity>:<q>` in batches, the oldest finished ones of each list by one
//! guarded trim (`lua/ack_oldest.lua`), any other one by `LREM key -1 payload` (see
//! `working_order.rs` for which is which). One task sends them, in order, on its own
//! connection. At shutdown the acks are flushed before the working lists are drained, so a
//! finished job is never pushed back.
//!
//! LREMs are plain commands, not a script: each is atomic on its own, a retried batch is
//! harmless (a second LREM finds nothing), and no payload becomes a Lua string. A trim whose
//! guard refused is repeated as LREMs, so a retried batch is harmless too.

use super::working_order::{Ack, WorkingOrder};
use crate::fetch::unit_of_work::UnitOfWork;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

static ACK_OLDEST: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("../../lua/ack_oldest.lua")));

struct Shared {
    order: Mutex<WorkingOrder>,
    wake: tokio::sync::Notify,
    closed: AtomicBool,
    /// Finished jobs whose acknowledgement Redis has not confirmed yet.
    pending: AtomicUsize,
}

pub(super) struct Acks {
    shared: Arc<Shared>,
    task: tokio::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Acks {
    pub fn start(conn: crate::connections::redis_conn::Conn, identity: &str) -> Acks {
        let shared = Arc::new(Shared {
            order: Mutex::default(),
            wake: tokio::sync::Notify::new(),
            closed: AtomicBool::new(false),
            pending: AtomicUsize::new(0),
        });
        let task = tokio::spawn(run(conn, identity.to_string(), shared.clone()));
        Acks {
            shared,
            task: tokio::sync::Mutex::new(Some(task)),
        }
    }

    /// `n` jobs were just moved into `queue`'s working list, oldest first: the sequence number
    /// of the first (each job carries its own to its acknowledgement).
    pub fn fetched(&self, queue: &str, n: usize) -> u64 {
        self.shared.order.lock().unwrap().register(queue, n)
    }

    /// Queue the acknowledgement of one finished job.
    pub fn ack(&self, job: UnitOfWork) {
        if self.shared.closed.load(Ordering::Acquire) {
            return;
        }
        self.shared.pending.fetch_add(1, Ordering::SeqCst);
        self.shared
            .order
            .lock()
            .unwrap()
            .finished(&job.queue, job.seq, job.raw);
        self.shared.wake.notify_one();
    }

    /// A job left its working list another way (its outcome settled, or pushed back), as
    /// Redis confirmed.
    pub fn gone(&self, job: &UnitOfWork) {
        self.shared.order.lock().unwrap().gone(&job.queue, job.seq);
    }

    /// Our working lists were drained: nothing fetched so far is in them any more.
    pub fn drained(&self) {
        self.shared.order.lock().unwrap().reset();
    }

    /// At least how many elements of `queue`'s working list are jobs we know: those in the
    /// picture, plus every ack not yet confirmed (of any queue: counted high, never low).
    pub fn known(&self, queue: &str) -> usize {
        let order = self.shared.order.lock().unwrap();
        order.in_list(queue) + self.pending()
    }

    /// Acks queued or being sent, not yet confirmed by Redis.
    pub fn pending(&self) -> usize {
        self.shared.pending.load(Ordering::SeqCst)
    }

    /// Stop taking acks and wait until every queued one was sent.
    pub async fn flush_and_stop(&self) {
        self.shared.closed.store(true, Ordering::Release);
        self.shared.wake.notify_one();
        if let Some(t) = self.task.lock().await.take() {
            let _ = t.await;
        }
    }
}

/// After shutdown closed the queue, how long failed acks keep being retried.
const FLUSH_GRACE: std::time::Duration = std::time::Duration::from_secs(5);
const RETRY_PAUSE: std::time::Duration = std::time::Duration::from_millis(500);

async fn run(
    mut conn: crate::connections::redis_conn::Conn,
    identity: String,
    shared: Arc<Shared>,
) {
    let mut closed_at: Option<tokio::time::Instant> = None;
    loop {
        let closed = shared.closed.load(Ordering::Acquire);
        let flush = shared
            .order
            .lock()
            .unwrap()
            .take_acks(std::time::Instant::now(), closed);
        if flush.acks.is_empty() {
            if closed {
                return;
            }
            match flush.recheck_at {
                Some(at) => {
                    let at = tokio::time::Instant::from_std(at);
                    tokio::select! {
                        _ = shared.wake.notified() => {}
                        _ = tokio::time::sleep_until(at) => {}
                    }
                }
                None => shared.wake.notified().await,
            }
            continue;
        }
        let count: usize = flush
            .acks
            .iter()
            .map(|(_, a)| match a {
                Ack::Oldest(v) => v.len(),
                Ack::One(_) => 1,
            })
            .sum();
        let key = |q: &str| super::working_order::working_key(&identity, q);
        // Trims first in the reply, so their guards' answers are easy to pair back.
        let mut pipe = redis::Pipeline::with_capacity(flush.acks.len());
        let mut trims = Vec::new();
        for (q, a) in &flush.acks {
            if let Ack::Oldest(v) = a {
                let mut inv = ACK_OLDEST.key(key(q));
                inv.arg(v.len()).arg(&v[0]).arg(&v[v.len() - 1]);
                pipe.invoke_script(&inv);
                trims.push((q, v));
            }
        }
        for (q, a) in &flush.acks {
            if let Ack::One(raw) = a {
                let k = key(q);
                let mut c = redis::Cmd::with_capacity(4, 6 + k.len() + 2 + raw.len());
                c.arg("LREM").arg(k).arg(-1).arg(raw);
                pipe.add_command(c).ignore();
            }
        }
        let guards: Vec<i64> = send(&mut conn, &pipe, &mut closed_at, count, &shared).await;
        // A guard that refused: the list was not as pictured, so each of its payloads goes by
        // its own LREM (harmless where one is gone already).
        let mut fallback = redis::pipe();
        let mut refused = 0;
        for ((q, v), ok) in trims.iter().zip(guards) {
            if ok == 0 {
                refused += 1;
                for raw in v.iter() {
                    fallback.cmd("LREM").arg(key(q)).arg(-1).arg(raw).ignore();
                }
            }
        }
        if refused > 0 {
            tracing::debug!(
                lists = refused,
                "a working list was not as pictured; acknowledging by LREM"
            );
            let _: Vec<i64> = send(&mut conn, &fallback, &mut closed_at, 0, &shared).await;
        }
        shared.pending.fetch_sub(count, Ordering::SeqCst);
    }
}

/// Send one batch until Redis answers (the acks stay queued: an ack that never lands would let
/// a clean stop push a finished job back). After shutdown began, give up after FLUSH_GRACE
/// (the jobs then run again: at-least-once) and answer as if every guard had refused.
async fn send(
    conn: &mut crate::connections::redis_conn::Conn,
    pipe: &redis::Pipeline,
    closed_at: &mut Option<tokio::time::Instant>,
    jobs: usize,
    shared: &Shared,
) -> Vec<i64> {
    loop {
        match pipe.query_async::<Vec<i64>>(conn).await {
            Ok(v) => return v,
            // Redis restarted (or flushed its scripts): load ours and send again at once.
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                if let Err(e) = ACK_OLDEST.load_async(conn).await {
                    tracing::warn!(error = %e, "loading the acknowledgement script failed; retrying");
                    tokio::time::sleep(RETRY_PAUSE).await;
                }
            }
            Err(e) => {
                if shared.closed.load(Ordering::Acquire) {
                    let since = *closed_at.get_or_insert_with(tokio::time::Instant::now);
                    if since.elapsed() > FLUSH_GRACE {
                        tracing::error!(error = %e, jobs,
                            "could not acknowledge finished jobs before exit; they will run again");
                        return Vec::new();
                    }
                }
                tracing::warn!(error = %e, jobs, "acknowledging finished jobs failed; retrying");
                tokio::time::sleep(RETRY_PAUSE).await;
            }
        }
    }
}

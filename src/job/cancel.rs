//! Sidekiq's cancel, as `Sidekiq::Client#cancel!(jid)` (7.3.3+) and `IterableJob#cancel!` ask
//! for it: the `cancelled` field (Unix seconds) of the hash `it-<jid>`. This file watches that
//! field for the running jobs of this process that asked for it ([`Cancels::watch`]: command
//! jobs and `on_cancel = "kill"` cycles): one pipelined `HGET it-<jid> cancelled` per running
//! watched job, sent in one round trip every [`TICK`] for the whole process, so a job nobody
//! cancels costs a map entry and its share of that round trip. Keys: `it-<jid>` (read only).

use crate::connections::redis_conn::Conn;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;
use tokio::sync::watch;

/// How often the running watched jobs' `cancelled` fields are read: a kill-on-cancel job
/// stops within about this long after the cancel (plus its command's TERM grace).
pub const TICK: Duration = Duration::from_secs(1);

/// The hash Sidekiq keeps an iterable job's state in, and its cancel flag.
pub fn key(jid: &str) -> String {
    format!("it-{jid}")
}

/// The field `cancel!` sets (HSETNX, Unix seconds).
pub const FIELD: &str = "cancelled";

/// The process's watched jobs; cheap to clone. The reading task starts with the first watch
/// and ends when the last clone is dropped.
#[derive(Clone)]
pub struct Cancels {
    inner: Arc<Inner>,
}

/// A watched job: (watch id, jid, where to say it was cancelled).
type Watched = (u64, Arc<str>, watch::Sender<bool>);

struct Inner {
    conn: Conn,
    /// The watched jobs; a watch is removed when dropped.
    watched: Mutex<Vec<Watched>>,
    next_id: std::sync::atomic::AtomicU64,
    started: std::sync::Once,
}

impl Cancels {
    pub fn new(conn: Conn) -> Cancels {
        Cancels {
            inner: Arc::new(Inner {
                conn,
                watched: Mutex::new(Vec::new()),
                next_id: std::sync::atomic::AtomicU64::new(0),
                started: std::sync::Once::new(),
            }),
        }
    }

    /// Watch `jid`'s cancel flag until the returned guard is dropped. Must be called on the
    /// tokio runtime (the first call starts the reading task).
    pub fn watch(&self, jid: &Arc<str>) -> CancelWatch {
        let (tx, rx) = watch::channel(false);
        let id = self
            .inner
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner
            .watched
            .lock()
            .unwrap()
            .push((id, jid.clone(), tx));
        self.inner.started.call_once(|| {
            tokio::spawn(read_flags(Arc::downgrade(&self.inner)));
        });
        CancelWatch {
            id,
            signal: CancelSignal(rx),
            inner: Arc::downgrade(&self.inner),
        }
    }

    /// How many jobs are watched now.
    pub fn watched(&self) -> usize {
        self.inner.watched.lock().unwrap().len()
    }
}

/// One job's watch; dropping it stops the watching.
pub struct CancelWatch {
    id: u64,
    signal: CancelSignal,
    inner: Weak<Inner>,
}

impl CancelWatch {
    /// A handle that resolves on the cancel, for the parts of the job that stop on it.
    pub fn signal(&self) -> CancelSignal {
        self.signal.clone()
    }

    pub fn is_cancelled(&self) -> bool {
        self.signal.is_cancelled()
    }
}

impl Drop for CancelWatch {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.upgrade() {
            inner
                .watched
                .lock()
                .unwrap()
                .retain(|(id, ..)| *id != self.id);
        }
    }
}

/// Whether (and when) a watched job was cancelled.
#[derive(Clone)]
pub struct CancelSignal(watch::Receiver<bool>);

impl CancelSignal {
    pub fn is_cancelled(&self) -> bool {
        *self.0.borrow()
    }

    /// Resolves once the job is found cancelled (never, if its watch is dropped first).
    pub async fn cancelled(&self) {
        let mut rx = self.0.clone();
        if rx.wait_for(|c| *c).await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// Every [`TICK`], one pipeline of `HGET it-<jid> cancelled` for the watched jobs; a set flag
/// wakes that job's watch. A Redis error skips the tick (the next one asks again).
async fn read_flags(inner: Weak<Inner>) {
    let mut failing = false;
    loop {
        tokio::time::sleep(TICK).await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let jids: Vec<(u64, Arc<str>)> = {
            let w = inner.watched.lock().unwrap();
            w.iter()
                .filter(|(_, _, tx)| !*tx.borrow())
                .map(|(id, jid, _)| (*id, jid.clone()))
                .collect()
        };
        if jids.is_empty() {
            continue;
        }
        let mut pipe = redis::pipe();
        for (_, jid) in &jids {
            pipe.hget(key(jid), FIELD);
        }
        let mut conn = inner.conn.clone();
        let flags: Vec<Option<String>> = match pipe.query_async(&mut conn).await {
            Ok(f) => f,
            Err(e) => {
                if !failing {
                    tracing::warn!(error = %e, "could not read the cancel flags of running jobs; trying again");
                }
                failing = true;
                continue;
            }
        };
        failing = false;
        let w = inner.watched.lock().unwrap();
        for ((id, _), flag) in jids.iter().zip(flags) {
            if flag.is_some() {
                if let Some((_, _, tx)) = w.iter().find(|(i, ..)| i == id) {
                    let _ = tx.send(true);
                }
            }
        }
    }
}

/// Whether `it-<jid>` says the job was cancelled before it started (one HGET). A Redis error
/// counts as not cancelled: the job runs, and its watch may still stop it.
pub async fn cancelled_before_start(redis: &Conn, jid: &str) -> bool {
    let mut conn = redis.clone();
    let flag: redis::RedisResult<Option<String>> = redis::cmd("HGET")
        .arg(key(jid))
        .arg(FIELD)
        .query_async(&mut conn)
        .await;
    match flag {
        Ok(Some(at)) => {
            tracing::info!(cancelled_at = %at, "job cancelled before it started: not run (no retry)");
            true
        }
        Ok(None) => false,
        Err(e) => {
            tracing::warn!(error = %e, "could not read the job's cancel flag; running it");
            false
        }
    }
}

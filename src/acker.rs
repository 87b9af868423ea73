//! Batched acknowledgements for reliable fetch: finished jobs are removed from
//! `playguard:working:<identity>:<q>` by one script call per batch instead of one LREM round
//! trip per job, so a slot is free again as soon as its job is done. At shutdown the acker is
//! drained before the working lists are, so a finished job is never pushed back.

use redis::Script;
use std::sync::LazyLock;
use tokio::sync::mpsc;

static ACK: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("../lua/ack.lua")));
/// Most acks in one script call.
const MAX_BATCH: usize = 512;

type Ack = (String, Vec<u8>);

pub struct Acker {
    tx: std::sync::Mutex<Option<mpsc::UnboundedSender<Ack>>>,
    task: tokio::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Acker {
    pub fn start(conn: crate::redis_conn::Conn) -> Acker {
        let (tx, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(run(conn, rx));
        Acker {
            tx: std::sync::Mutex::new(Some(tx)),
            task: tokio::sync::Mutex::new(Some(task)),
        }
    }

    /// Queue the ack of one job (working list key, exact payload).
    pub fn ack(&self, working_key: String, raw: Vec<u8>) {
        if let Some(tx) = self.tx.lock().unwrap().as_ref() {
            let _ = tx.send((working_key, raw));
        }
    }

    /// Stop taking acks and wait until every queued one was sent.
    pub async fn flush_and_stop(&self) {
        self.tx.lock().unwrap().take();
        if let Some(t) = self.task.lock().await.take() {
            let _ = t.await;
        }
    }
}

async fn run(mut conn: crate::redis_conn::Conn, mut rx: mpsc::UnboundedReceiver<Ack>) {
    let mut batch: Vec<Ack> = Vec::with_capacity(MAX_BATCH);
    while rx.recv_many(&mut batch, MAX_BATCH).await > 0 {
        let mut inv = ACK.prepare_invoke();
        for (key, raw) in &batch {
            inv.key(key).arg(raw);
        }
        if let Err(e) = inv.invoke_async::<i64>(&mut conn).await {
            // The jobs stay in the working list; the orphan sweep runs them again after this
            // process is gone (at-least-once), so log rather than retry forever.
            tracing::error!(error = %e, jobs = batch.len(), "could not acknowledge finished jobs");
        }
        batch.clear();
    }
}

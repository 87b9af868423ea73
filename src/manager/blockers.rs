//! The idle waits: each blocking pop (BLMOVE or BRPOP, see `fetch/`) runs on a connection
//! of its own, one command at a time, and is never dropped mid-flight while its server is in
//! use: to stop waiting we send `CLIENT UNBLOCK <id>` from the shared connection, so a pop that
//! already happened is always delivered and handled (a pop on a server left in a failover is
//! abandoned, see `pop`). A blocker pops only when armed, so it never takes more work than the
//! fetch loop asked for. Keys: those of the pops (`queue:<q>`, our working lists).

use crate::fetch::unit_of_work::UnitOfWork;
use crate::fetch::Wait;
use crate::worker::Worker;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, Notify};
use tokio::task::JoinSet;

/// Server-side timeout of a blocking pop (Sidekiq's fetch.rb TIMEOUT).
pub const BLOCK_TIMEOUT_SECS: f64 = 2.0;
/// Pause after a Redis error in the fetch path, as Sidekiq does.
pub const ERROR_PAUSE: Duration = Duration::from_secs(1);

/// What a blocker hands the fetch loop: which blocker, what it popped, and whether it hit an
/// error (with reliable fetch an error may hide a job moved into our working list).
pub struct Delivery {
    pub from: usize,
    pub job: Option<UnitOfWork>,
    pub failed: bool,
}

/// The fetch loop's handle on one blocking pop task.
pub struct Blocker {
    arm: Arc<Notify>,
    client_id: Arc<AtomicI64>,
    /// Armed and not yet taken back by the loop: arming it again would take a second job.
    armed: Arc<AtomicBool>,
}

impl Blocker {
    /// Arm it unless it is already waiting; returns whether it was armed now.
    pub fn arm(&self) -> bool {
        let was = self.armed.swap(true, Ordering::SeqCst);
        if !was {
            self.arm.notify_one();
        }
        !was
    }

    pub fn is_armed(&self) -> bool {
        self.armed.load(Ordering::SeqCst)
    }

    /// The loop has its delivery in hand. The loop, not the blocker, marks it free again, so a
    /// delivery in flight is never mistaken for a free blocker (no over-fetch).
    pub fn disarm(&self) {
        self.armed.store(false, Ordering::SeqCst);
    }
}

/// A dedicated connection for one blocker, its client id noted for `CLIENT UNBLOCK`, with the
/// generation of the server it reaches (`connections/follow.rs`).
async fn connect(
    worker: &Worker,
    client_id: &AtomicI64,
) -> redis::RedisResult<(u64, redis::aio::MultiplexedConnection)> {
    let (generation, mut c) = worker.conn.dedicated().await?;
    let id: i64 = redis::cmd("CLIENT")
        .arg("ID")
        .query_async(&mut c)
        .await
        .unwrap_or(-1);
    client_id.store(id, Ordering::SeqCst);
    Ok((generation, c))
}

/// Start blocker `index`, waiting on `wait` each time it is armed.
pub fn spawn(
    index: usize,
    worker: Arc<Worker>,
    wait: Wait,
    tx: mpsc::UnboundedSender<Delivery>,
    set: &mut JoinSet<()>,
) -> Blocker {
    let b = Blocker {
        arm: Arc::new(Notify::new()),
        client_id: Arc::new(AtomicI64::new(-1)),
        armed: Arc::new(AtomicBool::new(false)),
    };
    let (arm, client_id) = (b.arm.clone(), b.client_id.clone());
    let task = async move {
        // The connection, and the generation of the server it reaches (`connections/follow.rs`).
        let mut conn: Option<(u64, redis::aio::MultiplexedConnection)> = None;
        let send = |job, failed| {
            let _ = tx.send(Delivery {
                from: index,
                job,
                failed,
            });
        };
        loop {
            tokio::select! {
                _ = arm.notified() => {}
                _ = worker.shutdown.quieted() => return,
            }
            if worker.shutdown.is_quiet() {
                return;
            }
            if conn.is_none() {
                match connect(&worker, &client_id).await {
                    Ok(c) => conn = Some(c),
                    Err(e) => {
                        tracing::warn!(error = %e, "fetch: cannot connect to Redis; retrying in 1s");
                        tokio::time::sleep(ERROR_PAUSE).await;
                        send(None, true);
                        continue;
                    }
                }
            }
            let (generation, c) = conn.as_mut().expect("connected above");
            let generation = *generation;
            if worker
                .fetch
                .wait_skipped(&wait, &worker.config.queues.order())
            {
                // A key of the wrong type would answer WRONGTYPE at once, every time: idle
                // for as long as a pop would have waited (the heartbeat sees it fixed).
                tokio::time::sleep(Duration::from_secs_f64(BLOCK_TIMEOUT_SECS)).await;
                send(None, false);
                continue;
            }
            match pop(&worker, &wait, generation, c).await {
                Ok(job) => send(job, false),
                // The server was left (a failover): the next connection waits for the new
                // primary itself, so no pause is added to the switch.
                Err(e) if worker.conn.generation() != generation => {
                    tracing::warn!(error = %e, "fetch: the server was left; reconnecting");
                    conn = None;
                    client_id.store(-1, Ordering::SeqCst);
                    send(None, true);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "fetch: Redis error; retrying in 1s");
                    conn = None;
                    client_id.store(-1, Ordering::SeqCst);
                    tokio::time::sleep(ERROR_PAUSE).await;
                    send(None, true);
                }
            }
        }
    };
    set.spawn(tracing::Instrument::instrument(
        task,
        crate::logging::root().clone(),
    ));
    b
}

/// One blocking pop on `c`, a connection to the server of `generation`. A server left (a
/// failover) is left by the pop too: it is abandoned, as what it pops there may never reach
/// the new primary; the error makes the caller report a failed delivery, so the fetch loop
/// looks in our working list for a job it may have moved.
async fn pop(
    worker: &Worker,
    wait: &Wait,
    generation: u64,
    c: &mut redis::aio::MultiplexedConnection,
) -> redis::RedisResult<Option<UnitOfWork>> {
    let epoch = worker.liveness.epoch();
    let order = worker.config.queues.order();
    let cmd = worker.fetch.wait_cmd(wait, &order, BLOCK_TIMEOUT_SECS);
    tokio::select! {
        r = cmd.query_async::<redis::Value>(c) => match r {
            Ok(v) => worker.fetch.delivered(wait, v, epoch),
            Err(e) => Err(worker.conn.suspect(generation, e)),
        },
        _ = worker.conn.left(generation) => Err(redis::RedisError::from((
            redis::ErrorKind::Io,
            "the server was left (failover); pop abandoned",
        ))),
    }
}

/// Ask Redis to end the blocked pops now (they return nil, or the job they already moved).
pub async fn unblock(worker: &Worker, blockers: &[Blocker]) {
    let mut conn = worker.conn.clone();
    for b in blockers {
        let id = b.client_id.load(Ordering::SeqCst);
        if id >= 0 {
            let _: redis::RedisResult<i64> = redis::cmd("CLIENT")
                .arg("UNBLOCK")
                .arg(id)
                .query_async(&mut conn)
                .await;
        }
    }
}

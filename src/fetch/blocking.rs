//! The idle waits: each blocking pop (BLMOVE or BRPOP, see `fetch/`) runs on a connection
//! of its own, one command at a time, and is never dropped mid-flight while its server is in
//! use: to stop waiting we send `CLIENT UNBLOCK <id>` from the shared connection, so a pop that
//! already happened is always delivered and handled (a pop on a server left in a failover is
//! abandoned, see `pop`). A blocker pops only when armed, so it never takes more work than the
//! fetch loop asked for. How many are armed, what each waits on and what its reply holds is
//! the strategy's business (`mod.rs`); the fetch loop (`manager/`) only asks for a job.
//! Keys: those of the pops (`queue:<q>`, our working lists).

use super::basic::BasicFetch;
use super::strategy::{FetchStrategy, Mode};
use crate::connections::redis_conn::Conn;
use crate::fetch::unit_of_work::UnitOfWork;
use crate::job::queues::QueueOrder;
use crate::process::shutdown::Shutdown;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, Notify};
use tokio::task::JoinSet;

/// Server-side timeout of a blocking pop (Sidekiq's fetch.rb TIMEOUT).
pub const BLOCK_TIMEOUT_SECS: f64 = 2.0;
/// Pause after a Redis error in the fetch path, as Sidekiq does.
pub const ERROR_PAUSE: Duration = Duration::from_secs(1);
/// Basic fetch runs one BRPOP per slot, as Sidekiq runs one per thread, up to this many.
const MAX_BRPOP_CONNECTIONS: usize = 64;
/// How long quiet waits for blocked pops to come back: past their reply deadline, so a pop
/// that already happened is never abandoned while its reply is still on the way.
const BLOCKERS_GRACE: Duration =
    Duration::from_secs(crate::connections::redis_conn::BLOCKING_RESPONSE_TIMEOUT.as_secs() + 1);

/// What a blocking pop waits on.
enum Wait {
    /// Every queue in this fetch's order (basic fetch: BRPOP).
    AllQueues,
    /// One queue, into its working list (reliable fetch: BLMOVE).
    Queue(String),
}

/// What the strategy says of its blocking pops (private to fetch/: the fetch loop only sees
/// [`Blockers`]).
impl FetchStrategy {
    /// Whether a blocking pop has nothing it may wait on now (its queue, or every queue, is
    /// skipped for its type): the blocker then idles for a round instead.
    fn wait_skipped(&self, wait: &Wait, order: &[&str]) -> bool {
        match wait {
            Wait::Queue(q) => self.state.is_broken(q),
            Wait::AllQueues => self.usable(order).is_empty(),
        }
    }

    /// The blocking pops an idle process keeps: one BLMOVE per queue (reliable), or one BRPOP
    /// per slot up to `max` (basic, as Sidekiq runs one per thread).
    fn waits(&self, queues: &[String], slots: usize, max: usize) -> Vec<Wait> {
        match self.mode {
            Mode::Reliable(_) => queues.iter().cloned().map(Wait::Queue).collect(),
            Mode::Basic(_) => (0..slots.min(max)).map(|_| Wait::AllQueues).collect(),
        }
    }

    /// How many blocking pops to have armed. Reliable: all (one per queue). Basic: one per
    /// free slot, but only one once a round timed out (queues idle), so an idle process costs
    /// 0.5 commands/s, not 0.5 x -c.
    fn waits_to_arm(&self, all: usize, free: usize, idle: bool) -> usize {
        match self.mode {
            Mode::Reliable(_) => all,
            Mode::Basic(_) if idle => 1,
            Mode::Basic(_) => free,
        }
    }

    /// Whether one delivery should end the other armed pops: a reliable process waits on
    /// every queue for one job, so the others stop (whatever they moved is delivered too);
    /// basic BRPOPs each wait for a slot of their own.
    fn one_delivery_ends_waits(&self) -> bool {
        matches!(self.mode, Mode::Reliable(_))
    }

    /// The command for one blocking pop.
    fn wait_cmd(&self, wait: &Wait, order: &[&str], timeout_secs: f64) -> redis::Cmd {
        match (&self.mode, wait) {
            (Mode::Reliable(r), Wait::Queue(q)) => r.blocking_move(q, timeout_secs),
            _ => BasicFetch::blocking_pop(&self.usable(order), timeout_secs),
        }
    }

    /// The job a blocking pop's reply holds, if any.
    fn delivered(
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
}

/// What the blocking pops share: the strategy, the connection they open theirs from, the
/// shutdown state that ends them, the queues in their fetch order.
struct Ctx {
    fetch: Arc<FetchStrategy>,
    conn: Conn,
    shutdown: Shutdown,
    queues: QueueOrder,
}

/// What a blocker hands the fetch loop: which blocker, what it popped, and whether it hit an
/// error (with reliable fetch an error may hide a job moved into our working list).
pub struct Delivery {
    from: usize,
    pub job: Option<UnitOfWork>,
    pub failed: bool,
}

/// The fetch loop's handle on one blocking pop task.
struct Blocker {
    arm: Arc<Notify>,
    client_id: Arc<AtomicI64>,
    /// Armed and not yet taken back by the loop: arming it again would take a second job.
    armed: Arc<AtomicBool>,
}

impl Blocker {
    /// Arm it unless it is already waiting; returns whether it was armed now.
    fn arm(&self) -> bool {
        let was = self.armed.swap(true, Ordering::SeqCst);
        if !was {
            self.arm.notify_one();
        }
        !was
    }

    fn is_armed(&self) -> bool {
        self.armed.load(Ordering::SeqCst)
    }

    /// The loop has its delivery in hand. The loop, not the blocker, marks it free again, so a
    /// delivery in flight is never mistaken for a free blocker (no over-fetch).
    fn disarm(&self) {
        self.armed.store(false, Ordering::SeqCst);
    }
}

/// A dedicated connection for one blocker, its client id noted for `CLIENT UNBLOCK`, with the
/// generation of the server it reaches (`connections/follow.rs`).
async fn connect(
    ctx: &Ctx,
    client_id: &AtomicI64,
) -> redis::RedisResult<(u64, redis::aio::MultiplexedConnection)> {
    let (generation, mut c) = ctx.conn.dedicated().await?;
    let id: i64 = redis::cmd("CLIENT")
        .arg("ID")
        .query_async(&mut c)
        .await
        .unwrap_or(-1);
    client_id.store(id, Ordering::SeqCst);
    Ok((generation, c))
}

/// Start blocker `index`, waiting on `wait` each time it is armed.
fn spawn(
    index: usize,
    ctx: Arc<Ctx>,
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
                _ = ctx.shutdown.quieted() => return,
            }
            if ctx.shutdown.is_quiet() {
                return;
            }
            if conn.is_none() {
                match connect(&ctx, &client_id).await {
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
            if ctx.fetch.wait_skipped(&wait, &ctx.queues.order()) {
                // A key of the wrong type would answer WRONGTYPE at once, every time: idle
                // for as long as a pop would have waited (the heartbeat sees it fixed).
                tokio::time::sleep(Duration::from_secs_f64(BLOCK_TIMEOUT_SECS)).await;
                send(None, false);
                continue;
            }
            match pop(&ctx, &wait, generation, c).await {
                Ok(job) => send(job, false),
                // The server was left (a failover): the next connection waits for the new
                // primary itself, so no pause is added to the switch.
                Err(e) if ctx.conn.generation() != generation => {
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
    ctx: &Ctx,
    wait: &Wait,
    generation: u64,
    c: &mut redis::aio::MultiplexedConnection,
) -> redis::RedisResult<Option<UnitOfWork>> {
    let epoch = ctx.fetch.liveness.epoch();
    let order = ctx.queues.order();
    let cmd = ctx.fetch.wait_cmd(wait, &order, BLOCK_TIMEOUT_SECS);
    tokio::select! {
        r = cmd.query_async::<redis::Value>(c) => match r {
            Ok(v) => ctx.fetch.delivered(wait, v, epoch),
            Err(e) => Err(ctx.conn.suspect(generation, e)),
        },
        _ = ctx.conn.left(generation) => Err(redis::RedisError::from((
            redis::ErrorKind::Io,
            "the server was left (failover); pop abandoned",
        ))),
    }
}

/// Ask Redis to end the blocked pops now (they return nil, or the job they already moved).
async fn unblock(ctx: &Ctx, blockers: &[Blocker]) {
    let mut conn = ctx.conn.clone();
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

/// The blocking pops an idle process keeps, and the deliveries they send the fetch loop.
pub struct Blockers {
    ctx: Arc<Ctx>,
    list: Vec<Blocker>,
    deliveries: mpsc::UnboundedReceiver<Delivery>,
    tasks: JoinSet<()>,
}

impl Blockers {
    /// Start the pops the strategy keeps for `queues` and `slots` (none armed yet).
    pub fn start(
        fetch: Arc<FetchStrategy>,
        conn: Conn,
        shutdown: Shutdown,
        (queues, slots): (QueueOrder, usize),
    ) -> Blockers {
        let (tx, deliveries) = mpsc::unbounded_channel::<Delivery>();
        let mut tasks = JoinSet::new();
        let waits = fetch.waits(&queues.names(), slots, MAX_BRPOP_CONNECTIONS);
        let ctx = Arc::new(Ctx {
            fetch,
            conn,
            shutdown,
            queues,
        });
        let list = waits
            .into_iter()
            .enumerate()
            .map(|(i, w)| spawn(i, ctx.clone(), w, tx.clone(), &mut tasks))
            .collect();
        Blockers {
            ctx,
            list,
            deliveries,
            tasks,
        }
    }

    /// Whether a pop is armed and its delivery not yet taken.
    pub fn any_armed(&self) -> bool {
        self.list.iter().any(Blocker::is_armed)
    }

    /// Take a delivery in hand: its blocker is free again.
    fn take(&self, d: Delivery) -> Delivery {
        self.list[d.from].disarm();
        d
    }

    /// A delivery already sent, if any, taken in hand.
    pub fn ready(&mut self) -> Option<Delivery> {
        let d = self.deliveries.try_recv().ok()?;
        Some(self.take(d))
    }

    /// Arm the pops for `free` slots (`idle`: the last round timed out) and wait for one
    /// delivery; None once quiet.
    pub async fn wait(&mut self, free: usize, idle: bool) -> Option<Delivery> {
        let ctx = self.ctx.clone();
        let want = ctx.fetch.waits_to_arm(self.list.len(), free, idle);
        let mut armed = self.list.iter().filter(|b| b.is_armed()).count();
        for b in &self.list {
            if armed >= want {
                break;
            }
            if b.arm() {
                armed += 1;
            }
        }
        tokio::select! {
            d = self.deliveries.recv() => {
                let d = self.take(d?);
                if d.job.is_some() && ctx.fetch.one_delivery_ends_waits() && self.list.len() > 1 {
                    unblock(&ctx, &self.list).await;
                }
                Some(d)
            }
            _ = ctx.shutdown.quieted() => None,
        }
    }

    /// Quiet: end the blocked pops and return what they delivered last.
    pub async fn stop(&mut self) -> Vec<Delivery> {
        unblock(&self.ctx, &self.list).await;
        // A blocked pop returns within its 2 s server timeout, at once after UNBLOCK. Only an
        // unreachable Redis keeps one longer; then stop waiting (reliable fetch: a job it may
        // still move stays in our working list, which the orphan sweep returns once we are gone).
        let tasks = &mut self.tasks;
        let wait_all = async { while tasks.join_next().await.is_some() {} };
        if tokio::time::timeout(BLOCKERS_GRACE, wait_all)
            .await
            .is_err()
        {
            tracing::warn!(
                "fetch: a blocking pop did not return (Redis unreachable?); not waiting for it"
            );
            self.tasks.abort_all();
        }
        std::iter::from_fn(|| self.ready()).collect()
    }
}

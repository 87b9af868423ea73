//! Fetching: Sidekiq's strict / weighted queue order, then either reliable fetch (a Lua script
//! moves up to N jobs from `queue:<q>` into `playguard:working:<identity>:<q>`, and idle waits
//! use BLMOVE into the same lists) or basic fetch (RPOP with a count for the free slots while
//! the queues are busy, BRPOP when they are empty, as Sidekiq OSS).
//!
//! Blocking commands run on connections of their own, one command at a time, and are never
//! dropped mid-flight: to stop waiting we send `CLIENT UNBLOCK <id>` from the shared
//! connection, so a pop that already happened is always delivered and handled.

use crate::processor;
use crate::runtime::{Fetched, Runtime};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, Notify, Semaphore};
use tokio::task::JoinSet;

/// Server-side timeout of a blocking pop (Sidekiq's fetch.rb TIMEOUT).
pub const BLOCK_TIMEOUT_SECS: f64 = 2.0;
/// Pause after a Redis error in the fetch path, as Sidekiq does.
const ERROR_PAUSE: Duration = Duration::from_secs(1);
/// How long quiet waits for blocked pops to come back: past their reply deadline, so a pop
/// that already happened is never abandoned while its reply is still on the way.
const BLOCKERS_GRACE: Duration =
    Duration::from_secs(crate::redis_conn::BLOCKING_RESPONSE_TIMEOUT.as_secs() + 1);
/// Most jobs one fetch script moves.
const MAX_BATCH: usize = 256;
/// Most queues one reliable-fetch script call looks at (see `fetch_batch`).
const FETCH_QUEUES_PER_CALL: usize = 8;

static FETCH: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("../lua/fetch.lua")));

/// What a blocker hands the fetch loop: which blocker, what it popped, and whether it hit an
/// error (with reliable fetch an error may hide a job moved into our working list).
struct Delivery {
    from: usize,
    job: Option<Fetched>,
    failed: bool,
}

/// One blocking pop loop on its own connection. It pops only when armed, so it never takes
/// more work than the fetch loop asked for.
struct Blocker {
    arm: Arc<Notify>,
    client_id: Arc<std::sync::atomic::AtomicI64>,
    /// Armed and not yet delivered: arming it again would take a second job.
    busy: Arc<std::sync::atomic::AtomicBool>,
}

impl Blocker {
    /// Arm it unless it is already waiting; returns whether it was armed now.
    fn arm(&self) -> bool {
        let was = self.busy.swap(true, std::sync::atomic::Ordering::SeqCst);
        if !was {
            self.arm.notify_one();
        }
        !was
    }
}

/// Basic fetch runs one BRPOP per slot, as Sidekiq runs one per thread, up to this many.
const MAX_BRPOP_CONNECTIONS: usize = 64;

enum BlockCmd {
    /// BRPOP over all queues in order (basic fetch).
    Brpop,
    /// BLMOVE one queue into its working list (reliable fetch).
    Blmove(String),
}

fn spawn_blocker(
    index: usize,
    rt: Arc<Runtime>,
    what: BlockCmd,
    tx: mpsc::UnboundedSender<Delivery>,
    set: &mut JoinSet<()>,
) -> Blocker {
    let arm = Arc::new(Notify::new());
    let client_id = Arc::new(std::sync::atomic::AtomicI64::new(-1));
    let busy = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let b = Blocker {
        arm: arm.clone(),
        client_id: client_id.clone(),
        busy,
    };
    set.spawn(tracing::Instrument::instrument(async move {
        let mut conn: Option<redis::aio::MultiplexedConnection> = None;
        loop {
            tokio::select! {
                _ = arm.notified() => {}
                _ = rt.shutdown.quieted() => return,
            }
            if rt.shutdown.is_quiet() {
                return;
            }
            if conn.is_none() {
                match crate::redis_conn::dedicated(&rt.client).await {
                    Ok(mut c) => {
                        let id: i64 = redis::cmd("CLIENT").arg("ID").query_async(&mut c).await.unwrap_or(-1);
                        client_id.store(id, std::sync::atomic::Ordering::SeqCst);
                        conn = Some(c);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "fetch: cannot connect to Redis; retrying in 1s");
                        tokio::time::sleep(ERROR_PAUSE).await;
                        let _ = tx.send(Delivery { from: index, job: None, failed: true });
                        continue;
                    }
                }
            }
            let c = conn.as_mut().expect("connected above");
            let epoch = rt.liveness.epoch();
            let res: redis::RedisResult<Option<Fetched>> = match &what {
                BlockCmd::Brpop => {
                    let keys: Vec<String> = rt
                        .config
                        .queues
                        .order()
                        .iter()
                        .map(|q| format!("queue:{q}"))
                        .collect();
                    redis::cmd("BRPOP")
                        .arg(&keys)
                        .arg(BLOCK_TIMEOUT_SECS)
                        .query_async::<Option<(String, Vec<u8>)>>(c)
                        .await
                        .map(|r| {
                            r.map(|(k, raw)| Fetched {
                                queue: k.strip_prefix("queue:").unwrap_or(&k).to_string(),
                                raw,
                                epoch,
                            })
                        })
                }
                BlockCmd::Blmove(q) => redis::cmd("BLMOVE")
                    .arg(format!("queue:{q}"))
                    .arg(rt.working_key(q))
                    .arg("RIGHT")
                    .arg("LEFT")
                    .arg(BLOCK_TIMEOUT_SECS)
                    .query_async::<Option<Vec<u8>>>(c)
                    .await
                    .map(|r| r.map(|raw| Fetched { queue: q.clone(), raw, epoch })),
            };
            match res {
                Ok(d) => {
                    let _ = tx.send(Delivery { from: index, job: d, failed: false });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "fetch: Redis error; retrying in 1s");
                    conn = None;
                    client_id.store(-1, std::sync::atomic::Ordering::SeqCst);
                    tokio::time::sleep(ERROR_PAUSE).await;
                    let _ = tx.send(Delivery { from: index, job: None, failed: true });
                }
            }
        }
    }, crate::logging::root().clone()));
    b
}

/// Ask Redis to end the blocked pops now (they return nil, or the job they already moved).
async fn unblock(rt: &Runtime, blockers: &[Blocker]) {
    let mut conn = rt.conn.clone();
    for b in blockers {
        let id = b.client_id.load(std::sync::atomic::Ordering::SeqCst);
        if id >= 0 {
            let _: redis::RedisResult<i64> = redis::cmd("CLIENT")
                .arg("UNBLOCK")
                .arg(id)
                .query_async(&mut conn)
                .await;
        }
    }
}

/// Take up to `n` jobs for the free slots: reliable fetch moves them into our working lists in
/// one script call; basic fetch pops them with plain commands (`pop_batch`). Either way one
/// round trip per batch rather than one blocking pop per job while the queues are busy.
async fn fetch_batch(rt: &Runtime, n: usize) -> redis::RedisResult<Vec<Fetched>> {
    let order = rt.config.queues.order();
    let n = n.min(MAX_BATCH);
    if !rt.reliable() {
        return pop_batch(rt, &order, n).await;
    }
    let mut conn = rt.conn.clone();
    let mut out = Vec::new();
    let epoch = rt.liveness.epoch();
    // Queues in chunks, in order: every key of a call costs Redis a Lua string, so with 100
    // queues a batch the first few can fill should not pay for all 200 keys. A later chunk is
    // asked only for what the earlier ones lacked, which keeps the order strict.
    for chunk in order.chunks(FETCH_QUEUES_PER_CALL) {
        let want = n - out.len();
        if want == 0 {
            break;
        }
        let mut inv = FETCH.prepare_invoke();
        for q in chunk {
            inv.key(format!("queue:{q}"));
        }
        for q in chunk {
            inv.key(rt.working_key(q));
        }
        inv.key(crate::liveness::alive_key(&rt.identity));
        inv.arg(want);
        let flat: Vec<redis::Value> = inv.invoke_async(&mut conn).await?;
        out.reserve(flat.len() / 2);
        let mut it = flat.into_iter();
        while let (Some(idx), Some(job)) = (it.next(), it.next()) {
            let i: usize = redis::from_redis_value_ref(&idx)?;
            // The reply's own buffer becomes the job's bytes: no copy per job.
            let raw: Vec<u8> = match job {
                redis::Value::BulkString(b) => b,
                other => redis::from_redis_value_ref(&other)?,
            };
            out.push(Fetched {
                queue: chunk[i - 1].clone(),
                raw,
                epoch,
            });
        }
    }
    Ok(out)
}

/// Basic fetch: `RPOP queue:<q> <count>` in fetch order until `n` are taken, as BRPOP would
/// take them one by one (a popped job is only in memory, as in Sidekiq OSS). Plain commands,
/// not a script: a payload that passes through Lua costs Redis several times the instructions
/// (callgrind: 7.7k vs 1.3k per job). With several queues one pipeline of LLEN says which to
/// pop from, so the empty ones cost no round trip each.
async fn pop_batch(rt: &Runtime, order: &[String], n: usize) -> redis::RedisResult<Vec<Fetched>> {
    let mut conn = rt.conn.clone();
    let epoch = rt.liveness.epoch();
    let plan: Vec<(usize, usize)> = if order.len() == 1 {
        vec![(0, n)]
    } else {
        let mut p = redis::pipe();
        for q in order {
            p.cmd("LLEN").arg(format!("queue:{q}"));
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
        p.cmd("RPOP").arg(format!("queue:{}", order[*i])).arg(*take);
    }
    let popped: Vec<Option<Vec<Vec<u8>>>> = p.query_async(&mut conn).await?;
    for ((i, _), jobs) in plan.iter().zip(popped) {
        for raw in jobs.into_iter().flatten() {
            out.push(Fetched {
                queue: order[*i].clone(),
                raw,
                epoch,
            });
        }
    }
    Ok(out)
}

/// The fetch loop: runs until quiet/stop, starting one processor task per job, never more
/// than `concurrency` at once. Jobs that arrive after quiet are pushed straight back.
pub async fn run(rt: Arc<Runtime>, sem: Arc<Semaphore>) {
    let (tx, mut rx) = mpsc::unbounded_channel::<Delivery>();
    let mut blocker_tasks = JoinSet::new();
    let blockers: Vec<Blocker> = if rt.reliable() {
        rt.config
            .queues
            .names()
            .into_iter()
            .enumerate()
            .map(|(i, q)| {
                spawn_blocker(
                    i,
                    rt.clone(),
                    BlockCmd::Blmove(q),
                    tx.clone(),
                    &mut blocker_tasks,
                )
            })
            .collect()
    } else {
        (0..rt.config.concurrency.min(MAX_BRPOP_CONNECTIONS))
            .map(|i| {
                spawn_blocker(
                    i,
                    rt.clone(),
                    BlockCmd::Brpop,
                    tx.clone(),
                    &mut blocker_tasks,
                )
            })
            .collect()
    };
    drop(tx);
    let mut pending: Vec<Fetched> = Vec::new();
    let mut idle = false;
    // Set when a fetch failed in a way that may have moved a job into our working list
    // without telling us; cleared by a rescue once we are fully idle.
    let mut suspect = false;
    // The loop, not the blocker, marks a blocker free again once its delivery is in hand,
    // so a delivery in flight is never mistaken for a free blocker (no over-fetch).
    let take = |d: Delivery, pending: &mut Vec<Fetched>, suspect: &mut bool| {
        blockers[d.from]
            .busy
            .store(false, std::sync::atomic::Ordering::SeqCst);
        *suspect |= d.failed;
        pending.extend(d.job);
    };
    'outer: loop {
        // Start whatever we hold, as slots allow.
        while let Some(f) = pending.pop() {
            // Biased: once quiet, a job not yet started goes back, never into a free slot.
            let permit = tokio::select! {
                biased;
                _ = rt.shutdown.quieted() => { pending.push(f); break 'outer; }
                p = sem.clone().acquire_owned() => p.expect("semaphore never closed"),
            };
            let rt2 = rt.clone();
            tokio::spawn(async move {
                processor::process(&rt2, f).await;
                drop(permit);
            });
        }
        // Wait for a free slot before taking more work.
        let free = tokio::select! {
            biased;
            _ = rt.shutdown.quieted() => break,
            p = sem.clone().acquire_owned() => { drop(p); sem.available_permits() }
        };
        while let Ok(d) = rx.try_recv() {
            take(d, &mut pending, &mut suspect);
        }
        if !pending.is_empty() {
            idle = false;
            continue;
        }
        // A process whose liveness lease lapsed takes no work until a heartbeat lands again.
        if !rt.liveness.is_live() {
            tracing::warn!("liveness lease lapsed: not fetching until a heartbeat lands");
            tokio::select! {
                _ = rt.liveness.live() => continue,
                _ = rt.shutdown.quieted() => break,
            }
        }
        // Queues busy: take what the free slots can run in one script call. Only when that
        // finds nothing do we block (below).
        match fetch_batch(&rt, free).await {
            Ok(v) if !v.is_empty() => {
                rt.metrics.fetch_batch(v.len());
                idle = false;
                pending = v;
                pending.reverse(); // popped from the end: keep fetch order
                continue;
            }
            Ok(_) => {}
            Err(e) => {
                // Reliable: the script may have run even though its reply was lost.
                suspect |= rt.reliable();
                tracing::warn!(error = %e, "fetch: Redis error; retrying in 1s");
                tokio::select! {
                    _ = tokio::time::sleep(ERROR_PAUSE) => continue,
                    _ = rt.shutdown.quieted() => break,
                }
            }
        }
        // Fully idle after a fetch error: anything in our working lists now is a job a lost
        // reply moved there. Nothing runs, no ack waits, no pop is in flight, and only this
        // loop adds to the lists, so push them all back to their queues.
        if suspect
            && sem.available_permits() == rt.config.concurrency
            && rt.acker.pending() == 0
            && blockers
                .iter()
                .all(|b| !b.busy.load(std::sync::atomic::Ordering::SeqCst))
        {
            match crate::sweeper::drain_own(&rt).await {
                Ok(n) => {
                    if n > 0 {
                        tracing::warn!(
                            jobs = n,
                            "returned jobs a failed fetch had moved into our working list"
                        );
                    }
                    suspect = false;
                    continue;
                }
                Err(e) => tracing::warn!(error = %e, "fetch: could not check our working lists"),
            }
        }
        // Nothing ready: block until something arrives (or quiet). Reliable: one BLMOVE per
        // queue. Basic: one BRPOP per free slot.
        // After a round that timed out (queues idle), basic fetch keeps one BRPOP waiting
        // rather than one per slot, so an idle process costs 0.5 commands/s, not 0.5 x -c.
        let want = if rt.reliable() {
            blockers.len()
        } else if idle {
            1
        } else {
            free
        };
        let mut armed = blockers
            .iter()
            .filter(|b| b.busy.load(std::sync::atomic::Ordering::SeqCst))
            .count();
        for b in &blockers {
            if armed >= want {
                break;
            }
            if b.arm() {
                armed += 1;
            }
        }
        tokio::select! {
            d = rx.recv() => match d {
                Some(d) if d.job.is_some() => {
                    idle = false;
                    take(d, &mut pending, &mut suspect);
                    // Reliable: stop the other queues' waiters; whatever they already moved is
                    // delivered too. (Basic BRPOPs each wait for a slot of their own.)
                    if rt.reliable() && blockers.len() > 1 {
                        unblock(&rt, &blockers).await;
                    }
                }
                Some(d) => {
                    idle = true;
                    take(d, &mut pending, &mut suspect);
                }
                None => break,
            },
            _ = rt.shutdown.quieted() => break,
        }
    }
    // Quiet: end the blocked pops and hand back everything fetched but not started.
    unblock(&rt, &blockers).await;
    // A blocked pop returns within its 2 s server timeout, at once after UNBLOCK. Only an
    // unreachable Redis keeps one longer; then stop waiting (reliable fetch: a job it may
    // still move stays in our working list, which the orphan sweep returns once we are gone).
    let wait_all = async { while blocker_tasks.join_next().await.is_some() {} };
    if tokio::time::timeout(BLOCKERS_GRACE, wait_all)
        .await
        .is_err()
    {
        tracing::warn!(
            "fetch: a blocking pop did not return (Redis unreachable?); not waiting for it"
        );
        blocker_tasks.abort_all();
    }
    while let Ok(d) = rx.try_recv() {
        take(d, &mut pending, &mut suspect);
    }
    for f in pending {
        rt.requeue_logged(&f).await;
    }
}

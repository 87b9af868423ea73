//! Fetching: the loop that keeps every free slot fed, in Sidekiq's strict / weighted queue
//! order (`job/queues.rs`). While the queues are busy it takes a batch for the free slots in one
//! round trip; when they are empty it arms the blocking pops (`fetch/blocking.rs`) and waits. How a
//! job is taken, acknowledged, requeued and drained is the fetch strategy's business
//! (`fetch/`: reliable or basic); this loop never asks which one runs.
//! Keys: those of the strategy.

pub mod processor;

use crate::fetch::blocking::{Blockers, Delivery, ERROR_PAUSE};
use crate::fetch::rescue::Rescue;
use crate::fetch::unit_of_work::UnitOfWork;
use crate::worker::Worker;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
/// Most jobs one batch takes.
const MAX_BATCH: usize = 256;
/// Jobs are short while their recent mean run time is under this; only then does the loop
/// fetch the next batch while the current one runs (see `Pace`).
const SHORT_JOB_MICROS: u64 = 2_000;
/// Jobs are cheap while their recent mean run time is under this: only then does the loop run
/// them itself (`run_or_spawn`). Over it, a task each costs little beside the job, and lets a
/// handler that burns CPU run on every core instead of one job after another on the loop's
/// thread. A no-op job's whole run takes a few microseconds. The hidden
/// `PLAYGUARD_INLINE_JOB_MICROS` scales it for a worker that runs slower as a whole: under
/// callgrind (`bench/profile.sh`) every job takes about 100 times as long.
const INLINE_JOB_MICROS: u64 = 50;

fn inline_job_micros() -> u64 {
    static MICROS: std::sync::LazyLock<u64> = std::sync::LazyLock::new(|| {
        std::env::var("PLAYGUARD_INLINE_JOB_MICROS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(INLINE_JOB_MICROS)
    });
    *MICROS
}

/// The recent mean run time of this process's jobs (an exponential average over about the
/// last 16), starting at one second: a process assumes long jobs until it has seen short ones.
struct Pace(std::sync::atomic::AtomicU64);

impl Default for Pace {
    fn default() -> Pace {
        Pace(std::sync::atomic::AtomicU64::new(1_000_000))
    }
}

impl Pace {
    fn record(&self, took: Duration) {
        use std::sync::atomic::Ordering::Relaxed;
        let x = took.as_micros().min(u64::MAX as u128) as u64;
        let old = self.0.load(Relaxed);
        // A lost update under a race only skews the average a little.
        self.0.store(old - old / 16 + x / 16, Relaxed);
    }

    fn short(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Relaxed) < SHORT_JOB_MICROS
    }

    fn cheap(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Relaxed) < inline_job_micros()
    }
}

/// How many jobs a process may hold fetched beyond its slots, while jobs are short: one more
/// batch of `concurrency`. A fetched job waits for a slot in our working list (reliable) or in
/// memory (basic), so with long jobs (a reconcile cycle) nothing is fetched ahead: another
/// process with a free slot must get it.
fn fetch_ahead(concurrency: usize) -> usize {
    concurrency
}

/// While recent jobs are cheap (`inline`), run a job's future here as far as it goes without
/// waiting, and give it a task of its own only if it waits. Most such jobs end at their first
/// poll (a Rust handler with nothing to await), and a task per job (its allocation, its
/// scheduling, the other thread woken to steal it) cost more than such a job itself. One that
/// waits is spawned: tokio polls it again with its own waker, so the wake this poll registered
/// for the loop is only a spurious one. A panic is contained as a task's would be: the future
/// is dropped and the loop goes on (with reliable fetch the job stays in our working list,
/// drained back to its queue at our stop). Jobs that are not cheap are spawned at once, so
/// their CPU work spreads over tokio's threads. Runs under the loop's root span; the job's own
/// context is its log scope (`logging/scope.rs`).
async fn run_or_spawn(
    mut run: std::pin::Pin<Box<impl std::future::Future<Output = ()> + Send + 'static>>,
    inline: bool,
) {
    use std::task::Poll;
    if !inline {
        spawn_run(run);
        return;
    }
    let first = std::future::poll_fn(|cx| {
        Poll::Ready(std::panic::catch_unwind(std::panic::AssertUnwindSafe(
            || run.as_mut().poll(cx),
        )))
    })
    .await;
    match first {
        Ok(Poll::Ready(())) => {}
        // Under the root span, as this loop runs (a task does not inherit it).
        Ok(Poll::Pending) => spawn_run(run),
        Err(_) => tracing::error!(
            "a job's run panicked outside its handler: dropped (reliable fetch keeps the job in the working list until this process stops)"
        ),
    }
}

/// A job's run on a task of its own, under the root span as this loop runs (a task does not
/// inherit it). A panic ends only the task.
fn spawn_run(run: std::pin::Pin<Box<impl std::future::Future<Output = ()> + Send + 'static>>) {
    tokio::spawn(tracing::Instrument::instrument(
        run,
        crate::logging::root().clone(),
    ));
}

/// Quiet came while the loop held jobs it had not started.
struct Quieted;

/// The fetch loop's state between rounds.
struct FetchLoop {
    worker: Arc<Worker>,
    /// One per slot: a running job holds one.
    slots: Arc<Semaphore>,
    /// `concurrency + ahead`: a fetched job holds one from its fetch until it ends.
    credits: Arc<Semaphore>,
    ahead: usize,
    pace: Arc<Pace>,
    blockers: Blockers,
    /// Fetched, not yet started (last = next to start).
    held: Vec<UnitOfWork>,
    /// The last blocking round timed out: the queues are idle.
    idle: bool,
    /// Jobs a fetch whose reply was lost may have left in our working lists.
    rescue: Rescue,
}

impl FetchLoop {
    /// Take a delivery in hand (its blocker is free again).
    fn take(&mut self, d: Delivery) {
        self.rescue
            .delivered(&self.worker.fetch, d.job.is_some(), d.failed);
        self.held.extend(d.job);
    }

    fn take_ready(&mut self) {
        while let Some(d) = self.blockers.ready() {
            self.take(d);
        }
    }

    /// Hand whatever we hold to runner tasks, in order, each with a credit; a runner waits
    /// for a slot (tokio's semaphore is first come, first served, so fetch order is kept).
    /// Biased: once quiet, a job not yet handed over goes back; a runner still waiting for its
    /// slot at quiet hands its job back too, never starting it.
    async fn start_held(&mut self) -> Result<(), Quieted> {
        while let Some(job) = self.held.pop() {
            if self.worker.shutdown.is_quiet() {
                self.held.push(job);
                return Err(Quieted);
            }
            // A free credit is taken at once: waiting (and so watching for quiet) is only
            // for when there is none.
            let credit = match self.credits.clone().try_acquire_owned() {
                Ok(p) => p,
                Err(_) => tokio::select! {
                    biased;
                    _ = self.worker.shutdown.quieted() => { self.held.push(job); return Err(Quieted); }
                    p = self.credits.clone().acquire_owned() => p.expect("semaphore never closed"),
                },
            };
            let worker = self.worker.clone();
            let slots = self.slots.clone();
            let pace = self.pace.clone();
            // Boxed before its first poll: a run that waits is then moved into its task as a
            // pointer (a polled future cannot move otherwise).
            let run = Box::pin(async move {
                // Quiet already: hand the job back. Otherwise the slot first, so a free one
                // is taken without subscribing to the shutdown state; a runner still waiting
                // for its slot at quiet hands its job back, never starting it.
                let slot = if worker.shutdown.is_quiet() {
                    None
                } else if let Ok(p) = slots.clone().try_acquire_owned() {
                    Some(p)
                } else {
                    tokio::select! {
                        biased;
                        p = slots.acquire_owned() => Some(p.expect("semaphore never closed")),
                        _ = worker.shutdown.quieted() => None,
                    }
                };
                let Some(slot) = slot else {
                    Box::pin(worker.fetch.requeue_logged(&job)).await;
                    drop(credit);
                    return;
                };
                let started = std::time::Instant::now();
                processor::process(&worker, job, started).await;
                pace.record(started.elapsed());
                drop(slot);
                drop(credit);
            });
            run_or_spawn(run, self.pace.cheap()).await;
        }
        Ok(())
    }

    /// How many jobs the next fetch may take: the free credits, less the fetch-ahead ones while
    /// jobs are not short. Waits until that is at least one.
    async fn fetchable(&self) -> Result<usize, Quieted> {
        loop {
            let reserve = if self.pace.short() { 0 } else { self.ahead };
            let free = self.credits.available_permits().saturating_sub(reserve);
            if free > 0 {
                return Ok(free);
            }
            tokio::select! {
                biased;
                _ = self.worker.shutdown.quieted() => return Err(Quieted),
                p = self.credits.acquire_many(reserve as u32 + 1) => drop(p),
            }
        }
    }

    /// Nothing ready: arm the blocking pops and wait for one delivery (or quiet).
    async fn wait_for_work(&mut self, free: usize) -> Result<(), Quieted> {
        let d = self.blockers.wait(free, self.idle).await.ok_or(Quieted)?;
        self.idle = d.job.is_none();
        self.take(d);
        Ok(())
    }

    /// One round: hand over what we hold, wait for a free credit, then take a batch or block.
    async fn round(&mut self) -> Result<(), Quieted> {
        self.start_held().await?;
        let worker = self.worker.clone();
        let free = self.fetchable().await?;
        self.take_ready();
        if !self.held.is_empty() {
            self.idle = false;
            return Ok(());
        }
        // A process whose liveness lease lapsed takes no work until a heartbeat lands again.
        if !worker.liveness.is_live() {
            tracing::warn!("liveness lease lapsed: not fetching until a heartbeat lands");
            return tokio::select! {
                _ = worker.liveness.live() => Ok(()),
                _ = worker.shutdown.quieted() => Err(Quieted),
            };
        }
        // Redis refuses writes for want of memory: a job fetched now could not record its
        // outcome, so fetching pauses (the heartbeat logged it and sees it end). Jobs a lost
        // fetch reply may have hidden in our working list go back before the next fetch.
        if worker.metrics.redis.is_oom()
            || (self.rescue.left_due()
                && !self.blockers.any_armed()
                && !self
                    .rescue
                    .lost(&worker.fetch, &worker.config.queues.names())
                    .await)
        {
            return tokio::select! {
                _ = tokio::time::sleep(ERROR_PAUSE) => Ok(()),
                _ = worker.shutdown.quieted() => Err(Quieted),
            };
        }
        // Queues busy: take what the free slots can run. Only when that finds nothing do we
        // block.
        let order = worker.config.queues.order();
        match worker
            .fetch
            .take(&order, free.min(MAX_BATCH), worker.liveness.epoch())
            .await
        {
            Ok(v) if !v.is_empty() => {
                self.rescue.fetched();
                worker.metrics.fetch_batch(v.len());
                self.idle = false;
                self.held = v;
                self.held.reverse(); // started from the end: keep fetch order
                return Ok(());
            }
            Ok(_) => {}
            Err(e) => {
                self.rescue.fetch_failed(&worker.fetch);
                tracing::warn!(error = %e, "fetch: Redis error; retrying in 1s");
                return tokio::select! {
                    _ = tokio::time::sleep(ERROR_PAUSE) => Ok(()),
                    _ = worker.shutdown.quieted() => Err(Quieted),
                };
            }
        }
        // Fully idle: nothing runs or waits for a slot, no pop is in flight.
        let idle = self.credits.available_permits() == worker.config.concurrency + self.ahead
            && !self.blockers.any_armed();
        if idle
            && self
                .rescue
                .if_idle(&worker.fetch, &worker.config.queues.names())
                .await
        {
            return Ok(());
        }
        self.wait_for_work(free).await
    }
}

/// The credits a process fetches against: its slots, plus one batch ahead where a fetched job
/// waits in our working list (reliable fetch). Basic fetch holds popped jobs only in memory,
/// so it fetches only for free slots, as Sidekiq's one BRPOP per thread does.
pub fn credits(worker: &Worker) -> usize {
    let c = worker.config.concurrency;
    c + if worker.liveness.is_kept() {
        fetch_ahead(c)
    } else {
        0
    }
}

/// The fetch loop: runs until quiet/stop, starting one processor task per job, never more
/// than `concurrency` at once (`slots`). Jobs fetched ahead wait in order for a slot; after
/// quiet, every job not started is pushed straight back. The launcher waits for all of
/// `credits` (every fetched job ended or handed back) before it drains.
pub async fn run(worker: Arc<Worker>, slots: Arc<Semaphore>, credits: Arc<Semaphore>) {
    let blockers = Blockers::start(
        worker.fetch.clone(),
        worker.conn.clone(),
        worker.shutdown.clone(),
        (worker.config.queues.clone(), worker.config.concurrency),
    );
    let mut lp = FetchLoop {
        worker: worker.clone(),
        ahead: credits.available_permits() - worker.config.concurrency,
        slots,
        credits,
        pace: Arc::new(Pace::default()),
        blockers,
        held: Vec::new(),
        idle: false,
        rescue: Rescue::default(),
    };
    while lp.round().await.is_ok() {}
    // Quiet: end the blocked pops and hand back everything fetched but not started.
    for d in lp.blockers.stop().await {
        lp.take(d);
    }
    for job in std::mem::take(&mut lp.held) {
        worker.fetch.requeue_logged(&job).await;
    }
}

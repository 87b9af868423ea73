//! The fetch loop's rounds: hand over what it holds, wait for a free credit, then take a
//! batch or arm the blocking pops (`fetch/blocking.rs`); after quiet, hand back what was
//! fetched and not started. Keys: those of the strategy (`fetch/`).

use super::{processor, run_or_spawn, Pace};
use crate::fetch::blocking::{Blockers, Delivery, ERROR_PAUSE};
use crate::fetch::rescue::Rescue;
use crate::fetch::unit_of_work::UnitOfWork;
use crate::worker::Worker;
use std::sync::Arc;
use tokio::sync::Semaphore;

/// Most jobs one batch takes.
const MAX_BATCH: usize = 256;

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

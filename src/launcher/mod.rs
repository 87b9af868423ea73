//! Starts and stops one worker process. Shutdown flows one way: signal -> fetch stops ->
//! running jobs see it (plain jobs until the deadline, phased jobs at their next boundary) ->
//! locks released and jobs requeued by their own processors -> leftovers drained from our
//! working lists -> heartbeat cleared (`processes`, `<identity>:work`) -> exit 0.

use crate::job::handler::Registry;
use crate::loops::{heartbeat, periodic, scheduled, sidekiq_cron, sweeper, watchdog};
use crate::manager;
use crate::manifest::PeriodicSpec;
use crate::process::shutdown::Shutdown;
use crate::worker::config::Config;
use crate::worker::Worker;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
use tracing::Instrument;

/// Extra time after the deadline for killed phases to exit and jobs to be pushed back.
const AFTER_DEADLINE: Duration = Duration::from_secs(10);

pub use crate::worker::error::StartError;
pub use signals::Signals;

mod build;
mod signals;

use build::build;

pub async fn run(config: Config, registry: Registry) -> Result<(), StartError> {
    run_with(config, registry, Shutdown::new(), Signals::Handle).await
}

/// Run a worker that stops when `shutdown` says so (for embedding and tests); with
/// `Signals::Handle` it also listens for TERM/INT/TSTP/TTIN. As Sidekiq's Launcher: build the
/// worker, start its loops, run the manager until fetching stops, then stop.
pub async fn run_with(
    config: Config,
    registry: Registry,
    shutdown: Shutdown,
    signals: Signals,
) -> Result<(), StartError> {
    crate::traces::start("playguard");
    let (worker, periodic) = build(config, registry, shutdown).await?;
    let loops = start(&worker, signals, periodic).await;
    let slots = Arc::new(Semaphore::new(worker.config.concurrency));
    let credits_total = manager::credits(&worker);
    let credits = Arc::new(Semaphore::new(credits_total));
    manager::run(worker.clone(), slots, credits.clone()).await;
    tracing::info!("fetching stopped");
    stop(&worker, loops, &credits, credits_total).await;
    // The last spans, for at most 2 s (a dead collector holds up no stop for longer).
    let flush = || crate::traces::stop(Duration::from_secs(2));
    let _ = tokio::task::spawn_blocking(flush).await;
    Ok(())
}

/// How long a clean stop waits for failure hooks still running.
const HOOKS_AT_EXIT: Duration = Duration::from_secs(10);

/// The loops a running worker has beside its manager.
struct Loops {
    signals: tokio::task::JoinHandle<()>,
    beat: tokio::task::JoinHandle<()>,
    /// systemd's status and watchdog loop (loops/watchdog.rs), ended with the beat.
    notify: tokio::task::JoinHandle<()>,
    side: tokio::task::JoinSet<()>,
}

/// Listen for signals, land the first heartbeat (then READY=1 to systemd, with NOTIFY_SOCKET),
/// then start the heartbeat loop, systemd's status and watchdog loop, the sweeper,
/// the scheduled poller and one periodic loop per schedule.
async fn start(worker: &Arc<Worker>, signals: Signals, periodic: Vec<PeriodicSpec>) -> Loops {
    let root = crate::logging::root().clone();
    let worker2 = worker.clone();
    let signals = tokio::spawn(
        async move {
            if signals == Signals::Handle {
                signals::listen(worker2).await
            }
        }
        .instrument(root.clone()),
    );
    let info = heartbeat::info_json(worker, crate::job::payload::now_f64());
    // Beat before fetching: with reliable fetch our working lists must be registered (and
    // claimed by a live process) before they hold anything, or a crash could orphan them
    // where no sweep looks. So keep trying until one beat lands, or we are told to stop.
    let mut landed = true;
    while let Err(e) = heartbeat::beat_once(worker, &info).await {
        tracing::warn!(error = %e, "first heartbeat failed; retrying before fetching");
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = worker.shutdown.quieted() => { landed = false; break }
        }
    }
    if landed {
        watchdog::ready(worker);
    }
    let beat = tokio::spawn(
        heartbeat::run(worker.clone(), info, signals::apply_remote).instrument(root.clone()),
    );
    let notify = tokio::spawn(watchdog::run(worker.clone()).instrument(root.clone()));
    let mut side = tokio::task::JoinSet::new();
    if worker.liveness.is_kept() {
        side.spawn(sweeper::run(worker.clone()).instrument(root.clone()));
    }
    side.spawn(scheduled::run(worker.clone()).instrument(root.clone()));
    for p in periodic {
        side.spawn(periodic::run(worker.clone(), p).instrument(root.clone()));
    }
    if worker.config.sidekiq_cron {
        side.spawn(sidekiq_cron::run(worker.clone()).instrument(root.clone()));
    }
    Loops {
        signals,
        beat,
        notify,
        side,
    }
}

/// Once fetching stopped: wait for every fetched job to end or be handed back (until the
/// deadline and a backstop after it), stop the side loops, flush the acks, push leftovers
/// back, and clear the heartbeat.
async fn stop(worker: &Worker, mut loops: Loops, credits: &Semaphore, credits_total: usize) {
    worker.shutdown.stopped().await;
    let deadline = worker
        .shutdown
        .state()
        .deadline
        .expect("stopping sets a deadline");
    // Every fetched job has ended or been handed back once all credits are home.
    let all = credits.acquire_many(credits_total as u32);
    // The deadline may move (second TERM); processors follow it themselves, this is a backstop.
    if tokio::time::timeout_at(deadline + AFTER_DEADLINE, all)
        .await
        .is_err()
    {
        tracing::error!("some jobs did not finish after the deadline; exiting anyway");
    }
    while loops.side.join_next().await.is_some() {}
    worker.fetch.finish_acks().await;
    match worker.fetch.drain(&worker.config.queues.names()).await {
        Ok(0) => {}
        Ok(n) => tracing::info!(jobs = n, "pushed leftover jobs back to their queues"),
        Err(e) => {
            tracing::error!(error = %e, "could not drain our working lists; the orphan sweep will")
        }
    }
    loops.beat.abort();
    loops.notify.abort();
    loops.signals.abort();
    if let Err(e) = heartbeat::clear(worker).await {
        tracing::warn!(error = %e, "could not clear the heartbeat; it expires in 60 s");
    }
    worker.reporter.close(HOOKS_AT_EXIT).await;
    tracing::info!("bye");
}

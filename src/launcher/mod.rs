//! Starts and stops one worker process. Shutdown flows one way: signal -> fetch stops ->
//! running jobs see it (plain jobs until the deadline, phased jobs at their next boundary) ->
//! locks released and jobs requeued by their own processors -> leftovers drained from our
//! working lists -> heartbeat cleared (`processes`, `<identity>:work`) -> exit 0.

use crate::job::handler::Registry;
use crate::loops::{heartbeat, periodic, scheduled, sweeper, watchdog};
use crate::manager;
use crate::manifest::jobs as manifest_jobs;
use crate::manifest::PeriodicSpec;
use crate::process::shutdown::Shutdown;
use crate::process::slots::SlotTable;
use crate::worker::config::Config;
use crate::worker::error::{database_error, open_redis, parse_database, redis_version};
use crate::worker::Worker;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
use tracing::Instrument;

/// How long a start waits for a Redis that is loading its dataset (LOADING).
const LOADING_WAIT: Duration = Duration::from_secs(300);

/// Extra time after the deadline for killed phases to exit and jobs to be pushed back.
const AFTER_DEADLINE: Duration = Duration::from_secs(10);

pub use crate::worker::error::StartError;
pub use signals::Signals;

mod signals;

/// Parse the database URL, reach the server and create the tables when missing.
async fn open_database(
    config: &Config,
    identity: &str,
) -> Result<Option<crate::connections::db::Db>, StartError> {
    let Some(url) = config.database_url.as_deref() else {
        return Ok(None);
    };
    let db = parse_database(url, identity)?;
    let unreachable = |e| database_error(&db, e);
    db.ensure_schema().await.map_err(unreachable)?;
    let version = db.server_version().await.map_err(unreachable)?;
    tracing::info!(database = %db.shown_url(), postgres = %version,
        "PostgreSQL answers; playguard_fences and playguard_cycles are in place");
    Ok(Some(db))
}

/// Run a worker until a signal tells it to stop. `registry` holds Rust handlers; manifest
/// entries from `config.jobs_dir` are added to it.
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
    let (worker, periodic) = build(config, registry, shutdown).await?;
    let loops = start(&worker, signals, periodic).await;
    let slots = Arc::new(Semaphore::new(worker.config.concurrency));
    let credits_total = manager::credits(&worker);
    let credits = Arc::new(Semaphore::new(credits_total));
    manager::run(worker.clone(), slots, credits.clone()).await;
    tracing::info!("fetching stopped");
    stop(&worker, loops, &credits, credits_total).await;
    Ok(())
}

/// The manifest's jobs in the registry, Redis and PostgreSQL reached, the worker made and its
/// metrics served. Also the manifest's periodic schedules, for `start`.
async fn build(
    config: Config,
    mut registry: Registry,
    shutdown: Shutdown,
) -> Result<(Arc<Worker>, Vec<PeriodicSpec>), StartError> {
    let manifest =
        manifest_jobs::load_manifest(&config.jobs_dir, &registry).map_err(StartError::Config)?;
    manifest_jobs::register_manifest(&mut registry, &manifest);
    manifest_jobs::check_database_needs(config.database_url.as_deref(), &registry)
        .map_err(StartError::Config)?;
    let url = crate::connections::redact::url(&config.redis_url);
    let (_, mut conn) = open_redis(&config.redis_url, LOADING_WAIT).await?;
    let version = redis_version(&mut conn, &url).await?;
    // Behind sentinels, the start line names the primary they led us to.
    let version = match conn.primary() {
        Some(p) => format!("{version} at primary {p}"),
        None => version,
    };
    let identity = crate::process::identity::new_identity();
    let db = open_database(&config, &identity).await?;
    let state = Arc::new(crate::process::redis_state::RedisState::default());
    let reliable = config.fetch.keeps_working_lists();
    crate::loops::eviction::check_at_start(&mut conn, &state, reliable, config.allow_eviction)
        .await
        .map_err(StartError::Config)?;
    let sentry = crate::report::to_sentry::from_env(manifest_jobs::report_args(&manifest))
        .map_err(StartError::Config)?;
    let worker = Arc::new(new_worker(
        config,
        registry,
        shutdown,
        conn,
        db,
        (identity, sentry, manifest_jobs::hooks(&manifest)),
        state,
    ));
    reconcile_on_failover(&worker);
    if let Some(addr) = worker.config.metrics_addr {
        let probes = crate::metrics::server::Probes {
            metrics: worker.metrics.clone(),
            beat_ms: worker.config.beat_interval.as_millis() as i64,
            shutdown: worker.shutdown.clone(),
            liveness: worker.liveness.clone(),
        };
        crate::metrics::server::serve(addr, probes)
            .await
            .map_err(|e| StartError::Config(format!("--metrics-addr {addr}: {e}")))?;
    }
    tracing::info!(identity = %worker.identity, redis = %version, concurrency = worker.config.concurrency,
        queues = %worker.config.queues.names().join(","), fetch = worker.fetch.name(),
        classes = %worker.registry.classes().join(","), "playguard starting");
    Ok((worker, manifest.periodic))
}

/// After a failover, before the new primary is used: our recent acks and outcomes again there,
/// and our running jobs listed in our working lists there (`fetch/recent.rs`).
fn reconcile_on_failover(worker: &Arc<Worker>) {
    let me = Arc::downgrade(worker);
    worker.conn.on_new_primary(Arc::new(move |mut m| {
        let me = me.clone();
        Box::pin(async move {
            let Some(w) = me.upgrade() else { return };
            let running: Vec<_> = w
                .slots
                .snapshot()
                .into_iter()
                .map(|(_, e)| (e.queue, e.payload))
                .collect();
            match w.fetch.reconcile(&mut m, &running).await {
                Ok(r) => tracing::warn!(finished = r.finished, running = r.running, unqueued = r.unqueued,
                    "failover: re-applied on the new primary what this process did in its last seconds"),
                Err(e) => tracing::warn!(error = %e,
                    "failover: could not re-apply our last seconds on the new primary; jobs may run twice"),
            }
        })
    }));
}

/// The worker's shared state: its fetch strategy, liveness lease (only a fetch with orphan
/// recovery needs a lease to stop before), metrics and slot table.
fn new_worker(
    config: Config,
    registry: Registry,
    shutdown: Shutdown,
    conn: crate::connections::redis_conn::Conn,
    db: Option<crate::connections::db::Db>,
    (identity, sentry, hooks): (
        String,
        Option<crate::report::to_sentry::SentryOut>,
        Vec<crate::report::hooks::Hook>,
    ),
    redis_state: Arc<crate::process::redis_state::RedisState>,
) -> Worker {
    let mut metrics = crate::metrics::prometheus::Metrics::default();
    metrics.redis = redis_state;
    let metrics = Arc::new(metrics);
    let next_due = Arc::new(crate::job::next_due::NextDue::default());
    let fetch = crate::fetch::FetchStrategy::new(
        config.fetch,
        &identity,
        (conn.clone(), metrics.redis.clone()),
        shutdown.clone(),
        next_due.clone(),
    );
    let liveness = fetch.liveness();
    metrics.know_classes(registry.classes());
    let locks_record = Worker::locks_record_for(&identity, &liveness);
    let reporter = Arc::new(crate::report::FailureReporter::new(
        sentry,
        hooks,
        metrics.clone(),
    ));
    let worker = Worker {
        next_due,
        reporter,
        locks_record,
        conn,
        db,
        identity,
        registry,
        slots: SlotTable::new(),
        shutdown,
        metrics,
        job_metrics: crate::metrics::sidekiq_tab::JobMetrics::new(config.sidekiq_metrics),
        fetch: Arc::new(fetch),
        liveness,
        config,
    };
    worker.metrics.attach_slots(&worker.slots);
    worker.metrics.concurrency.store(
        worker.config.concurrency as i64,
        std::sync::atomic::Ordering::Relaxed,
    );
    worker
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

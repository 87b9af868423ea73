//! Building a worker: the manifest's jobs registered, Redis (and PostgreSQL) reached, the
//! fetch strategy, liveness lease and failure reporter made, the failover reconcile hooked and
//! the metrics served. Keys: none written (INFO read; a failover's reconcile is `fetch/`'s).

use crate::job::handler::Registry;
use crate::manifest::jobs as manifest_jobs;
use crate::manifest::PeriodicSpec;
use crate::process::shutdown::Shutdown;
use crate::process::slots::SlotTable;
use crate::worker::config::Config;
use crate::worker::error::{database_error, open_redis, parse_database, redis_version, StartError};
use crate::worker::Worker;
use std::sync::Arc;
use std::time::Duration;

/// How long a start waits for a Redis that is loading its dataset (LOADING).
const LOADING_WAIT: Duration = Duration::from_secs(300);

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
/// The manifest's jobs in the registry, Redis and PostgreSQL reached, the worker made and its
/// metrics served. Also the manifest's periodic schedules, for `start`.
pub(super) async fn build(
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
    let replicated = crate::worker::fence_advice::replication(&mut conn).await;
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
    let redis_fenced = crate::worker::fence_advice::on_redis_fences(&manifest);
    if let Some(w) = crate::worker::fence_advice::advice(&redis_fenced, replicated.as_deref()) {
        tracing::warn!("{w}");
    }
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
        cancels: crate::job::cancel::Cancels::new(conn.clone()),
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

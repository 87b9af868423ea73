//! Starts and stops one worker process. Shutdown flows one way: signal -> fetch stops ->
//! running jobs see it (plain jobs until the deadline, phased jobs at their next boundary) ->
//! locks released and jobs requeued by their own processors -> leftovers drained from our
//! working lists -> heartbeat cleared (`processes`, `<identity>:work`) -> exit 0.

use crate::config::Config;
use crate::handler::Registry;
use crate::manifest::Manifest;
use crate::runtime::Runtime;
use crate::shutdown::Shutdown;
use crate::work::WorkState;
use crate::{fetch, heartbeat, periodic, scheduled, sweeper};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
use tracing::Instrument;

/// Extra time after the deadline for killed phases to exit and jobs to be pushed back.
const AFTER_DEADLINE: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot reach Redis at {url}: {err}")]
    Redis { url: String, err: redis::RedisError },
    #[error("cannot reach PostgreSQL at {url}: {err}")]
    Database { url: String, err: String },
    #[error("{0}")]
    Config(String),
}

/// Log what every busy slot is doing (TTIN).
fn dump_slots(rt: &Runtime) {
    let snap = rt.work.snapshot();
    tracing::info!(
        busy = snap.len(),
        concurrency = rt.config.concurrency,
        "TTIN: slot dump"
    );
    for (tid, e) in snap {
        tracing::info!(tid = %tid, jid = %e.jid, class = %e.class, queue = %e.queue,
            phase = e.phase.as_deref().unwrap_or("-"),
            runtime_ms = e.started.elapsed().as_millis() as u64, "busy");
    }
}

fn apply_signal(rt: &Runtime, sig: &str, remote: bool) {
    let from = if remote { "remote " } else { "" };
    match sig {
        "TERM" | "INT" => {
            let again = rt.shutdown.is_stopping();
            rt.shutdown.stop(rt.config.timeout);
            if again {
                tracing::warn!("{from}{sig} again: shutdown deadline moved to now");
            } else {
                tracing::info!(
                    timeout_secs = rt.config.timeout.as_secs_f64(),
                    "{from}{sig}: shutting down; running jobs get until the deadline"
                );
            }
        }
        "TSTP" => {
            rt.shutdown.quiet();
            tracing::info!("{from}TSTP: quiet, no new jobs will be fetched");
        }
        "TTIN" => dump_slots(rt),
        other => tracing::info!("{from}{other}: ignored"),
    }
}

async fn signals(rt: Arc<Runtime>) {
    use tokio::signal::unix::{signal, SignalKind};
    let kinds = [
        ("TERM", SignalKind::terminate()),
        ("INT", SignalKind::interrupt()),
        ("TSTP", SignalKind::from_raw(nix::libc::SIGTSTP)),
        ("TTIN", SignalKind::from_raw(nix::libc::SIGTTIN)),
        ("USR1", SignalKind::user_defined1()),
        ("USR2", SignalKind::user_defined2()),
    ];
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<&'static str>();
    for (name, kind) in kinds {
        match signal(kind) {
            Ok(mut s) => {
                let tx = tx.clone();
                tokio::spawn(async move {
                    while s.recv().await.is_some() {
                        if tx.send(name).is_err() {
                            return;
                        }
                    }
                });
            }
            Err(e) => tracing::warn!("cannot listen for SIG{name}: {e}"),
        }
    }
    while let Some(name) = rx.recv().await {
        apply_signal(&rt, name, false);
    }
}

/// One beat, and what it means for the liveness lease: a landed beat extends it; the first
/// one after a lapse treats our past as dead (see `regained`).
async fn beat_once(rt: &Runtime, info: &str) -> redis::RedisResult<Option<String>> {
    let sent_at = tokio::time::Instant::now();
    let r = heartbeat::beat(rt, info).await;
    if r.is_ok() && rt.reliable() {
        // Still lapsed (nothing is fetched): release first, so no lock taken after the
        // refresh can be among those released.
        if !rt.liveness.is_live() {
            regained(rt).await;
        }
        rt.liveness.refreshed(sent_at);
        rt.retry_pending_requeues().await;
    }
    r
}

/// Liveness is back after a lapse. Every job that ran then has been stopped (or is stopping),
/// and the sweep may have judged us dead meanwhile: release the locks we recorded, as the
/// sweep would, so a job handed back is not skipped as "already locked" by our own lease.
async fn regained(rt: &Runtime) {
    tracing::warn!("liveness lease regained after a lapse; releasing the locks recorded before it");
    if let Err(e) = sweeper::release_locks_of(rt, &rt.identity, true).await {
        tracing::warn!(error = %e, "could not release our recorded locks; they expire by their ttl");
    }
}

async fn heartbeat_loop(rt: Arc<Runtime>, info: String) {
    loop {
        match beat_once(&rt, &info).await {
            Ok(Some(sig)) => apply_signal(&rt, &sig, true),
            Ok(None) => {}
            Err(e) => tracing::warn!(error = %e, "heartbeat: Redis error"),
        }
        tokio::time::sleep(rt.config.beat_interval).await;
    }
}

/// Load and check the manifests: every command must exist, and a worker with no job class
/// at all (a wrong working directory, a mistyped -j) refuses to start rather than fail every
/// job it takes.
pub fn load_manifest(dir: &std::path::Path, registry: &Registry) -> Result<Manifest, StartError> {
    let manifest = Manifest::load(dir).map_err(|e| StartError::Config(e.to_string()))?;
    manifest
        .check_commands()
        .map_err(|e| StartError::Config(e.to_string()))?;
    // (A dispatch-only process, with [[periodic]] entries and no job class, is fine.)
    if manifest.jobs.is_empty() && manifest.periodic.is_empty() && registry.classes().is_empty() {
        let cwd = std::env::current_dir()
            .map(|d| d.display().to_string())
            .unwrap_or_default();
        return Err(StartError::Config(format!(
            "no job classes: {} holds no [[job]] or [[periodic]] manifests (working directory {cwd}) and no Rust handler is registered",
            dir.display()
        )));
    }
    let known: Vec<&str> = manifest.jobs.iter().map(|j| j.class.as_str()).collect();
    for p in &manifest.periodic {
        if !known.contains(&p.class.as_str()) && !registry.contains(&p.class) {
            tracing::warn!(periodic = %p.name, class = %p.class,
                "periodic entry enqueues a class this worker does not define (fine if another worker runs it)");
        }
    }
    Ok(manifest)
}

/// Register a command or phased job for every manifest entry.
pub fn register_manifest(registry: &mut Registry, manifest: &Manifest) {
    for j in &manifest.jobs {
        if j.phases.is_empty() {
            registry.register(
                j.class.clone(),
                crate::command_job::CommandJob {
                    argv: j.run.clone().unwrap_or_default(),
                    timeout: j.timeout_secs.map(Duration::from_secs),
                    inherit: j.env.clone(),
                },
            );
        } else {
            registry.register_arc(j.class.clone(), crate::reconcile::from_manifest(j));
        }
    }
}

/// How long a starting process waits for a Redis that answers `LOADING`.
const LOADING_WAIT: Duration = Duration::from_secs(300);

/// Connect and PING. A Redis that answers `LOADING` (restarted, reading its dataset back) is
/// there and about to serve: wait for it rather than exit as if it were unreachable, since
/// under foreman one process that exits stops the whole Procfile.
async fn reach_redis(
    client: &crate::redis_conn::Client,
    url: &str,
) -> redis::RedisResult<crate::redis_conn::Conn> {
    let started = std::time::Instant::now();
    let mut told = false;
    loop {
        let attempt = async {
            let mut conn = crate::redis_conn::shared(client).await?;
            redis::cmd("PING").query_async::<()>(&mut conn).await?;
            Ok::<_, redis::RedisError>(conn)
        }
        .await;
        match attempt {
            Err(e) if e.code() == Some("LOADING") && started.elapsed() < LOADING_WAIT => {
                if !told {
                    tracing::warn!(redis = %url, "Redis is loading its dataset; waiting for it");
                    told = true;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            done => return done,
        }
    }
}

/// Classes with `fence = "database"` need a database URL: refuse to start without one.
pub fn check_database_needs(
    database_url: Option<&str>,
    registry: &Registry,
) -> Result<(), StartError> {
    let needing = registry.needing_database();
    if database_url.is_none() && !needing.is_empty() {
        return Err(StartError::Config(missing_database(&needing)));
    }
    Ok(())
}

/// The one line for classes that need a database URL when none is set.
pub fn missing_database(classes: &[String]) -> String {
    format!(
        "{} take{} fences from PostgreSQL (fence = \"database\") but no database URL is set (DATABASE_URL or --database-url)",
        classes.join(", "),
        if classes.len() == 1 { "s" } else { "" }
    )
}

/// Parse the database URL, reach the server and create the tables when missing.
async fn open_database(
    config: &Config,
    identity: &str,
) -> Result<Option<crate::db::Db>, StartError> {
    let Some(url) = config.database_url.as_deref() else {
        return Ok(None);
    };
    let db = crate::db::Db::new(url, identity).map_err(|e| StartError::Config(e.to_string()))?;
    let unreachable = |e: crate::db::DbError| StartError::Database {
        url: db.shown_url().to_string(),
        err: e.to_string(),
    };
    db.ensure_schema().await.map_err(unreachable)?;
    let version = db.server_version().await.map_err(unreachable)?;
    tracing::info!(database = %db.shown_url(), postgres = %version,
        "PostgreSQL answers; playguard_fences and playguard_cycles are in place");
    Ok(Some(db))
}

/// Run a worker until a signal tells it to stop. `registry` holds Rust handlers; manifest
/// entries from `config.jobs_dir` are added to it.
pub async fn run(config: Config, registry: Registry) -> Result<(), StartError> {
    run_with(config, registry, Shutdown::new(), true).await
}

/// Run a worker that stops when `shutdown` says so (for embedding and tests); `signals`
/// also listens for TERM/INT/TSTP/TTIN.
pub async fn run_with(
    config: Config,
    mut registry: Registry,
    shutdown: Shutdown,
    signals_too: bool,
) -> Result<(), StartError> {
    let manifest = load_manifest(&config.jobs_dir, &registry)?;
    register_manifest(&mut registry, &manifest);
    check_database_needs(config.database_url.as_deref(), &registry)?;
    let url = crate::redact::url(&config.redis_url);
    let redis_err = |err| StartError::Redis {
        url: url.clone(),
        err,
    };
    // A URL that does not parse is a configuration error, not an unreachable server.
    let client = crate::redis_conn::client(&config.redis_url)
        .map_err(|e| StartError::Config(format!("bad Redis URL {url:?}: {e}")))?;
    let mut conn = reach_redis(&client, &url).await.map_err(redis_err)?;
    let version = crate::redis_conn::check_server(&mut conn)
        .await
        .map_err(|e| StartError::Config(format!("{url}: {e}")))?;
    // Behind sentinels, the start line names the primary they led us to.
    let version = match conn.primary() {
        Some(p) => format!("{version} at primary {p}"),
        None => version,
    };

    let identity = crate::identity::new_identity();
    let db = open_database(&config, &identity).await?;

    let acker = crate::acker::Acker::start(conn.clone());
    let metrics = Arc::new(crate::metrics::Metrics::default());
    metrics.know_classes(registry.classes());
    let rt = Arc::new(Runtime {
        client,
        conn,
        db,
        identity,
        registry,
        work: WorkState::new(),
        shutdown,
        metrics,
        job_metrics: crate::job_metrics::JobMetrics::new(config.sidekiq_metrics),
        acker,
        // Only reliable fetch has orphan recovery, so only it needs a lease to stop before.
        liveness: if config.reliable_fetch {
            crate::liveness::Liveness::new()
        } else {
            crate::liveness::Liveness::disabled()
        },
        pending_requeues: Default::default(),
        config,
    });
    rt.metrics.attach_work(&rt.work);
    rt.metrics.concurrency.store(
        rt.config.concurrency as i64,
        std::sync::atomic::Ordering::Relaxed,
    );
    if let Some(addr) = rt.config.metrics_addr {
        crate::metrics_http::serve(
            addr,
            rt.metrics.clone(),
            rt.config.beat_interval.as_millis() as i64,
        )
        .await
        .map_err(|e| StartError::Config(format!("--metrics-addr {addr}: {e}")))?;
    }
    tracing::info!(identity = %rt.identity, redis = %version, concurrency = rt.config.concurrency,
        queues = %rt.config.queues.names().join(","), fetch = if rt.reliable() { "reliable" } else { "basic" },
        classes = %rt.registry.classes().join(","), "playguard starting");

    let root = crate::logging::root().clone();
    let rt2 = rt.clone();
    let signal_task = tokio::spawn(
        async move {
            if signals_too {
                signals(rt2).await
            }
        }
        .instrument(root.clone()),
    );
    let info = heartbeat::info_json(&rt, crate::payload::now_f64());
    // Beat before fetching: with reliable fetch our working lists must be registered (and
    // claimed by a live process) before they hold anything, or a crash could orphan them
    // where no sweep looks. So keep trying until one beat lands, or we are told to stop.
    while let Err(e) = beat_once(&rt, &info).await {
        tracing::warn!(error = %e, "first heartbeat failed; retrying before fetching");
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = rt.shutdown.quieted() => break,
        }
    }
    let beat_task = tokio::spawn(heartbeat_loop(rt.clone(), info).instrument(root.clone()));
    let mut side = tokio::task::JoinSet::new();
    if rt.reliable() {
        side.spawn(sweeper::run(rt.clone()).instrument(root.clone()));
    }
    side.spawn(scheduled::run(rt.clone()).instrument(root.clone()));
    for p in manifest.periodic.clone() {
        side.spawn(periodic::run(rt.clone(), p).instrument(root.clone()));
    }

    let slots = Arc::new(Semaphore::new(rt.config.concurrency));
    fetch::run(rt.clone(), slots.clone()).await;
    tracing::info!("fetching stopped");
    rt.shutdown.stopped().await;
    let deadline = rt
        .shutdown
        .state()
        .deadline
        .expect("stopping sets a deadline");
    let all = slots.acquire_many(rt.config.concurrency as u32);
    // The deadline may move (second TERM); processors follow it themselves, this is a backstop.
    if tokio::time::timeout_at(deadline + AFTER_DEADLINE, all)
        .await
        .is_err()
    {
        tracing::error!("some jobs did not finish after the deadline; exiting anyway");
    }
    while side.join_next().await.is_some() {}
    rt.acker.flush_and_stop().await;
    if rt.reliable() {
        match sweeper::drain_own(&rt).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(jobs = n, "pushed leftover jobs back to their queues"),
            Err(e) => {
                tracing::error!(error = %e, "could not drain our working lists; the orphan sweep will")
            }
        }
    }
    beat_task.abort();
    signal_task.abort();
    if let Err(e) = heartbeat::clear(&rt).await {
        tracing::warn!(error = %e, "could not clear the heartbeat; it expires in 60 s");
    }
    tracing::info!("bye");
    Ok(())
}

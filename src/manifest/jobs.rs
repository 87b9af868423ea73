//! Turns the loaded `jobs/*.toml` into registry entries and checks what they need before a
//! worker (or `playguard check`) goes on: every command exists, there is at least one job
//! class, and classes with `fence = "database"` have a database URL. Touches no Redis keys
//! and no tables. Errors are one-line configuration errors (exit 2); nothing branches on them.
//! Attaches each job's failure policy (`job/retry_policy.rs`) to its handler.
//! Also hands the failure reporter its hooks and the classes that opted in to `report_args`.

use crate::cycle::fences::FenceSource;
use crate::cycle::reconcile::{CommandPhase, Cycle, LockConfig, Phase};
use crate::job::handler::Registry;
use crate::job::handler::{BoxFuture, Handler, Outcome};
use crate::job::retry_policy::Policy;
use crate::manifest::{JobSpec, Manifest};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// Load and check the manifests: every command must exist, and a worker with no job class
/// at all (a wrong working directory, a mistyped -j) refuses to start rather than fail every
/// job it takes.
pub fn load_manifest(dir: &Path, registry: &Registry) -> Result<Manifest, String> {
    let manifest = Manifest::load(dir).map_err(|e| e.to_string())?;
    manifest.check_commands().map_err(|e| e.to_string())?;
    // (A dispatch-only process, with [[periodic]] entries and no job class, is fine.)
    if manifest.jobs.is_empty() && manifest.periodic.is_empty() && registry.classes().is_empty() {
        let cwd = std::env::current_dir()
            .map(|d| d.display().to_string())
            .unwrap_or_default();
        return Err(format!(
            "no job classes: {} holds no [[job]] or [[periodic]] manifests (working directory {cwd}) and no Rust handler is registered",
            dir.display()
        ));
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
        let handler: Arc<dyn Handler> = if j.phases.is_empty() {
            Arc::new(crate::commands::command_job::CommandJob {
                argv: j.run.clone().unwrap_or_default(),
                timeout: j.timeout_secs.map(Duration::from_secs),
                inherit: j.env.clone(),
            })
        } else {
            reconcile_cycle(j)
        };
        let handler = match &j.policy {
            Some(p) => Arc::new(WithPolicy {
                inner: handler,
                policy: Arc::new(p.clone()),
            }),
            None => handler,
        };
        registry.register_arc(j.class.clone(), handler);
    }
}

/// Classes with `fence = "database"` need a database URL: refuse to start without one.
/// (`registry` holds the manifest entries by now.)
pub fn check_database_needs(database_url: Option<&str>, registry: &Registry) -> Result<(), String> {
    let needing = registry.needing_database();
    if database_url.is_none() && !needing.is_empty() {
        return Err(missing_database(&needing));
    }
    Ok(())
}

/// The classes that take fences from PostgreSQL, for a manifest not registered (`check`):
/// the Rust handlers' and the manifest entries with `fence = "database"`.
pub fn needing_database(manifest: &Manifest, registry: &Registry) -> Vec<String> {
    let mut needing = registry.needing_database();
    needing.extend(
        manifest
            .jobs
            .iter()
            .filter(|j| {
                j.lock
                    .as_ref()
                    .is_some_and(|l| l.fence_source() == FenceSource::Database)
            })
            .map(|j| j.class.clone()),
    );
    needing
}

/// The one line for classes that need a database URL when none is set.
pub fn missing_database(classes: &[String]) -> String {
    format!(
        "{} take{} fences from PostgreSQL (fence = \"database\") but no database URL is set (DATABASE_URL or --database-url)",
        classes.join(", "),
        if classes.len() == 1 { "s" } else { "" }
    )
}

/// A phased `[[job]]` as a reconcile cycle: its lock, and one command phase per `[[job.phase]]`.
fn reconcile_cycle(j: &JobSpec) -> Arc<dyn Handler> {
    // Manifest validation guarantees phased jobs have a lock.
    let l = j.lock.as_ref().expect("validated: phased jobs have a lock");
    let lock = LockConfig {
        key: l.key.clone(),
        ttl: Duration::from_secs_f64(l.ttl_secs),
        label: l.label.clone(),
        fence: l.fence_source(),
    };
    Arc::new(Cycle {
        lock,
        on_cancel: j
            .on_cancel
            .as_deref()
            .and_then(|c| crate::cycle::cancel::OnCancel::parse(c).ok())
            .unwrap_or_default(),
        phases: j
            .phases
            .iter()
            .map(|p| {
                let phase: Arc<dyn Phase> = Arc::new(CommandPhase {
                    name: p.name.clone(),
                    argv: p.run.clone(),
                    inherit: j.env.clone(),
                });
                (phase, p.timeout_secs.map(Duration::from_secs_f64))
            })
            .collect(),
    })
}

/// The manifest's `[[hook]]` entries, for the worker's failure reporter (validated on load).
pub fn hooks(manifest: &Manifest) -> Vec<crate::report::hooks::Hook> {
    use crate::report::hooks::{Hook, On, DEFAULT_TIMEOUT};
    manifest
        .hooks
        .iter()
        .filter_map(|h| {
            Some(Hook {
                on: On::parse(&h.on).ok()?,
                argv: h.run.clone(),
                timeout: h
                    .timeout_secs
                    .map_or(DEFAULT_TIMEOUT, Duration::from_secs_f64),
                class: None,
            })
        })
        .chain(manifest.jobs.iter().filter_map(|j| {
            Some(Hook {
                on: On::Death,
                argv: j.on_exhausted.clone()?,
                timeout: DEFAULT_TIMEOUT,
                class: Some(j.class.clone()),
            })
        }))
        .collect()
}

/// A manifest job's handler with its failure policy (`retry_in`, `max_retries`) attached.
struct WithPolicy {
    inner: Arc<dyn Handler>,
    policy: Arc<Policy>,
}

impl Handler for WithPolicy {
    fn perform(&self, ctx: crate::job::handler::JobContext) -> BoxFuture<'static, Outcome> {
        self.inner.perform(ctx)
    }
    fn stops_itself(&self) -> bool {
        self.inner.stops_itself()
    }
    fn needs_database(&self) -> bool {
        self.inner.needs_database()
    }
    fn retry_policy(&self) -> Option<Arc<Policy>> {
        Some(self.policy.clone())
    }
}

/// The classes whose Sentry events may carry their `args` (`report_args = true`).
pub fn report_args(manifest: &Manifest) -> std::collections::HashSet<String> {
    manifest
        .jobs
        .iter()
        .filter(|j| j.report_args)
        .map(|j| j.class.clone())
        .collect()
}

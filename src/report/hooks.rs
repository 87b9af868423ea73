//! The manifest's `[[hook]]` commands: on `failure` (every failed run), `death` (a job that
//! died: retries exhausted, or dead for any reason, once per job), `lock_lost` and `poison`.
//! Each gets `{"job": <payload>, "error": {...}, "event": "<on>"}` on stdin, argv only, and
//! runs through the worker's command guardian (`commands/child.rs`) on a task of its own, so
//! no job's slot waits for it. A hook that fails or times out is logged, never retried, and
//! never changes the job's outcome. A `[[job]]`'s `on_exhausted` is a `death` hook for that
//! class only (Ruby's `sidekiq_retries_exhausted`). Touches no Redis keys.

use crate::commands::child::{self, Exit};
use crate::job::report::{Kind, Report};
use serde_json::{Map, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tracing::Instrument;

/// A hook's time unless its entry says `timeout_secs`.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// Hooks running at once; the rest wait their turn on their own tasks.
const RUNNING_AT_ONCE: usize = 4;
/// Hooks started or waiting at most: past this (a flood of failures with slow hooks) new ones
/// are dropped with a log line rather than pile up without bound.
const MAX_IN_FLIGHT: usize = 1000;
/// stderr lines a hook's `error.stderr` carries at most.
const STDERR_LINES: usize = 20;

/// When a hook runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum On {
    Failure,
    Death,
    LockLost,
    Poison,
}

impl On {
    pub const NAMES: [&'static str; 4] = ["failure", "death", "lock_lost", "poison"];

    pub fn parse(s: &str) -> Result<On, String> {
        match s {
            "failure" => Ok(On::Failure),
            "death" => Ok(On::Death),
            "lock_lost" => Ok(On::LockLost),
            "poison" => Ok(On::Poison),
            other => Err(format!(
                "on = {other:?} is not a hook event (one of {})",
                On::NAMES.join(", ")
            )),
        }
    }

    pub fn as_str(self) -> &'static str {
        On::NAMES[self as usize]
    }

    /// The hook events one report fires: a failed run is a failure (and a death when the job
    /// died with it); a poison pill is buried, so it is a death too.
    pub fn of(r: &Report) -> Vec<On> {
        match (r.kind, r.died) {
            (Kind::Failure, false) => vec![On::Failure],
            (Kind::Failure, true) => vec![On::Failure, On::Death],
            (Kind::Poison, _) => vec![On::Poison, On::Death],
            (Kind::LockLost, _) => vec![On::LockLost],
        }
    }
}

/// One `[[hook]]` entry.
#[derive(Debug, Clone)]
pub struct Hook {
    pub on: On,
    pub argv: Vec<String>,
    pub timeout: Duration,
    /// Only for this class's jobs (a `[[job]]`'s `on_exhausted`, run on its deaths).
    pub class: Option<String>,
}

/// The hooks of a worker, and how many of them are running or waiting.
pub struct Hooks {
    list: Vec<Arc<Hook>>,
    metrics: Arc<crate::metrics::prometheus::Metrics>,
    turns: Arc<tokio::sync::Semaphore>,
    in_flight: Arc<AtomicUsize>,
}

impl Hooks {
    pub fn new(list: Vec<Hook>, metrics: Arc<crate::metrics::prometheus::Metrics>) -> Hooks {
        Hooks {
            list: list.into_iter().map(Arc::new).collect(),
            metrics,
            turns: Arc::new(tokio::sync::Semaphore::new(RUNNING_AT_ONCE)),
            in_flight: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Start the hooks this report fires, each on a task of its own; returns at once.
    pub fn fire(&self, r: &Report) {
        let events = On::of(r);
        let job = job_value(&r.payload);
        let class = crate::report::to_sentry::class_of(&job);
        let chosen: Vec<&Arc<Hook>> = self
            .list
            .iter()
            .filter(|h| events.contains(&h.on))
            .filter(|h| h.class.as_ref().is_none_or(|c| *c == class))
            .collect();
        if chosen.is_empty() {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            tracing::warn!("failure hooks not run: no runtime");
            return;
        };
        for hook in chosen {
            if self.in_flight.fetch_add(1, Ordering::SeqCst) >= MAX_IN_FLIGHT {
                self.in_flight.fetch_sub(1, Ordering::SeqCst);
                tracing::warn!(
                    hook = hook.on.as_str(),
                    "hook not run: {MAX_IN_FLIGHT} hooks are already running or waiting"
                );
                count(&self.metrics, hook.on, "dropped");
                continue;
            }
            let stdin = stdin_json(&job, r, hook.on);
            let env = hook_env(&job, r, hook.on);
            let (hook, turns, in_flight, metrics) = (
                hook.clone(),
                self.turns.clone(),
                self.in_flight.clone(),
                self.metrics.clone(),
            );
            let span = tracing::info_span!("hook", on = hook.on.as_str());
            rt.spawn(
                async move {
                    if let Ok(_turn) = turns.acquire_owned().await {
                        let ok = run_one(&hook, stdin, env).await;
                        count(&metrics, hook.on, if ok { "ok" } else { "failed" });
                    }
                    in_flight.fetch_sub(1, Ordering::SeqCst);
                }
                .instrument(span),
            );
        }
    }

    /// Hooks started or waiting now.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }
}

/// The payload as JSON when it is JSON, else as the string it is.
fn job_value(payload: &str) -> Value {
    serde_json::from_str(payload).unwrap_or_else(|_| Value::from(payload))
}

/// `{"job": ..., "error": {"class", "message", "phase"?, "stderr"?}, "event": ...}`.
pub fn stdin_json(job: &Value, r: &Report, on: On) -> String {
    let mut error = Map::new();
    error.insert("class".into(), Value::from(r.error.class.as_str()));
    error.insert("message".into(), Value::from(r.error.message.as_str()));
    if let Some(p) = &r.phase {
        error.insert("phase".into(), Value::from(p.as_str()));
    }
    if !r.error.backtrace.is_empty() {
        // The failure keeps stderr's last line first (Sidekiq's backtrace order); oldest
        // first here.
        let mut lines: Vec<&String> = r.error.backtrace.iter().take(STDERR_LINES).collect();
        lines.reverse();
        error.insert("stderr".into(), serde_json::json!(lines));
    }
    let mut top = Map::new();
    top.insert("job".into(), job.clone());
    top.insert("error".into(), Value::Object(error));
    top.insert("event".into(), Value::from(on.as_str()));
    Value::Object(top).to_string()
}

/// PLAYGUARD_EVENT and the job's names (the class ActiveJob wraps, for its payloads), for
/// hooks that need no JSON parser.
fn hook_env(job: &Value, r: &Report, on: On) -> Vec<(String, String)> {
    let jid = job.get("jid").and_then(Value::as_str).unwrap_or("");
    vec![
        ("PLAYGUARD_EVENT".into(), on.as_str().into()),
        ("PLAYGUARD_JID".into(), jid.to_string()),
        (
            "PLAYGUARD_CLASS".into(),
            crate::report::to_sentry::class_of(job),
        ),
        ("PLAYGUARD_QUEUE".into(), r.queue.to_string()),
    ]
}

/// `playguard_hook_runs_total{on, result}`: ok, failed (non-zero, timed out, not started) or
/// dropped (too many in flight).
fn count(metrics: &crate::metrics::prometheus::Metrics, on: On, result: &str) {
    metrics.inc(
        "playguard_hook_runs_total",
        vec![
            ("on", on.as_str().to_string()),
            ("result", result.to_string()),
        ],
    );
}

/// Run one hook to its end or its timeout, and log how it went; whether it exited 0.
async fn run_one(hook: &Hook, stdin: String, env: Vec<(String, String)>) -> bool {
    let timeout = hook.timeout;
    let spec = child::Spec {
        argv: &hook.argv,
        env,
        inherit: None,
        stdin,
        keepalive: None,
        // A hook holds no lock: its own timeout (below) is its only deadline.
        kill_by: None,
    };
    let stop = async move {
        tokio::time::sleep(timeout).await;
        child::Stop::term(format!("hook timed out after {}s", timeout.as_secs_f64()))
    };
    let why = match child::run(spec, stop).await {
        Exit::Success => {
            tracing::info!(hook = ?hook.argv, "hook ran");
            return true;
        }
        Exit::Failed { message, .. } => message,
        Exit::Killed { why } | Exit::SpawnFailed(why) | Exit::BadInput(why) => why,
    };
    tracing::warn!(hook = ?hook.argv, error = %why,
        "hook failed (not retried; the job's outcome stands)");
    false
}

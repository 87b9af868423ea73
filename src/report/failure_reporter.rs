//! [`FailureReporter`]: a run's failure, death, lost lock or burial turned into one report, sent
//! to Sentry and the hooks, and counted in the metrics. Touches no Redis keys.

use super::{hooks, to_sentry};
use crate::job::payload::Job;
use crate::job::report::{Kind, Report, Reporter};
use crate::job::retry::{self, Decision, Failure};
use crate::metrics::prometheus::Metrics;
use serde_json::Value;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A worker's failure reporting: Sentry when `SENTRY_DSN` is set, and its hooks.
pub struct FailureReporter {
    sentry: Option<to_sentry::SentryOut>,
    hooks: hooks::Hooks,
    metrics: Arc<Metrics>,
}

impl FailureReporter {
    pub fn new(
        sentry: Option<to_sentry::SentryOut>,
        hooks: Vec<hooks::Hook>,
        metrics: Arc<Metrics>,
    ) -> FailureReporter {
        FailureReporter {
            sentry,
            hooks: hooks::Hooks::new(hooks, metrics.clone()),
            metrics,
        }
    }

    /// At a clean stop: let running hooks end (up to `wait`) and send what Sentry still has
    /// queued, so the failures of the last moments are not lost with the process.
    pub async fn close(&self, wait: Duration) {
        let deadline = Instant::now() + wait;
        while self.hooks.in_flight() > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if self.hooks.in_flight() > 0 {
            tracing::warn!(
                hooks = self.hooks.in_flight(),
                "failure hooks still running at exit: stopped"
            );
        }
        if let Some(s) = &self.sentry {
            if !s.flush().await {
                tracing::warn!("Sentry: some events could not be sent before exit");
            }
        }
    }
}

impl Reporter for FailureReporter {
    fn report(&self, r: Report) {
        if let Some(s) = &self.sentry {
            // The job as Sidekiq's error handlers see it: as fetched, for a failed run.
            let seen = r.fetched.as_deref().unwrap_or(&r.payload);
            let job: Value = serde_json::from_str(seen).unwrap_or_else(|_| Value::from(seen));
            let result = if s.send(&r, &job) {
                "sent"
            } else {
                "suppressed"
            };
            self.metrics.inc(
                "playguard_sentry_events_total",
                vec![
                    ("event", to_sentry::event_name(&r).to_string()),
                    ("result", result.to_string()),
                ],
            );
        }
        self.hooks.fire(&r);
    }
}

/// The report of a failed run: the entry written back (retry or dead) or, when nothing was
/// written, the payload as popped; `known`: whether a handler ran it.
pub fn failed_run(
    job: &Job,
    queue: &Arc<str>,
    error: Failure,
    decision: &Decision,
    known: bool,
) -> Report {
    let payload = match decision {
        Decision::Retry { payload, .. }
        | Decision::Dead { payload }
        | Decision::Schedule { payload, .. } => payload.clone(),
        Decision::Discard => job.raw.to_string(),
    };
    // Discarded by its exit code: dropped on purpose, no death (`job/retry_policy.rs`).
    let discarded = error.verdict == Some(retry::Verdict::Discard);
    Report {
        kind: Kind::Failure,
        died: !discarded && died(job, decision, known),
        queue: queue.clone(),
        payload,
        fetched: Some(job.raw.clone()),
        phase: error.phase.clone(),
        error,
    }
}

/// Whether the job died with this failure: it went to `dead`, or its last retry was used up
/// under `dead: false` (job_retry.rb runs the death handlers then too). Dropped under
/// `retry: false`, or as a class nobody runs without `retry`, it did not: nothing was tried.
fn died(job: &Job, decision: &Decision, known: bool) -> bool {
    let msg = job.msg();
    match decision {
        Decision::Dead { .. } => true,
        Decision::Retry { .. } | Decision::Schedule { .. } => false,
        Decision::Discard => {
            msg.get("dead") == Some(&Value::Bool(false))
                && retry::max_retries(msg).is_some()
                && (known || !matches!(msg.get("retry"), None | Some(Value::Null)))
        }
    }
}

/// The report of a payload buried as it came (not a job, or not one we can read): a death.
pub fn buried(queue: &Arc<str>, entry: &[u8], class: &str, message: &str) -> Report {
    Report {
        kind: Kind::Failure,
        died: true,
        queue: queue.clone(),
        payload: String::from_utf8_lossy(entry).into_owned(),
        fetched: None,
        error: Failure::new(class, message),
        phase: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn died_with(raw: &str, known: bool) -> bool {
        let job = Job::parse("default", raw.to_string()).unwrap();
        let f = Failure::new("E", "m");
        let d = if known {
            retry::decide(&job, &f)
        } else {
            retry::decide_unknown_class(&job, &f)
        };
        failed_run(&job, &"default".into(), f, &d, known).died
    }

    #[test]
    fn death_as_sidekiqs_death_handlers_see_it() {
        let base = r#""class":"X","args":[],"jid":"j""#;
        assert!(!died_with(&format!("{{{base},\"retry\":3}}"), true));
        assert!(died_with(&format!("{{{base},\"retry\":0}}"), true));
        // Exhausted under dead: false: dropped, but the death handlers still run.
        assert!(died_with(
            &format!("{{{base},\"retry\":0,\"dead\":false}}"),
            true
        ));
        // retry: false: nothing was tried, no death.
        assert!(!died_with(&format!("{{{base},\"retry\":false}}"), true));
        assert!(!died_with(
            &format!("{{{base},\"retry\":false,\"dead\":false}}"),
            true
        ));
        // A class nobody runs, without `retry`: dropped as job_retry.rb's global handler does.
        assert!(!died_with(&format!("{{{base},\"dead\":false}}"), false));
    }

    #[test]
    fn each_report_fires_its_hooks() {
        use hooks::On;
        let r = |kind, died| Report {
            kind,
            died,
            queue: "q".into(),
            payload: "{}".into(),
            fetched: None,
            error: Failure::new("E", "m"),
            phase: None,
        };
        assert_eq!(On::of(&r(Kind::Failure, false)), [On::Failure]);
        assert_eq!(On::of(&r(Kind::Failure, true)), [On::Failure, On::Death]);
        assert_eq!(On::of(&r(Kind::Poison, true)), [On::Poison, On::Death]);
        assert_eq!(On::of(&r(Kind::LockLost, false)), [On::LockLost]);
    }
}

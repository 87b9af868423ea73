//! A plain manifest job: one command per run, stopped by Sidekiq's cancel (`job/cancel.rs`).
//! Builds the PLAYGUARD_* environment that every command (plain or phase) receives. Keys:
//! `it-<jid>` (its cancel flag, read through `job/cancel.rs`).

use crate::commands::child::{self, Exit};
use crate::job::error_class;
use crate::job::handler::{BoxFuture, Handler, JobContext, Outcome};
use crate::job::retry::Failure;
use crate::job::retry_policy::Verdict;
use std::time::Duration;

/// Lock facts a phase command gets.
pub struct LockEnv<'a> {
    pub key: &'a str,
    pub fence: i64,
}

/// The PLAYGUARD_* environment (docs/configuration.md): job data reaches a command only through it and stdin.
pub fn job_env(
    ctx: &JobContext,
    phase: Option<&str>,
    lock: Option<LockEnv>,
) -> Vec<(String, String)> {
    let mut env = vec![
        ("PLAYGUARD_JID".to_string(), ctx.jid.to_string()),
        ("PLAYGUARD_CLASS".to_string(), ctx.class.to_string()),
        ("PLAYGUARD_QUEUE".to_string(), ctx.queue.to_string()),
        (
            "PLAYGUARD_ARGS".to_string(),
            serde_json::to_string(&ctx.args).unwrap_or_else(|_| "[]".into()),
        ),
        (
            "PLAYGUARD_RETRY_COUNT".to_string(),
            ctx.retry_count.map(|c| c.to_string()).unwrap_or_default(),
        ),
    ];
    if let Some(p) = phase {
        env.push(("PLAYGUARD_PHASE".into(), p.to_string()));
    }
    if let Some(l) = lock {
        env.push(("PLAYGUARD_LOCK_KEY".into(), l.key.to_string()));
        env.push(("PLAYGUARD_FENCE".into(), l.fence.to_string()));
    }
    env
}

/// Map a command's exit to a Failure (None on success). A plain command's exit code may ask
/// for a discard, a kill or a snooze (`job/retry_policy.rs`); a phase's never does.
pub fn exit_failure(exit: Exit) -> Option<Failure> {
    exit_failure_of(exit, false)
}

fn exit_failure_of(exit: Exit, contract: bool) -> Option<Failure> {
    match exit {
        Exit::Success => None,
        Exit::Failed {
            mut message,
            stderr_tail,
            code,
        } => {
            let verdict = match code.filter(|_| contract) {
                Some(c) => Verdict::of_exit(c, stderr_tail.last().map(String::as_str))
                    .unwrap_or_else(|why| {
                        message = why;
                        None
                    }),
                None => None,
            };
            Some(Failure {
                class: error_class::COMMAND_FAILED.into(),
                message,
                backtrace: stderr_tail.into_iter().rev().collect(),
                phase: None,
                verdict,
            })
        }
        Exit::Killed { why } => Some(Failure::new(error_class::TIMEOUT, why)),
        Exit::SpawnFailed(m) => Some(Failure::new(error_class::COMMAND_FAILED, m)),
        Exit::BadInput(m) => Some(Failure::new(crate::job::error_class::BAD_ARGUMENTS, m)),
    }
}

/// Run one of a job's commands: the job's payload on stdin, `env` as built by [`job_env`] on
/// top of the worker's variables named by `inherit` (None = all of them). `kill_by`: the
/// latest it may live even if this process freezes (a phase's lock), see [`child::Spec`].
pub async fn run_for(
    ctx: &JobContext,
    argv: &[String],
    inherit: Option<&[String]>,
    env: Vec<(String, String)>,
    kill_by: Option<tokio::time::Instant>,
    stop: impl std::future::Future<Output = child::Stop>,
) -> Exit {
    let spec = child::Spec {
        argv,
        env,
        inherit,
        stdin: ctx.payload.to_string(),
        keepalive: Some(ctx.liveness.liveness.clone()),
        kill_by,
    };
    child::run(spec, stop).await
}

pub struct CommandJob {
    pub argv: Vec<String>,
    pub timeout: Option<Duration>,
    /// The manifest's `env` allow-list (None = the worker's whole environment).
    pub inherit: Option<Vec<String>>,
}

impl Handler for CommandJob {
    fn stops_itself(&self) -> bool {
        true
    }

    fn perform(&self, ctx: JobContext) -> BoxFuture<'static, Outcome> {
        let argv = self.argv.clone();
        let timeout = self.timeout;
        let inherit = self.inherit.clone();
        Box::pin(async move {
            // Sidekiq's cancel (`it-<jid>`): before the start, then watched while it runs.
            if crate::job::cancel::cancelled_before_start(&ctx.redis, &ctx.jid).await {
                return Outcome::Done;
            }
            let watch = ctx.cancels.watch(&ctx.jid);
            let cancel = watch.signal();
            let env = job_env(&ctx, None, None);
            let shutdown = ctx.shutdown.clone();
            let lease = ctx.liveness.clone();
            let stop = async move {
                let limit = async {
                    match timeout {
                        Some(t) => tokio::time::sleep(t).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    // Recovery elsewhere may start once the alive key lapses: no grace.
                    _ = lease.lapse() => child::Stop::kill("liveness lease lapsed"),
                    _ = shutdown.hard_deadline() => child::Stop::term("shutdown deadline reached"),
                    // As a timeout: TERM to its group, KILL after the grace.
                    _ = cancel.cancelled() => child::Stop::term("cancelled"),
                    _ = limit => child::Stop::term(format!(
                        "timed out after {}s", timeout.unwrap_or_default().as_secs_f64())),
                }
            };
            let exit = run_for(&ctx, &argv, inherit.as_deref(), env, None, stop).await;
            // Stopped by us or by its guardian because our lease lapsed: back to the queue
            // (unless the sweep already took it), never a retry beside the recovered copy.
            if !matches!(exit, Exit::Success) && ctx.liveness.lapsed() {
                return Outcome::Requeue;
            }
            // Stopped by its cancel: done, never retried.
            if !matches!(exit, Exit::Success) && watch.is_cancelled() {
                tracing::info!("job cancelled: its command was stopped (no retry)");
                return Outcome::Done;
            }
            if matches!(exit, Exit::Killed { .. }) && ctx.shutdown.past_deadline() {
                return Outcome::Requeue;
            }
            match exit_failure_of(exit, true) {
                None => Outcome::Done,
                Some(f) => Outcome::Failed(f),
            }
        })
    }
}

//! Runs one fetched job to its end and writes the outcome: ack (batched, see `fetch/`),
//! retry (`retry` zset), dead (`dead` zset, trimmed), or requeue at shutdown (`queue:<q>`).
//! Outcome and ack land in one step (`fetch/mod.rs`, `settle`), so a crash never leaves a job
//! both retried and fetchable. Once written, a failure is handed to the worker's failure
//! reporter (`report/`).

use crate::fetch::unit_of_work::UnitOfWork;
use crate::job::error_class;
use crate::job::handler::{Handler, JobContext, Outcome};
use crate::job::options::NotRun;
use crate::job::payload::Job;
use crate::job::report::Reporter;
use crate::job::retry::{self, Decision, Failure};
use crate::metrics::prometheus::{JobEnd, JobFate};
use crate::process::liveness::JobLease;
use crate::process::slots::SlotEntry;
use crate::worker::Worker;
use futures::FutureExt;
use std::sync::Arc;
use std::time::Instant;

/// How long past the shutdown deadline a self-stopping job may take to report back.
pub const STOPS_ITSELF_GRACE: std::time::Duration = std::time::Duration::from_secs(8);

/// `started`: when the runner began with this job (its pace and the job's elapsed time).
///
/// Not an `async fn`: the payload is parsed before the future is built, and the future is the
/// run's own (or the boxed burial's), not one that also keeps room for the parse, the burial
/// and a copy of the run. Every job's task is built from it, so its size is copied per job.
pub fn process(
    worker: &Arc<Worker>,
    f: UnitOfWork,
    started: Instant,
) -> impl std::future::Future<Output = ()> + Send + '_ {
    use futures::future::Either;
    match parse(worker, &f) {
        Ok(job) => {
            let names = Names::of(&job);
            let tag = Arc::new(crate::logging::scope::JobTag {
                jid: names.jid.clone(),
                class: names.shown.clone(),
                queue: f.queue.clone(),
            });
            let lines = crate::logging::job_lines::JobLines::open(&tag);
            // Tracing on: the run is polled inside the job's span (`traces/job.rs`).
            let traced = crate::traces::on().then(|| traced(&job, &names)).flatten();
            let run = run_job(worker, f, job, names, lines, started);
            let run = crate::logging::scope::scoped(Some(tag), run);
            match traced {
                None => Either::Left(run),
                Some(cx) => Either::Right(Box::pin(crate::traces::within(cx, run)) as Boxed<'_>),
            }
        }
        Err((why, entry)) => Either::Right(Box::pin(async move {
            let entry = entry.as_deref().unwrap_or(&f.raw);
            bury_garbage(worker, &f, &why, entry).await
        }) as Boxed<'_>),
    }
}

type Boxed<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + 'a>>;

/// The job's span, child of its payload's `traceparent` (tracing on only).
fn traced(job: &Job, names: &Names) -> Option<opentelemetry::Context> {
    let names = crate::traces::JobNames {
        queue: &job.queue,
        jid: &names.jid,
        class: job.wrapped().unwrap_or(job.class()),
        retry_count: job.retry_count(),
    };
    crate::traces::job_span(names, &job.raw)
}

/// A job's names, each allocated once and shared by its slot, its context, its log lines and
/// the metrics.
struct Names {
    /// The class dispatched on.
    class: Arc<str>,
    /// The class shown (logs, Busy page, metrics).
    shown: Arc<str>,
    jid: Arc<str>,
}

impl Names {
    fn of(job: &Job) -> Names {
        let dispatch = job.dispatch_class();
        let class: Arc<str> = dispatch.into();
        let shown = match job.display_class_or(dispatch) {
            d if d == dispatch => class.clone(),
            d => d.into(),
        };
        Names {
            class,
            shown,
            jid: job.jid().into(),
        }
    }
}

/// The job, or why it is not one and what goes to the dead set (None: the payload as is).
fn parse(worker: &Worker, f: &UnitOfWork) -> Result<Job, (String, Option<Vec<u8>>)> {
    let limit = worker.config.max_payload_bytes;
    let parsed = if f.raw.len() > limit {
        Err(format!(
            "payload of {} bytes is over the limit of {limit} (--max-payload-bytes)",
            f.raw.len()
        ))
    } else {
        // One copy of the payload, shared from here on by the job, its context and its slot;
        // the unit of work keeps its bytes for the ack.
        match std::str::from_utf8(&f.raw) {
            Ok(text) => Job::parse(f.queue.clone(), text).map_err(|e| e.to_string()),
            Err(_) => Err("payload is not valid UTF-8".to_string()),
        }
    };
    let job = parsed.map_err(|e| (e, None))?;
    if let Err(e) = job.check() {
        // Readable, so it is kept with the reason (the Web UI shows it), the rest unchanged.
        let entry = crate::job::retry::dead_entry(&f.raw, error_class::INVALID_PAYLOAD, &e);
        let why = format!("{}: {e}", error_class::INVALID_PAYLOAD);
        return Err((why, Some(entry)));
    }
    Ok(job)
}

async fn run_job(
    worker: &Arc<Worker>,
    f: UnitOfWork,
    job: Job,
    names: Names,
    lines: crate::logging::job_lines::JobLines,
    started: Instant,
) {
    let Names { class, shown, jid } = names;
    let lease = JobLease {
        liveness: worker.liveness.clone(),
        epoch: f.epoch,
    };
    // Fetched before a lapse (a pop answered while we were frozen, say): the sweep may have
    // returned it and another process be running it. Hand it back (only if still ours).
    if lease.lapsed() {
        tracing::warn!(queue = %f.queue, "liveness lease lapsed since this job was fetched: not starting it");
        Box::pin(worker.fetch.requeue_logged(&f)).await;
        return;
    }
    if let Some(why) = crate::job::options::not_run(&job) {
        return Box::pin(not_run(worker, f, why, &shown, &jid)).await;
    }
    let run_at = wall_secs();
    let slot = Arc::new(worker.slots.begin(SlotEntry {
        queue: f.queue.clone(),
        payload: job.raw.clone(),
        run_at,
        jid: jid.clone(),
        class: shown.clone(),
        phase: None,
        started,
    }));
    lines.start();
    let handler = worker.registry.get(&class);
    let known = handler.is_some();
    let policy = handler.as_ref().and_then(|h| h.retry_policy());
    // sidekiq-unique-jobs (job/unique_jobs.rs): a lock another job holds may be the outcome.
    let unique = crate::job::unique_jobs::Unique::of(&job);
    let kept = crate::job::unique_jobs::before_if(&worker.conn, &job, unique.as_deref()).await;
    // The run and its first poll stay in this future (no async step of their own): a nested
    // future per job cost some 250 instructions and two copies of it (bench/profile.sh).
    let outcome = match (kept, handler) {
        (Some(Err(conflict)), _) => conflict,
        (_, None) => unknown_class(&class),
        (_, Some(h)) => {
            let ctx = context(worker, &f, &job, (jid, class.clone()), &lease, &slot);
            let (mut run, grace) = start(&*h, ctx);
            // The job first: one that is done at its first poll (most are) never arms the
            // deadline's and the lease's watchers (a timer and two subscriptions), nor makes
            // room for them in this future (which every job's task is built from).
            let first = std::future::poll_fn(|cx| {
                std::task::Poll::Ready(std::future::Future::poll(std::pin::Pin::new(&mut run), cx))
            })
            .await;
            match first {
                std::task::Poll::Ready(r) => caught(r),
                std::task::Poll::Pending => Box::pin(supervise(worker, &lease, run, grace)).await,
            }
        }
    };
    let took = started.elapsed();
    let ran = Ran {
        shown: &shown,
        known,
        policy: policy.as_deref(),
        took,
        // Rounded to 0.1 ms; logged as a number (JSON logs keep it numeric).
        elapsed_ms: (took.as_secs_f64() * 10_000.0).round() / 10.0,
    };
    let outcome = handed_back_if_lapsed(outcome, &lease);
    crate::job::unique_jobs::after_if(&worker.conn, unique.as_deref(), &outcome).await;
    trace_outcome(&outcome);
    record(worker, &job, &f.queue, &ran, &outcome, run_at);
    if let Some(write) = settle(worker, f, &job, outcome, &ran, &lease, lines) {
        write.await;
    }
    drop(slot);
}

/// The job span's status (traces/), when traces are exported.
fn trace_outcome(outcome: &Outcome) {
    if crate::traces::on() {
        let failure = match outcome {
            Outcome::Failed(e) => Some((&*e.class, &*e.message)),
            _ => None,
        };
        crate::traces::job_outcome(failure);
    }
}

/// Wall-clock seconds once, without a calendar (chrono's now() converts to one): `run_at`
/// and, with the run's monotonic length added, the Metrics minute the run ended in.
fn wall_secs() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// How a run went, for its metrics and its outcome's lines.
struct Ran<'a> {
    /// The class shown (logs, metrics).
    shown: &'a str,
    /// Whether a handler was registered for the class.
    known: bool,
    /// The class's own failure policy (`job/retry_policy.rs`).
    policy: Option<&'a crate::job::retry_policy::Policy>,
    took: std::time::Duration,
    elapsed_ms: f64,
}

/// The failure of a class nobody registered: what Ruby raises when constantize fails.
fn unknown_class(class: &str) -> Outcome {
    Outcome::Failed(Failure::new(
        error_class::NAME_ERROR,
        format!("uninitialized constant {class}"),
    ))
}

/// What the handler is told about its job. `names`: the jid and the class dispatched on.
fn context(
    worker: &Worker,
    f: &UnitOfWork,
    job: &Job,
    (jid, class): (Arc<str>, Arc<str>),
    lease: &JobLease,
    slot: &Arc<crate::process::slots::SlotGuard>,
) -> JobContext {
    JobContext {
        jid,
        class,
        queue: f.queue.clone(),
        args: job.dispatch_args(),
        retry_count: job.retry_count(),
        payload: job.raw.clone(),
        shutdown: worker.shutdown.clone(),
        redis: worker.conn.clone(),
        metrics: worker.metrics.clone(),
        db: worker.db.clone(),
        liveness: lease.clone(),
        locks_record: worker.locks_record.clone(),
        reporter: worker.reporter.clone(),
        cancels: worker.cancels.clone(),
        slot: Some(slot.clone()),
    }
}

/// The handler's run, and the time it has past a hard deadline or a lapse. A panic is caught
/// and becomes a failure (retried the Sidekiq way). At the hard deadline a Rust handler is
/// abandoned (its future dropped); command and phased jobs stop their process groups first
/// and report Requeue themselves, within the kill grace. No task of its own: the fetch loop
/// gives the job one only if it waits.
fn start(h: &dyn Handler, ctx: JobContext) -> (Run, std::time::Duration) {
    // Enough for the kill grace plus a lock release against a slow Redis (5 s reply
    // deadline): the lock must be released before the payload is pushed back.
    let grace = if h.stops_itself() {
        STOPS_ITSELF_GRACE
    } else {
        std::time::Duration::ZERO
    };
    // perform() itself runs inside the guard too: a closure may panic before its async block
    // starts. Its future is boxed already: the guard around it is not.
    let perform = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| h.perform(ctx)));
    let run: Run = match perform {
        Ok(fut) => std::panic::AssertUnwindSafe(fut).catch_unwind(),
        Err(p) => std::panic::AssertUnwindSafe(Box::pin(std::future::ready(Outcome::Failed(
            Failure::new(error_class::PANIC, panic_message(p)),
        )))
            as crate::job::handler::BoxFuture<'static, Outcome>)
        .catch_unwind(),
    };
    (run, grace)
}

/// A job that failed while our lease lapsed was most likely killed for it: it goes back
/// (LREM-guarded, so not beside a copy the sweep recovered), not into the retry set.
fn handed_back_if_lapsed(outcome: Outcome, lease: &JobLease) -> Outcome {
    match outcome {
        Outcome::Failed(f) if lease.lapsed() => {
            tracing::warn!(error = %f.message, "liveness lease lapsed while the job ran: stopped, handing it back");
            Outcome::Requeue
        }
        o => o,
    }
}

/// The run's Prometheus series and its Sidekiq Metrics-tab count (in the minute it ended).
fn record(worker: &Worker, job: &Job, queue: &str, ran: &Ran<'_>, outcome: &Outcome, run_at: i64) {
    let end = match outcome {
        Outcome::Done => JobEnd::Done,
        Outcome::Failed(_) => JobEnd::Failed,
        Outcome::Requeue => JobEnd::Requeued,
    };
    worker
        .metrics
        .job_finished(ran.shown, queue, end, ran.elapsed_ms / 1000.0);
    // Sidekiq's metrics middleware never sees a class whose constant lookup failed; a run
    // interrupted by shutdown counts as failed there (Sidekiq::Shutdown is an exception).
    if ran.known {
        let failed = !matches!(outcome, Outcome::Done);
        worker.job_metrics.record(
            run_at + ran.took.as_secs() as i64,
            crate::job::payload::class_of(job),
            failed,
            ran.took.as_millis() as u64,
        );
    }
}

/// The outcome's counters and lines; a done job is acknowledged here (batched), and what is
/// left to write to Redis (retry or dead with the ack, or the payload back on its queue) is
/// returned, boxed: the common path, done, builds no future.
fn settle<'a>(
    worker: &'a Worker,
    f: UnitOfWork,
    job: &Job,
    outcome: Outcome,
    ran: &Ran<'_>,
    lease: &JobLease,
    lines: crate::logging::job_lines::JobLines,
) -> Option<crate::job::handler::BoxFuture<'a, ()>> {
    let ms = ran.elapsed_ms;
    match outcome {
        Outcome::Done => {
            worker.slots.count(false);
            lines.done(ms);
            worker.fetch.acknowledge(f);
            None
        }
        Outcome::Failed(failure) => {
            worker.slots.count(true);
            let decision = if ran.known {
                retry::decide_with(job, &failure, ran.policy)
            } else {
                retry::decide_unknown_class(job, &failure)
            };
            let (fate, counted) = fate_of(&decision, &failure);
            if let Some(counted) = counted {
                worker.metrics.job_fate(ran.shown, &f.queue, counted);
            }
            if let Some(v) = failure.verdict {
                // Sidekiq 8.0 stamps `discarded_at` (ms) on a discarded job; nothing is kept
                // here, so the line carries it.
                let discarded_at =
                    (v == retry::Verdict::Discard).then(|| chrono::Utc::now().timestamp_millis());
                tracing::info!(elapsed_ms = ms, verdict = ?v, discarded_at, "{fate}");
                if matches!(decision, Decision::Schedule { .. } | Decision::Discard) {
                    let decision = Box::new(decision);
                    return Some(Box::pin(async move {
                        worker.fetch.settle(&f, decision.record()).await;
                    }));
                }
            }
            tracing::warn!(elapsed_ms = ms, error_class = %failure.class,
                error = %failure.message, "fail: {fate}");
            let report = crate::report::failed_run(job, &f.queue, failure, &decision, ran.known);
            // Reported once the outcome is written: a death is told once it happened, and not
            // at all when the job had left our working list (it runs again elsewhere).
            Some(Box::pin(async move {
                if worker.fetch.settle(&f, decision.record()).await || !report.died {
                    worker.reporter.report(report);
                }
            }))
        }
        Outcome::Requeue => {
            // As Sidekiq's hard shutdown: counted as processed and failed, pushed back once.
            worker.slots.count(true);
            if lease.lapsed() {
                tracing::info!(elapsed_ms = ms, "stopped: liveness lease lapsed");
                return Some(Box::pin(
                    async move { worker.fetch.requeue_logged(&f).await },
                ));
            }
            // Only a run the shutdown deadline cut short outlived -t; one that stopped in time
            // (a cycle at its phase boundary) goes back uncounted, so a rolling restart of more
            // processes than the limit cannot send it to dead.
            if !worker.shutdown.past_deadline() {
                tracing::info!(elapsed_ms = ms, "stopped in time by shutdown: requeued");
                return Some(Box::pin(
                    async move { worker.fetch.requeue_logged(&f).await },
                ));
            }
            Some(interrupted(worker, f, job, ms))
        }
    }
}

/// What a failed job's line says it came to, and the fate it is counted as (none: snoozed).
fn fate_of(decision: &Decision, failure: &Failure) -> (&'static str, Option<JobFate>) {
    match decision {
        Decision::Retry { .. } => ("retry scheduled", Some(JobFate::Retried)),
        Decision::Dead { .. }
            if failure.verdict == Some(retry::Verdict::Kill)
                && failure.class == crate::job::unique_jobs::CONFLICT =>
        {
            ("on_conflict reject: moved to dead", Some(JobFate::Dead))
        }
        Decision::Dead { .. } if failure.verdict == Some(retry::Verdict::Kill) => (
            "killed by its exit code: moved to dead",
            Some(JobFate::Dead),
        ),
        Decision::Dead { .. } => ("retries exhausted: moved to dead", Some(JobFate::Dead)),
        Decision::Discard if failure.verdict == Some(retry::Verdict::Discard) => {
            ("discarded by its exit code", Some(JobFate::Discarded))
        }
        Decision::Discard => (
            "discarded (retry: false or dead: false)",
            Some(JobFate::Discarded),
        ),
        // Not a failure: no retry counted, so no fate either.
        Decision::Schedule { .. } => ("snoozed: back to schedule", None),
    }
}

/// A job its Pro or Enterprise options keep from running (`job/options.rs`): expired, it is
/// dropped with one line; with an option playguard refuses, it goes to dead as
/// `Playguard::Unsupported` (whatever its `retry` and `dead`: the job is kept for a Ruby process).
async fn not_run(worker: &Worker, f: UnitOfWork, why: NotRun, shown: &str, jid: &str) {
    let why = match why {
        NotRun::Expired(at) => {
            worker.slots.count(false);
            tracing::info!("job {jid} expired (expires_at {at}): dropped, not run");
            return worker.fetch.acknowledge(f);
        }
        NotRun::Refused(why) => why,
    };
    worker.slots.count(true);
    worker.metrics.job_fate(shown, &f.queue, JobFate::Dead);
    tracing::error!(
        error_class = error_class::UNSUPPORTED,
        "job {jid} not run: {why}"
    );
    let entry = retry::dead_entry(&f.raw, error_class::UNSUPPORTED, &why);
    if worker.fetch.settle(&f, retry::Record::Dead(&entry)).await {
        let report = crate::report::buried(&f.queue, &entry, error_class::UNSUPPORTED, &why);
        worker.reporter.report(report);
    }
}

/// A run its shutdown interrupted: back on its queue with its count raised, or, past the
/// limit, to dead (`job/interrupted.rs`).
fn interrupted<'a>(
    worker: &'a Worker,
    f: UnitOfWork,
    job: &Job,
    ms: f64,
) -> crate::job::handler::BoxFuture<'a, ()> {
    use crate::job::interrupted::{on_shutdown, Interrupted};
    match on_shutdown(job, worker.config.max_interruptions) {
        Interrupted::Requeue(instead) => {
            tracing::info!(elapsed_ms = ms, "interrupted by shutdown: requeued");
            Box::pin(async move { worker.fetch.requeue_as_logged(&f, Some(instead)).await })
        }
        Interrupted::Settle(decision) => {
            tracing::warn!(
                elapsed_ms = ms,
                error_class = error_class::INTERRUPTED,
                max = worker.config.max_interruptions,
                "interrupted by shutdown too often: {}",
                if decision == Decision::Discard {
                    "dropped (dead: false)"
                } else {
                    "moved to dead"
                }
            );
            let failure = Failure::new(
                error_class::INTERRUPTED,
                "interrupted by shutdown too often",
            );
            let report = crate::report::failed_run(job, &f.queue, failure, &decision, true);
            Box::pin(async move {
                if worker.fetch.settle(&f, decision.record()).await {
                    worker.reporter.report(report);
                }
            })
        }
    }
}

/// A handler's run, panics caught.
type Run = futures::future::CatchUnwind<
    std::panic::AssertUnwindSafe<crate::job::handler::BoxFuture<'static, Outcome>>,
>;

fn caught(r: std::thread::Result<Outcome>) -> Outcome {
    match r {
        Ok(o) => o,
        Err(p) => Outcome::Failed(Failure::new(error_class::PANIC, panic_message(p))),
    }
}

/// A run that did not finish at its first poll, until it ends, the hard deadline comes or the
/// liveness lease lapses; after either of those it has `grace` left (else: Requeue).
async fn supervise(
    worker: &Worker,
    lease: &JobLease,
    mut run: Run,
    grace: std::time::Duration,
) -> Outcome {
    tokio::select! {
        biased;
        r = &mut run => caught(r),
        _ = worker.shutdown.hard_deadline() => {
            match tokio::time::timeout(grace, &mut run).await {
                Ok(r) => caught(r),
                Err(_) => Outcome::Requeue,
            }
        }
        // Our alive key may lapse soon and the job be recovered: stop it now (command
        // and phased jobs kill their groups themselves; a Rust handler is abandoned).
        _ = lease.lapse() => {
            match tokio::time::timeout(grace, &mut run).await {
                Ok(r) => caught(r),
                Err(_) => Outcome::Requeue,
            }
        }
    }
}

/// Most payload characters a log line about a bad payload shows.
const SHOWN_PAYLOAD_CHARS: usize = 1000;

/// A payload that is not a job goes to `dead`: one that is not a JSON object as the raw string,
/// as processor.rb does (`entry` is then `f.raw`), a readable one with the reason.
async fn bury_garbage(worker: &Worker, f: &UnitOfWork, why: &str, entry: &[u8]) {
    let shown = f.payload_lossy();
    let cut = shown.chars().count() > SHOWN_PAYLOAD_CHARS;
    let shown: String = shown.chars().take(SHOWN_PAYLOAD_CHARS).collect();
    tracing::error!(queue = %f.queue, error = why, bytes = f.raw.len(), payload = %shown,
        "invalid job payload: moved to the dead set{}{}",
        if entry == &f.raw[..] { " as is" } else { "" },
        if cut { " (payload cut in this line)" } else { "" });
    worker.metrics.garbage(&f.queue);
    if !worker.fetch.settle(f, retry::Record::Dead(entry)).await {
        return;
    }
    let class = error_class::INVALID_PAYLOAD;
    let why = why
        .strip_prefix(class)
        .map_or(why, |w| w.trim_start_matches(": "));
    worker
        .reporter
        .report(crate::report::buried(&f.queue, entry, class, why));
}

fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        format!("panic: {s}")
    } else if let Some(s) = p.downcast_ref::<String>() {
        format!("panic: {s}")
    } else {
        "panic".to_string()
    }
}

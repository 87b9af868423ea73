//! Fetching: the loop that keeps every free slot fed, in Sidekiq's strict / weighted queue
//! order (`job/queues.rs`). While the queues are busy it takes a batch for the free slots in one
//! round trip; when they are empty it arms the blocking pops (`fetch/blocking.rs`) and waits. How a
//! job is taken, acknowledged, requeued and drained is the fetch strategy's business
//! (`fetch/`: reliable or basic); this loop never asks which one runs. The loop itself is
//! `fetch_loop.rs`; here are its pace (how long recent jobs took), the inline run of cheap jobs
//! and the credits it fetches against. Keys: those of the strategy.

mod fetch_loop;
pub mod processor;

pub use fetch_loop::run;

use crate::worker::Worker;
use std::time::Duration;

/// Jobs are short while their recent mean run time is under this; only then does the loop
/// fetch the next batch while the current one runs (see `Pace`).
const SHORT_JOB_MICROS: u64 = 2_000;
/// Jobs are cheap while their recent mean run time is under this: only then does the loop run
/// them itself (`run_or_spawn`). Over it, a task each costs little beside the job, and lets a
/// handler that burns CPU run on every core instead of one job after another on the loop's
/// thread. A no-op job's whole run takes a few microseconds. The hidden
/// `PLAYGUARD_INLINE_JOB_MICROS` scales it for a worker that runs slower as a whole: under
/// callgrind (`bench/profile.sh`) every job takes about 100 times as long.
const INLINE_JOB_MICROS: u64 = 50;

fn inline_job_micros() -> u64 {
    static MICROS: std::sync::LazyLock<u64> = std::sync::LazyLock::new(|| {
        std::env::var("PLAYGUARD_INLINE_JOB_MICROS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(INLINE_JOB_MICROS)
    });
    *MICROS
}

/// The recent mean run time of this process's jobs (an exponential average over about the
/// last 16), starting at one second: a process assumes long jobs until it has seen short ones.
pub(super) struct Pace(std::sync::atomic::AtomicU64);

impl Default for Pace {
    fn default() -> Pace {
        Pace(std::sync::atomic::AtomicU64::new(1_000_000))
    }
}

impl Pace {
    pub(super) fn record(&self, took: Duration) {
        use std::sync::atomic::Ordering::Relaxed;
        let x = took.as_micros().min(u64::MAX as u128) as u64;
        let old = self.0.load(Relaxed);
        // A lost update under a race only skews the average a little.
        self.0.store(old - old / 16 + x / 16, Relaxed);
    }

    pub(super) fn short(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Relaxed) < SHORT_JOB_MICROS
    }

    pub(super) fn cheap(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Relaxed) < inline_job_micros()
    }
}

/// How many jobs a process may hold fetched beyond its slots, while jobs are short: one more
/// batch of `concurrency`. A fetched job waits for a slot in our working list (reliable) or in
/// memory (basic), so with long jobs (a reconcile cycle) nothing is fetched ahead: another
/// process with a free slot must get it.
fn fetch_ahead(concurrency: usize) -> usize {
    concurrency
}

/// While recent jobs are cheap (`inline`), run a job's future here as far as it goes without
/// waiting, and give it a task of its own only if it waits. Most such jobs end at their first
/// poll (a Rust handler with nothing to await), and a task per job (its allocation, its
/// scheduling, the other thread woken to steal it) cost more than such a job itself. One that
/// waits is spawned: tokio polls it again with its own waker, so the wake this poll registered
/// for the loop is only a spurious one. A panic is contained as a task's would be: the future
/// is dropped and the loop goes on (with reliable fetch the job stays in our working list,
/// drained back to its queue at our stop). Jobs that are not cheap are spawned at once, so
/// their CPU work spreads over tokio's threads. Runs under the loop's root span; the job's own
/// context is its log scope (`logging/scope.rs`).
pub(super) async fn run_or_spawn(
    mut run: std::pin::Pin<Box<impl std::future::Future<Output = ()> + Send + 'static>>,
    inline: bool,
) {
    use std::task::Poll;
    if !inline {
        spawn_run(run);
        return;
    }
    let first = std::future::poll_fn(|cx| {
        Poll::Ready(std::panic::catch_unwind(std::panic::AssertUnwindSafe(
            || run.as_mut().poll(cx),
        )))
    })
    .await;
    match first {
        Ok(Poll::Ready(())) => {}
        // Under the root span, as this loop runs (a task does not inherit it).
        Ok(Poll::Pending) => spawn_run(run),
        Err(_) => tracing::error!(
            "a job's run panicked outside its handler: dropped (reliable fetch keeps the job in the working list until this process stops)"
        ),
    }
}

/// A job's run on a task of its own, under the root span as this loop runs (a task does not
/// inherit it). A panic ends only the task.
fn spawn_run(run: std::pin::Pin<Box<impl std::future::Future<Output = ()> + Send + 'static>>) {
    tokio::spawn(tracing::Instrument::instrument(
        run,
        crate::logging::root().clone(),
    ));
}

/// The credits a process fetches against: its slots, plus one batch ahead where a fetched job
/// waits in our working list (reliable fetch). Basic fetch holds popped jobs only in memory,
/// so it fetches only for free slots, as Sidekiq's one BRPOP per thread does.
pub fn credits(worker: &Worker) -> usize {
    let c = worker.config.concurrency;
    c + if worker.liveness.is_kept() {
        fetch_ahead(c)
    } else {
        0
    }
}

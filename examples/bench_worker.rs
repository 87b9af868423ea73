//! The benchmark worker: the full playguard CLI with three Rust handlers registered.
//! Run with: `cargo build --release --example bench_worker`, then
//! `target/release/examples/bench_worker -r redis://127.0.0.1:PORT/0 -q bench -c 25`.
//!
//! - `NoopJob` does nothing (throughput: everything measured is fetch, bookkeeping and ack).
//! - `LatencyJob` takes one argument, the enqueue time in epoch microseconds, and RPUSHes
//!   `now - enqueued` (microseconds) to `bench:latency`, so the driver can read pick-up delays.
//!   With the time a scheduled job was due as its argument, it records the job's lateness.
//! - `CpuJob` burns its first argument's microseconds (200 when absent) of its thread's CPU
//!   time, as bench/ruby_jobs.rb's CpuJob does in Ruby: a handler that computes and never waits.

use playguard::{Failure, Registry};
use std::time::Duration;

/// mimalloc, not glibc's malloc: a job's few short-lived buffers are allocated on one tokio
/// thread and often freed on another, which glibc serves with arena locks and consolidation
/// (a quarter of the worker's instructions per job under callgrind).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let mut registry = Registry::new();
    registry.register_fn("NoopJob", |_ctx| async { Ok(()) });
    registry.register_fn("LatencyJob", |ctx| async move {
        let now_us = chrono::Utc::now().timestamp_micros();
        let sent = ctx.args.first().and_then(|v| v.as_i64()).unwrap_or(now_us);
        let mut conn = ctx.redis.clone();
        redis::cmd("RPUSH")
            .arg("bench:latency")
            .arg(now_us - sent)
            .query_async::<i64>(&mut conn)
            .await
            .map(|_| ())
            .map_err(|e| Failure::new("Redis::BaseError", e.to_string()))
    });
    registry.register_fn("CpuJob", |ctx| {
        let us = ctx.args.first().and_then(|v| v.as_u64()).unwrap_or(200);
        async move {
            burn_cpu(Duration::from_micros(us));
            Ok(())
        }
    });
    std::process::exit(playguard::cli::main_with(registry));
}

/// This thread's CPU time: a spin measured by it costs the same CPU however often the thread
/// is preempted (a wall-clock spin would not).
fn thread_cpu() -> Duration {
    let mut ts = nix::libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec, which `ts` is, and reads nothing else.
    let rc = unsafe { nix::libc::clock_gettime(nix::libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Spin until `amount` of this thread's CPU time has passed.
fn burn_cpu(amount: Duration) {
    let end = thread_cpu() + amount;
    while thread_cpu() < end {
        std::hint::spin_loop();
    }
}

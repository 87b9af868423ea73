//! The benchmark worker: the full playguard CLI with two Rust handlers registered.
//! Run with: `cargo build --release --example bench_worker`, then
//! `target/release/examples/bench_worker -r redis://127.0.0.1:PORT/0 -q bench -c 25`.
//!
//! - `NoopJob` does nothing (throughput: everything measured is fetch, bookkeeping and ack).
//! - `LatencyJob` takes one argument, the enqueue time in epoch microseconds, and RPUSHes
//!   `now - enqueued` (microseconds) to `bench:latency`, so the driver can read pick-up delays.

use playguard::{Failure, Registry};

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
    std::process::exit(playguard::cli::main_with(registry));
}

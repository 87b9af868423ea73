//! Round-trip cost of the token lock against a private redis-server, and proof that each
//! operation is a single client command (one EVALSHA). Then the cost the PostgreSQL fence
//! store adds per acquisition (ledger row; database fence) and per renewal (fence check),
//! against a private PostgreSQL cluster. Redis keys: `bench:lock:<i>`, `bench:lock:<i>:fence`,
//! `bench:<mode>:<i>` (+ `:fence`), in a redis-server this program starts and stops. Tables:
//! `playguard_fences`, `playguard_cycles`, in a cluster it creates and stops.
//!
//! Run with `cargo bench --bench lock` (`BENCH_N=...` to change the 10000 operations per kind).

#[path = "../tests/support/mod.rs"]
mod support;

use playguard::db::Db;
use playguard::fence_store::{hold, FenceSource, Held};
use playguard::lock::{acquire, Lease};
use playguard::redis_conn::shared;
use playguard::redis_conn::Conn as MultiplexedConnection;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// `cmdstat_<name>` -> calls, from `INFO commandstats`.
async fn command_calls(conn: &MultiplexedConnection) -> BTreeMap<String, u64> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    info.lines()
        .filter_map(|l| {
            let (name, rest) = l.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest.split(',').find_map(|f| f.strip_prefix("calls="))?;
            Some((name.to_owned(), calls.parse().ok()?))
        })
        .collect()
}

fn delta(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    after
        .iter()
        .filter(|(name, _)| name.as_str() != "info")
        .map(|(name, n)| (name.clone(), n - before.get(name).copied().unwrap_or(0)))
        .filter(|(_, d)| *d > 0)
        .collect()
}

/// Timing only: for steps that send no Redis command.
fn report_time(op: &str, n: usize, mut samples: Vec<Duration>) -> f64 {
    samples.sort();
    let total: Duration = samples.iter().sum();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let mean = us(total) / n as f64;
    println!(
        "{op:<28} n={n}  mean {mean:7.1} us/op  p50 {:7.1} us  p99 {:7.1} us",
        us(samples[n / 2]),
        us(samples[n * 99 / 100])
    );
    mean
}

fn report(op: &str, n: usize, mut samples: Vec<Duration>, calls: &BTreeMap<String, u64>) {
    samples.sort();
    let total: Duration = samples.iter().sum();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let mean = us(total) / n as f64;
    let p50 = us(samples[n / 2]);
    let p99 = us(samples[n * 99 / 100]);
    let evalsha = calls.get("evalsha").copied().unwrap_or(0);
    println!(
        "{op:<8} n={n}  mean {mean:7.1} us/op  p50 {p50:7.1} us  p99 {p99:7.1} us  \
         evalsha/op {:.3}  server-side commands: {calls:?}",
        evalsha as f64 / n as f64
    );
    assert_eq!(evalsha, n as u64, "{op}: exactly one EVALSHA per operation");
    for client_cmd in ["eval", "script", "evalsha_ro", "eval_ro"] {
        assert!(
            !calls.contains_key(client_cmd),
            "{op}: unexpected {client_cmd} calls: {calls:?}"
        );
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    // `cargo bench` passes `--bench`; nothing here takes arguments.
    let n: usize = std::env::var("BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let redis = support::RedisServer::start();
    let conn = shared(&redis.client()).await.unwrap();
    let ttl = Duration::from_secs(120);

    // Warm-up: the first call of each script pays NOSCRIPT + SCRIPT LOAD.
    let mut warm = acquire(&conn, "bench:warm", ttl).await.unwrap().unwrap();
    warm.renew().await.unwrap();
    assert!(warm.release().await.unwrap());

    let before = command_calls(&conn).await;
    let mut leases: Vec<Lease> = Vec::with_capacity(n);
    let mut samples = Vec::with_capacity(n);
    for i in 0..n {
        let t = Instant::now();
        let lease = acquire(&conn, &format!("bench:lock:{i}"), ttl)
            .await
            .unwrap();
        samples.push(t.elapsed());
        leases.push(lease.expect("free key"));
    }
    report(
        "acquire",
        n,
        samples,
        &delta(&before, &command_calls(&conn).await),
    );

    let before = command_calls(&conn).await;
    let mut samples = Vec::with_capacity(n);
    for lease in leases.iter_mut() {
        let t = Instant::now();
        lease.renew().await.unwrap();
        samples.push(t.elapsed());
    }
    report(
        "renew",
        n,
        samples,
        &delta(&before, &command_calls(&conn).await),
    );

    let before = command_calls(&conn).await;
    let mut samples = Vec::with_capacity(n);
    for lease in &leases {
        let t = Instant::now();
        assert!(lease.release().await.unwrap());
        samples.push(t.elapsed());
    }
    report(
        "release",
        n,
        samples,
        &delta(&before, &command_calls(&conn).await),
    );

    // The PostgreSQL fence store: what it adds to each acquisition and renewal.
    let pg = support::PostgresServer::start();
    let db = Db::new(&pg.url(), "bench").unwrap();
    db.ensure_schema().await.unwrap();
    let mut redis_renew = Vec::with_capacity(n);
    for (mode, source) in [
        ("redis", FenceSource::Redis),
        ("database", FenceSource::Database),
    ] {
        let mut held: Vec<Held> = Vec::with_capacity(n);
        let mut samples = Vec::with_capacity(n);
        for i in 0..n {
            let lease = acquire(&conn, &format!("bench:{mode}:{i}"), ttl)
                .await
                .unwrap()
                .expect("free key");
            let t = Instant::now();
            let h = hold(lease, source, Some(&db), "bench-jid")
                .await
                .unwrap_or_else(|(_, e)| panic!("hold: {e}"));
            samples.push(t.elapsed());
            held.push(h);
        }
        let what = match source {
            FenceSource::Redis => "+ ledger row (fence=redis)",
            FenceSource::Database => "+ db fence & ledger row",
        };
        report_time(&format!("acquire {what}"), n, samples);

        let mut samples = Vec::with_capacity(n);
        for h in held.iter_mut() {
            let t = Instant::now();
            h.renew().await.unwrap();
            samples.push(t.elapsed());
        }
        if source == FenceSource::Redis {
            redis_renew = samples.clone();
        }
        let mean = report_time(&format!("renew, fence={mode}"), n, samples);
        if source == FenceSource::Database {
            let base = redis_renew.iter().sum::<Duration>().as_secs_f64() * 1e6 / n as f64;
            println!(
                "{:<28} {:+.1} us/op over fence=redis",
                "renew: added by db check",
                mean - base
            );
        }
        for h in &held {
            assert!(h.release().await.unwrap());
        }
    }
}

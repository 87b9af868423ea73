//! A Rust handler that burns CPU runs on every tokio thread, not one job after another on the
//! fetch loop's thread (`manager/mod.rs`, `run_or_spawn`). In-process against a redis-server
//! this test owns; keys: `queue:default` and the worker's own.
mod support;

use playguard::config::Config;
use playguard::shutdown::Shutdown;
use playguard::Registry;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::*;

const JOBS: usize = 400;
/// Jobs before this one may still run while the worker learns how long its jobs take.
const SETTLED: usize = 200;

/// Counts running handlers and the most seen at once among the jobs after `SETTLED`.
#[derive(Default)]
struct Overlap {
    running: AtomicUsize,
    started: AtomicUsize,
    finished: AtomicUsize,
    most_after_settled: AtomicUsize,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cpu_bound_handlers_run_side_by_side_on_both_threads() {
    let redis = RedisServer::start();
    let seen = Arc::new(Overlap::default());
    let mut registry = Registry::new();
    let s = seen.clone();
    registry.register_fn("Burn", move |_ctx| {
        let s = s.clone();
        async move {
            let n = s.started.fetch_add(1, SeqCst);
            let now = s.running.fetch_add(1, SeqCst) + 1;
            if n >= SETTLED {
                s.most_after_settled.fetch_max(now, SeqCst);
            }
            // 1 ms of work that never yields, as a parse or a render would.
            let t = Instant::now();
            while t.elapsed() < Duration::from_millis(1) {
                std::hint::spin_loop();
            }
            s.running.fetch_sub(1, SeqCst);
            s.finished.fetch_add(1, SeqCst);
            Ok(())
        }
    });
    let mut conn = redis.conn();
    for _ in 0..JOBS {
        let job = serde_json::json!({"class": "Burn", "args": [], "queue": "default",
            "jid": playguard::test_support::new_jid(), "retry": false,
            "created_at": 1.0, "enqueued_at": 1.0});
        let _: () = redis::cmd("LPUSH")
            .arg("queue:default")
            .arg(job.to_string())
            .query(&mut conn)
            .unwrap();
    }
    let shutdown = Shutdown::new();
    let config = Config {
        redis_url: redis.url(),
        jobs_dir: "no-such-dir".into(),
        concurrency: 10,
        ..Config::default()
    };
    let worker = tokio::spawn(playguard::launcher::run_with(
        config,
        registry,
        shutdown.clone(),
        playguard::launcher::Signals::Ignore,
    ));
    let deadline = Instant::now() + Duration::from_secs(60);
    while seen.finished.load(SeqCst) < JOBS {
        assert!(Instant::now() < deadline, "jobs did not all finish");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.stop(Duration::from_secs(5));
    tokio::time::timeout(Duration::from_secs(15), worker)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let most = seen.most_after_settled.load(SeqCst);
    assert!(
        most >= 2,
        "CPU-bound jobs ran one at a time once the worker knew their length (most at once: {most})"
    );
}

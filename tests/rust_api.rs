//! The library API for embedders: Rust handlers and Rust-phased cycles, run in-process against
//! a redis-server this test owns, stopped through the shutdown handle.
mod support;

use playguard::config::Config;
use playguard::reconcile::Cycle;
use playguard::shutdown::Shutdown;
use playguard::{Failure, Registry};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use support::*;

fn config(redis: &RedisServer) -> Config {
    Config {
        redis_url: redis.url(),
        jobs_dir: "no-such-dir".into(),
        ..Config::default()
    }
}

type Running = tokio::task::JoinHandle<Result<(), playguard::launcher::StartError>>;

/// The worker in-process with `registry`, stopped only through its shutdown handle.
fn start(redis: &RedisServer, registry: Registry) -> (Shutdown, Running) {
    let shutdown = Shutdown::new();
    let worker = tokio::spawn(playguard::launcher::run_with(
        config(redis),
        registry,
        shutdown.clone(),
        playguard::launcher::Signals::Ignore,
    ));
    (shutdown, worker)
}

/// A clean stop, within its deadline.
async fn stop(shutdown: &Shutdown, worker: Running) {
    shutdown.stop(Duration::from_secs(5));
    tokio::time::timeout(Duration::from_secs(15), worker)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

fn push(redis: &RedisServer, class: &str, args: serde_json::Value) {
    let job = serde_json::json!({"class": class, "args": args, "jid": playguard::test_support::new_jid(),
        "queue": "default", "retry": 1, "created_at": 1.0, "enqueued_at": 1.0});
    let _: () = redis::cmd("LPUSH")
        .arg("queue:default")
        .arg(job.to_string())
        .query(&mut redis.conn())
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rust_handlers_and_rust_phases_run_and_a_panicking_phase_releases_its_lock() {
    let redis = RedisServer::start();
    let seen = Arc::new(Mutex::new(Vec::<String>::new()));
    let mut registry = Registry::new();
    let s = seen.clone();
    registry.register_fn("Greeter", move |ctx| {
        let s = s.clone();
        async move {
            s.lock().unwrap().push(format!("hello {}", ctx.args[0]));
            Ok(())
        }
    });
    let s1 = seen.clone();
    let s2 = seen.clone();
    let cycle = Cycle::new("rust:marquee:{args.0}", Duration::from_secs(30))
        .phase_fn("one", move |p| {
            let s = s1.clone();
            async move {
                s.lock()
                    .unwrap()
                    .push(format!("one {} fence {}", p.args[0], p.fence));
                Ok(())
            }
        })
        .phase_fn("two", move |p| {
            let s = s2.clone();
            async move {
                if p.args[0] == "boom" {
                    panic!("phase two exploded");
                }
                s.lock().unwrap().push(format!("two {}", p.args[0]));
                Err::<(), _>(Failure::new("Nope", "never")).or(Ok(()))
            }
        });
    registry.register("RustCycle", cycle);

    let (shutdown, worker) = start(&redis, registry);
    push(&redis, "Greeter", serde_json::json!(["world"]));
    push(&redis, "RustCycle", serde_json::json!(["m1"]));
    push(&redis, "RustCycle", serde_json::json!(["boom"]));
    let seen2 = seen.clone();
    tokio::task::spawn_blocking(move || {
        wait_until("handlers ran", Duration::from_secs(20), || {
            let v = seen2.lock().unwrap();
            v.contains(&"hello \"world\"".to_string()) && v.iter().any(|l| l == "two \"m1\"")
        })
    })
    .await
    .unwrap();
    let mut c = redis.conn();
    let r2 = redis.url();
    tokio::task::spawn_blocking(move || {
        let redis_c = redis::Client::open(r2).unwrap();
        let mut c = redis_c.get_connection().unwrap();
        wait_until(
            "the panicking cycle was retried",
            Duration::from_secs(20),
            || {
                redis::cmd("ZCARD")
                    .arg("retry")
                    .query::<i64>(&mut c)
                    .unwrap()
                    == 1
            },
        )
    })
    .await
    .unwrap();
    let retry: Vec<String> = redis::cmd("ZRANGE")
        .arg("retry")
        .arg(0)
        .arg(-1)
        .query(&mut c)
        .unwrap();
    assert!(retry[0].contains("Playguard::Panic"), "{retry:?}");
    let locked: bool = redis::cmd("EXISTS")
        .arg("rust:marquee:boom")
        .query(&mut c)
        .unwrap();
    assert!(!locked, "the panicking cycle released its lock");
    stop(&shutdown, worker).await;
    let procs: Vec<String> = redis::cmd("SMEMBERS")
        .arg("processes")
        .query(&mut c)
        .unwrap();
    assert!(
        procs.is_empty(),
        "clean stop left the process set: {procs:?}"
    );
}

/// A Rust handler that panics, in its closure (before its future exists) or in its future,
/// fails that job the Sidekiq way (retried, `Playguard::Panic` and the message) and nothing
/// else: the worker goes on running the jobs after it, which run at their first poll in the
/// fetch loop itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_rust_handler_fails_its_job_and_the_worker_goes_on() {
    let redis = RedisServer::start();
    let seen = Arc::new(Mutex::new(Vec::<String>::new()));
    let mut registry = Registry::new();
    registry.register_fn("PanicsBefore", |ctx| {
        if !ctx.args.is_empty() {
            panic!("before its future: {}", ctx.args[0]);
        }
        async { Ok(()) }
    });
    registry.register_fn("PanicsInside", |ctx| async move {
        panic!("inside its future: {}", ctx.args[0]);
    });
    let s = seen.clone();
    registry.register_fn("After", move |ctx| {
        let s = s.clone();
        async move {
            s.lock().unwrap().push(ctx.args[0].to_string());
            Ok(())
        }
    });
    let (shutdown, worker) = start(&redis, registry);
    push(&redis, "PanicsBefore", serde_json::json!(["a"]));
    push(&redis, "PanicsInside", serde_json::json!(["b"]));
    push(&redis, "After", serde_json::json!(["c"]));
    let r = redis.url();
    let retry = tokio::task::spawn_blocking(move || {
        let mut c = redis::Client::open(r).unwrap().get_connection().unwrap();
        wait_until("both panics retried", Duration::from_secs(20), || {
            redis::cmd("ZCARD")
                .arg("retry")
                .query::<i64>(&mut c)
                .unwrap()
                == 2
        });
        redis::cmd("ZRANGE")
            .arg("retry")
            .arg(0)
            .arg(-1)
            .query::<Vec<String>>(&mut c)
            .unwrap()
    })
    .await
    .unwrap();
    let retry = retry.join("\n");
    for want in [
        "before its future: \\\"a\\\"",
        "inside its future: \\\"b\\\"",
    ] {
        assert!(retry.contains(want), "{want} in {retry}");
    }
    assert_eq!(retry.matches("Playguard::Panic").count(), 2, "{retry}");
    let s = seen.clone();
    tokio::task::spawn_blocking(move || {
        wait_until("the job after them ran", Duration::from_secs(20), || {
            s.lock().unwrap().iter().any(|l| l == "\"c\"")
        })
    })
    .await
    .unwrap();
    stop(&shutdown, worker).await;
}

/// A Rust handler that burns CPU runs on both tokio threads, not one job after another on the
/// fetch loop's thread (`manager/mod.rs`, `run_or_spawn`): once the worker has seen how long
/// its jobs take, two of these 1 ms jobs run at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cpu_bound_handlers_run_side_by_side_on_both_threads() {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    const JOBS: usize = 400;
    // Jobs before this one may still run while the worker learns how long its jobs take.
    const SETTLED: usize = 200;
    #[derive(Default)]
    struct Overlap {
        started: AtomicUsize,
        running: AtomicUsize,
        finished: AtomicUsize,
        most_after_settled: AtomicUsize,
    }
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
            let t = std::time::Instant::now();
            while t.elapsed() < Duration::from_millis(1) {
                std::hint::spin_loop();
            }
            s.running.fetch_sub(1, SeqCst);
            s.finished.fetch_add(1, SeqCst);
            Ok(())
        }
    });
    for _ in 0..JOBS {
        push(&redis, "Burn", serde_json::json!([]));
    }
    let (shutdown, worker) = start(&redis, registry);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while seen.finished.load(SeqCst) < JOBS {
        assert!(
            std::time::Instant::now() < deadline,
            "jobs did not all finish"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop(&shutdown, worker).await;
    let most = seen.most_after_settled.load(SeqCst);
    assert!(
        most >= 2,
        "CPU-bound jobs ran one at a time once the worker knew their length (most at once: {most})"
    );
}

//! The Prometheus endpoint on `--metrics-addr`: counters match the jobs run, queue latency reads
//! `enqueued_at` in either unit, and /health fails while Redis does not answer. Needs no Ruby:
//! jobs are pushed as the Sidekiq client writes them. Each test owns its redis-server.
mod support;

use std::collections::BTreeMap;
use std::time::Duration;
use support::*;

const OK: &str = "#!/bin/sh\nexit 0\n";
const FAIL: &str = "#!/bin/sh\necho \"it broke\" >&2\nexit 1\n";

fn project() -> Project {
    Project::with_jobs(&[
        ("BlockJob", "block", BLOCK_UNTIL_RELEASE),
        ("OkJob", "ok", OK),
        ("FailJob", "fail", FAIL),
    ])
}

fn val(m: &BTreeMap<String, f64>, key: &str) -> f64 {
    m.get(key).copied().unwrap_or(0.0)
}

/// Push a job the way Sidekiq 6.4.1's client writes it (float seconds), with a given enqueued_at.
fn push(redis: &RedisServer, class: &str, queue: &str, retry: &str, enqueued_at: &str) -> String {
    let jid = uuid::Uuid::new_v4().simple().to_string()[..24].to_string();
    let job = format!(
        r#"{{"retry":{retry},"queue":"{queue}","class":"{class}","args":[1],"jid":"{jid}","created_at":{enqueued_at},"enqueued_at":{enqueued_at}}}"#
    );
    let mut c = redis.conn();
    let _: () = redis::pipe()
        .atomic()
        .sadd("queues", queue)
        .ignore()
        .lpush(format!("queue:{queue}"), job)
        .ignore()
        .query(&mut c)
        .unwrap();
    jid
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

#[test]
fn metrics_counters_match_the_jobs_run_and_health_follows_redis() {
    let redis = RedisServer::start();
    let p = project();
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args([
            "-c",
            "1",
            "-q",
            "critical",
            "-q",
            "default",
            "--metrics-addr",
            &addr,
        ])
        .start();
    wait_until("/health answers 200", Duration::from_secs(20), || {
        http_get(port, "/health").map(|r| r.0) == Some(200)
    });

    // Hold the only slot, then queue jobs that wait behind it: one enqueued 100 s ago in float
    // seconds (6.4/7.x), one 200 s ago in integer milliseconds (8.x).
    push(
        &redis,
        "BlockJob",
        "default",
        "true",
        &format!("{:.4}", now()),
    );
    wait_until("BlockJob running", Duration::from_secs(20), || {
        val(&scrape(port), "playguard_busy_slots") == 1.0
    });
    push(
        &redis,
        "OkJob",
        "default",
        "true",
        &format!("{:.4}", now() - 100.0),
    );
    let ms = ((now() - 200.0) * 1000.0) as i64;
    push(&redis, "OkJob", "critical", "true", &ms.to_string());
    wait_until(
        "queue latency gauges at the next beat",
        Duration::from_secs(20),
        || {
            let m = scrape(port);
            let d = val(&m, "playguard_queue_latency_seconds{queue=\"default\"}");
            let c = val(&m, "playguard_queue_latency_seconds{queue=\"critical\"}");
            (100.0..150.0).contains(&d) && (200.0..250.0).contains(&c)
        },
    );

    // Then a mix: 3 more successes, and failures that retry, die and are discarded.
    for _ in 0..3 {
        push(&redis, "OkJob", "default", "true", &format!("{:.4}", now()));
    }
    push(&redis, "FailJob", "default", "2", &format!("{:.4}", now()));
    push(&redis, "FailJob", "default", "0", &format!("{:.4}", now()));
    push(
        &redis,
        "FailJob",
        "critical",
        "false",
        &format!("{:.4}", now()),
    );
    p.write("release", "");
    let total = 1 + 2 + 3 + 3;
    // The processor counts a job as processed before it counts its fate (retried/dead/
    // discarded), writes the outcome to Redis and frees its slot, so "processed == total"
    // alone can be scraped while the last job is still finishing. All jobs are done once
    // every one is counted and no slot is busy.
    wait_until(
        "all jobs ran and freed their slots",
        Duration::from_secs(60),
        || {
            let m = scrape(port);
            let done: f64 = m
                .iter()
                .filter(|(k, _)| k.starts_with("playguard_jobs_processed_total{"))
                .map(|(_, v)| v)
                .sum();
            done == total as f64 && val(&m, "playguard_busy_slots") == 0.0
        },
    );
    let m = scrape(port);
    let expect = [
        (
            "playguard_jobs_processed_total{class=\"BlockJob\",queue=\"default\"}",
            1.0,
        ),
        (
            "playguard_jobs_processed_total{class=\"OkJob\",queue=\"default\"}",
            4.0,
        ),
        (
            "playguard_jobs_processed_total{class=\"OkJob\",queue=\"critical\"}",
            1.0,
        ),
        (
            "playguard_jobs_processed_total{class=\"FailJob\",queue=\"default\"}",
            2.0,
        ),
        (
            "playguard_jobs_processed_total{class=\"FailJob\",queue=\"critical\"}",
            1.0,
        ),
        (
            "playguard_jobs_failed_total{class=\"FailJob\",queue=\"default\"}",
            2.0,
        ),
        (
            "playguard_jobs_failed_total{class=\"FailJob\",queue=\"critical\"}",
            1.0,
        ),
        (
            "playguard_jobs_retried_total{class=\"FailJob\",queue=\"default\"}",
            1.0,
        ),
        (
            "playguard_jobs_dead_total{class=\"FailJob\",queue=\"default\"}",
            1.0,
        ),
        (
            "playguard_jobs_discarded_total{class=\"FailJob\",queue=\"critical\"}",
            1.0,
        ),
        (
            "playguard_job_duration_seconds_count{class=\"OkJob\",queue=\"default\"}",
            4.0,
        ),
        (
            "playguard_job_duration_seconds_bucket{class=\"OkJob\",queue=\"default\",le=\"+Inf\"}",
            4.0,
        ),
        ("playguard_busy_slots", 0.0),
        ("playguard_concurrency", 1.0),
    ];
    for (k, v) in expect {
        assert_eq!(val(&m, k), v, "{k}\n{m:#?}");
    }
    let failed: f64 = m
        .iter()
        .filter(|(k, _)| k.starts_with("playguard_jobs_failed_total{"))
        .map(|(_, v)| v)
        .sum();
    assert_eq!(failed, 3.0);
    // Sidekiq's own counters (flushed by the beat) agree with the scrape.
    wait_until("stat:processed flushed", Duration::from_secs(20), || {
        let v: Option<i64> = redis::cmd("GET")
            .arg("stat:processed")
            .query(&mut redis.conn())
            .unwrap();
        v == Some(total)
    });
    let failed_stat: i64 = redis::cmd("GET")
        .arg("stat:failed")
        .query(&mut redis.conn())
        .unwrap();
    assert_eq!(failed_stat, 3);
    // Empty queues read as zero latency at the next beat.
    wait_until("latency back to 0", Duration::from_secs(20), || {
        let m = scrape(port);
        val(&m, "playguard_queue_latency_seconds{queue=\"default\"}") == 0.0
            && val(&m, "playguard_queue_latency_seconds{queue=\"critical\"}") == 0.0
    });

    // A Redis that answers nothing fails /health after a beat or so, and it recovers.
    redis.pause();
    wait_until(
        "/health 503 while Redis is paused",
        Duration::from_secs(40),
        || http_get(port, "/health").map(|r| r.0) == Some(503),
    );
    redis.resume();
    wait_until("/health 200 again", Duration::from_secs(40), || {
        http_get(port, "/health").map(|r| r.0) == Some(200)
    });

    w.stop(Duration::from_secs(30));
}

/// Class names come from payloads: past 100 distinct ones the rest fold into `class="other"`,
/// while a class the worker runs keeps its own label.
#[test]
fn class_labels_are_bounded() {
    let redis = RedisServer::start();
    let p = project();
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let _w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["--metrics-addr", &addr])
        .start();
    for i in 0..150 {
        push(
            &redis,
            &format!("Nobody{i}"),
            "default",
            "true",
            &now().to_string(),
        );
    }
    push(&redis, "OkJob", "default", "true", &now().to_string());
    let processed = |m: &BTreeMap<String, f64>| -> f64 {
        m.iter()
            .filter(|(k, _)| k.starts_with("playguard_jobs_processed_total{"))
            .map(|(_, v)| v)
            .sum()
    };
    wait_until("all 151 jobs ran", Duration::from_secs(60), || {
        http_get(port, "/health").is_some() && processed(&scrape(port)) == 151.0
    });
    let m = scrape(port);
    let classes: std::collections::BTreeSet<String> = m
        .keys()
        .filter_map(|k| k.split("class=\"").nth(1))
        .map(|r| r.split('"').next().unwrap().to_string())
        .collect();
    assert!(classes.len() <= 102, "{} class labels", classes.len());
    assert!(
        classes.contains("other") && classes.contains("OkJob"),
        "{classes:?}"
    );
    assert_eq!(
        val(
            &m,
            "playguard_jobs_processed_total{class=\"OkJob\",queue=\"default\"}"
        ),
        1.0
    );
}

/// Every label value in a scrape (the test's names hold no quotes or commas).
fn label_values(m: &BTreeMap<String, f64>, label: &str) -> std::collections::BTreeSet<String> {
    let open = format!("{label}=\"");
    m.keys()
        .filter_map(|k| k.split(open.as_str()).nth(1))
        .map(|r| r.split('"').next().unwrap().to_string())
        .collect()
}

/// Label values from outside are cut to 100 bytes: a 10,000-byte class name, 150 distinct
/// 2,000-byte names sharing one prefix (their cut labels stay apart, and past 100 distinct
/// ones the rest still fold into `class="other"`), and a 300-byte queue name.
#[test]
fn label_values_are_capped_in_length() {
    let redis = RedisServer::start();
    let p = project();
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let long_queue = format!("q{}", "u".repeat(300));
    let _w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["--metrics-addr", &addr, "-q", &long_queue, "-q", "default"])
        .start();
    let at = now().to_string();
    push(&redis, &"H".repeat(10_000), "default", "false", &at);
    let prefix = "L".repeat(2_000);
    for i in 0..150 {
        push(&redis, &format!("{prefix}{i}"), "default", "false", &at);
    }
    push(&redis, "OkJob", &long_queue, "false", &at);
    let processed = |m: &BTreeMap<String, f64>| -> f64 {
        m.iter()
            .filter(|(k, _)| k.starts_with("playguard_jobs_processed_total{"))
            .map(|(_, v)| v)
            .sum()
    };
    wait_until("all 152 jobs ran", Duration::from_secs(60), || {
        http_get(port, "/health").is_some() && processed(&scrape(port)) == 152.0
    });
    let m = scrape(port);
    let classes = label_values(&m, "class");
    let queues = label_values(&m, "queue");
    for v in classes.iter().chain(&queues) {
        assert!(
            v.len() <= 100,
            "a label of {} bytes: {}...",
            v.len(),
            &v[..100]
        );
    }
    // 100 distinct unknown names kept apart (the 10,000-byte one among them, or in other),
    // then "other", and the class this worker runs.
    let cut = classes
        .iter()
        .filter(|c| c.starts_with("LLLL") || c.starts_with("HHHH"));
    assert_eq!(cut.count(), 100, "{classes:?}");
    assert!(
        classes.contains("other") && classes.contains("OkJob"),
        "{classes:?}"
    );
    assert_eq!(classes.len(), 102, "{classes:?}");
    let q = queues
        .iter()
        .find(|q| q.starts_with("quuu"))
        .expect("the long queue's label");
    assert_ne!(q, &long_queue);
    assert_eq!(
        m.iter()
            .filter(|(k, _)| k.starts_with("playguard_jobs_processed_total{class=\"OkJob\""))
            .map(|(k, v)| (
                label_values(&BTreeMap::from([(k.clone(), *v)]), "queue"),
                *v
            ))
            .collect::<Vec<_>>(),
        [(std::collections::BTreeSet::from([q.clone()]), 1.0)]
    );
}

/// 64 connections that send nothing take every slot: the next one is closed at once, not
/// served; once they go, the endpoint serves again. A client that never finishes its request
/// is dropped.
#[test]
fn connections_are_bounded_and_slow_clients_dropped() {
    use std::io::{Read, Write};
    let redis = RedisServer::start();
    let p = project();
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let _w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["--metrics-addr", &addr])
        .start();
    wait_until("the endpoint answers", Duration::from_secs(20), || {
        http_get(port, "/metrics").is_some()
    });
    let idle: Vec<std::net::TcpStream> = (0..64)
        .map(|_| std::net::TcpStream::connect(("127.0.0.1", port)).unwrap())
        .collect();
    assert_eq!(
        http_get(port, "/metrics"),
        None,
        "a 65th connection was served"
    );
    drop(idle);
    wait_until("the endpoint serves again", Duration::from_secs(20), || {
        http_get(port, "/metrics").is_some_and(|(s, _)| s == 200)
    });
    // Slowloris: half a request line, then silence. The server hangs up.
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.write_all(b"GET /metr").unwrap();
    let mut buf = [0u8; 64];
    assert_eq!(
        s.read(&mut buf).unwrap(),
        0,
        "the server closes the connection"
    );
}

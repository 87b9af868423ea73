//! A key of the wrong type where playguard expects a list (`SET queue:broken x`, or a string
//! in our own working list's place), against a real redis-server: the queue is logged once,
//! naming the key, and skipped by fetch and the heartbeat until it is fixed, while every other
//! queue is served and the lease holds; `lua/fetch.lua` checks every type before its first pop,
//! so no popped job is stranded or written nowhere.
//! Each test owns its redis-server; waits are conditions with deadlines, never timings.

mod support;

use std::time::Duration;
use support::*;

fn set(redis: &RedisServer, key: &str, value: &str) {
    let _: () = redis::cmd("SET")
        .arg(&[key, value])
        .query(&mut redis.conn())
        .unwrap();
}

fn lpush(redis: &RedisServer, key: &str, values: &[&str]) {
    let _: () = redis::cmd("LPUSH")
        .arg(key)
        .arg(values)
        .query(&mut redis.conn())
        .unwrap();
}

/// Run lua/fetch.lua for queues `a`, `b` into working lists `w:a`, `w:b`; its reply as
/// (index, reply) pairs, each reply a list of strings.
fn fetch(redis: &RedisServer, want: usize) -> Vec<(i64, Vec<String>)> {
    let mut c = redis.conn();
    let _: () = redis::cmd("SET").arg("alive").arg(1).query(&mut c).unwrap();
    let got: Vec<redis::Value> = redis::Script::new(include_str!("../lua/fetch.lua"))
        .key("queue:a")
        .key("queue:b")
        .key("w:a")
        .key("w:b")
        .key("alive")
        .arg(want)
        .invoke(&mut c)
        .expect("the fetch script answers, whatever the keys' types");
    got.chunks(2)
        .map(|p| {
            (
                redis::from_redis_value_ref(&p[0]).unwrap(),
                redis::from_redis_value_ref(&p[1]).unwrap(),
            )
        })
        .collect()
}

/// A later queue of the wrong type: the earlier queue's jobs are still delivered (before, the
/// script failed after moving them, stranding them in the working list with no one told).
#[test]
fn fetch_script_skips_a_later_queue_of_the_wrong_type_and_delivers_the_rest() {
    let redis = RedisServer::start();
    lpush(&redis, "queue:a", &["a0", "a1"]);
    set(&redis, "queue:b", "not a list");
    let got = fetch(&redis, 5);
    assert_eq!(
        got,
        vec![
            (-2, vec!["queue:b".to_string(), "string".to_string()]),
            (1, vec!["a0".to_string(), "a1".to_string()]),
        ]
    );
    assert_eq!(redis.lrange("w:a"), ["a1", "a0"]);
}

/// Our working list of the wrong type: nothing is popped from its queue (before, the jobs
/// were popped and their push failed: written nowhere).
#[test]
fn fetch_script_pops_nothing_into_a_working_list_of_the_wrong_type() {
    let redis = RedisServer::start();
    lpush(&redis, "queue:a", &["a0", "a1"]);
    lpush(&redis, "queue:b", &["b0"]);
    set(&redis, "w:a", "not a list");
    let got = fetch(&redis, 5);
    assert_eq!(
        got,
        vec![
            (-1, vec!["w:a".to_string(), "string".to_string()]),
            (2, vec!["b0".to_string()]),
        ]
    );
    assert_eq!(
        redis.lrange("queue:a"),
        ["a1", "a0"],
        "both jobs still queued"
    );
    assert_eq!(redis.lrange("w:b"), ["b0"]);
}

/// The `<identity>` hash's `beat`, once the worker registered.
fn beat_of(redis: &RedisServer, w: &Worker) -> Option<String> {
    let ids: Vec<String> = redis::cmd("SMEMBERS")
        .arg("processes")
        .query(&mut redis.conn())
        .unwrap();
    let id = ids
        .into_iter()
        .find(|i| i.split(':').nth_back(1) == Some(&w.pid().to_string()))?;
    redis::cmd("HGET")
        .arg(id)
        .arg("beat")
        .query(&mut redis.conn())
        .unwrap()
}

/// Wait until the worker's heartbeat landed `n` more times.
fn wait_beats(redis: &RedisServer, w: &Worker, n: usize) {
    let mut last = beat_of(redis, w);
    let mut seen = 0;
    wait_until(
        "heartbeats land",
        Duration::from_secs(30 + 6 * n as u64),
        || {
            let now = beat_of(redis, w);
            if now.is_some() && now != last {
                seen += 1;
                last = now;
            }
            seen >= n
        },
    );
}

fn served_beside_a_broken_queue(fetch: &str) {
    let redis = RedisServer::start();
    set(&redis, "queue:broken", "x");
    let p = Project::with_jobs(&[("OkJob", "ok", RECORD_RAN)]);
    for _ in 0..3 {
        enqueue(&redis, &["OkJob"]);
    }
    let port = free_port();
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-q", "broken", "-q", "default", "--fetch", fetch])
        .args(["--metrics-addr", &format!("127.0.0.1:{port}")])
        .start();
    let ran = || p.lines("ran.log").len();
    wait_until(
        "the default queue's jobs ran",
        Duration::from_secs(30),
        || ran() == 3,
    );
    wait_beats(&redis, &w, 3);
    let needle = "queue:broken holds a string, not a list";
    assert_eq!(w.count_lines(needle), 1, "logged once:\n{}", w.output());
    let (status, body) = http_get(port, "/health").unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains("queue broken skipped: queue:broken holds a string"),
        "{body}"
    );
    assert_eq!(scrape(port)["playguard_wrong_type_queues"], 1.0);
    assert!(!w.saw("liveness lease lapsed"), "{}", w.output());

    // Fixed: the queue is served again.
    let _: () = redis::cmd("DEL")
        .arg("queue:broken")
        .query(&mut redis.conn())
        .unwrap();
    enqueue(&redis, &["OkJob", "--queue", "broken"]);
    wait_until("the fixed queue's job ran", Duration::from_secs(30), || {
        ran() == 4
    });
    w.wait_for_line(
        "queue broken's keys hold lists again",
        Duration::from_secs(20),
    );
    wait_until("the gauge is back to 0", Duration::from_secs(20), || {
        scrape(port)["playguard_wrong_type_queues"] == 0.0
    });
    w.signal("TERM");
    assert_eq!(w.wait_exit(Duration::from_secs(30)), Some(0));
}

/// Before: every beat failed on the queue's LINDEX (WRONGTYPE inside the MULTI), so the
/// worker never fetched, and /health said 503.
#[test]
fn a_served_queue_of_the_wrong_type_is_logged_once_and_skipped_reliable() {
    served_beside_a_broken_queue("reliable");
}

#[test]
fn a_served_queue_of_the_wrong_type_is_logged_once_and_skipped_basic() {
    served_beside_a_broken_queue("basic");
}

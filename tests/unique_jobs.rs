//! sidekiq-unique-jobs' server side (`src/job/unique_jobs.rs`): real redis-server, the real
//! binary. Each test writes the keys the gem's client leaves after a push (its lock script:
//! `<digest>` holds the jid, `<digest>:LOCKED` maps the jid to the lock time, the digest in
//! `uniquejobs:digests`, QUEUED and PRIMED emptied), and a payload with the fields its client
//! adds (`lock`, `lock_timeout`, `lock_ttl`, `lock_prefix`, `lock_args`, `lock_digest`), then
//! lets playguard run the job and checks the keys as the gem's server middleware leaves them.
mod support;

use serde_json::{json, Value};
use std::time::Duration;
use support::*;

const DIGEST: &str = "uniquejobs:6e47ff668eeb7b9fd7d9d2a1c3e5b7f4";
const JID: &str = "0123456789abcdef01234567";
const OTHER: &str = "fedcba9876543210fedcba98";
const WAIT: Duration = Duration::from_secs(30);

/// A job that marks its start, waits for `release` (if `blocks`), and exits with `code`.
fn project(blocks: bool, code: i32) -> Project {
    let wait = if blocks {
        "while [ ! -e release ]; do sleep 0.05; done\n"
    } else {
        ""
    };
    Project::with_jobs(&[(
        "UniqueJob",
        "unique",
        &format!("#!/bin/sh\ntouch started\n{wait}touch ran\nexit {code}\n"),
    )])
}

/// The payload as the gem's client leaves it (`extra` adds or replaces fields).
fn payload(lock: &str, extra: Value) -> String {
    let mut m = json!({"retry": true, "queue": "default", "lock": lock, "class": "UniqueJob",
        "args": [1], "jid": JID, "created_at": 1700000000.25, "lock_timeout": 0,
        "lock_ttl": null, "lock_prefix": "uniquejobs", "lock_args": [1],
        "lock_digest": DIGEST, "enqueued_at": 1700000000.26});
    for (k, v) in extra.as_object().unwrap() {
        m[k] = v.clone();
    }
    m.to_string()
}

/// What the gem's lock script leaves once `jid` holds `digest`.
fn hold(redis: &RedisServer, digest: &str, jid: &str) {
    let _: () = redis::pipe()
        .cmd("SET")
        .arg(digest)
        .arg(jid)
        .ignore()
        .cmd("HSET")
        .arg(format!("{digest}:LOCKED"))
        .arg(jid)
        .arg("1700000000.27")
        .ignore()
        .cmd("ZADD")
        .arg("uniquejobs:digests")
        .arg("1700000000.27")
        .arg(digest)
        .ignore()
        .query(&mut redis.conn())
        .unwrap();
}

fn holders(redis: &RedisServer, digest: &str) -> Vec<String> {
    redis::cmd("HKEYS")
        .arg(format!("{digest}:LOCKED"))
        .query(&mut redis.conn())
        .unwrap()
}

fn exists(redis: &RedisServer, key: &str) -> bool {
    redis::cmd("EXISTS")
        .arg(key)
        .query::<i64>(&mut redis.conn())
        .unwrap()
        == 1
}

fn in_digests(redis: &RedisServer, digest: &str) -> bool {
    redis::cmd("ZSCORE")
        .arg("uniquejobs:digests")
        .arg(digest)
        .query::<Option<f64>>(&mut redis.conn())
        .unwrap()
        .is_some()
}

/// The job ran and its outcome is written (the ack follows the lock step).
fn wait_done(redis: &RedisServer, p: &Project) {
    wait_until("the job ran and was acknowledged", WAIT, || {
        p.path().join("ran").exists()
            && redis.llen("queue:default") == 0
            && redis.working_jobs().is_empty()
    });
}

fn released(redis: &RedisServer, digest: &str) -> bool {
    !exists(redis, digest) && holders(redis, digest).is_empty() && !in_digests(redis, digest)
}

fn one_entry(redis: &RedisServer, set: &str) -> Value {
    let all: Vec<String> = redis::cmd("ZRANGE")
        .arg(set)
        .arg(0)
        .arg(-1)
        .query(&mut redis.conn())
        .unwrap();
    assert_eq!(all.len(), 1, "{set}: {all:?}");
    serde_json::from_str(&all[0]).unwrap()
}

#[test]
fn until_executed_is_released_after_a_run_so_the_next_push_locks() {
    let redis = RedisServer::start();
    let p = project(false, 0);
    hold(&redis, DIGEST, JID);
    push_to_default(&redis, &[payload("until_executed", json!({}))]);
    let w = Worker::builder(&redis).jobs(p.path()).start();
    wait_done(&redis, &p);
    assert!(released(&redis, DIGEST), "{}", w.output());
    // The gem's waiters' token, and the changelog line its Web UI shows.
    assert_eq!(redis.lrange(&format!("{DIGEST}:QUEUED")), ["1"]);
    let log: Vec<String> = redis::cmd("ZRANGE")
        .arg("uniquejobs:changelog")
        .arg(0)
        .arg(-1)
        .query(&mut redis.conn())
        .unwrap();
    assert!(
        log.iter()
            .any(|e| e.contains("Unlocked") && e.contains(JID)),
        "{log:?}"
    );
}

#[test]
fn until_executed_is_released_after_a_failure_as_the_gem_does_and_the_retry_keeps_the_job() {
    let redis = RedisServer::start();
    let p = project(true, 1);
    hold(&redis, DIGEST, JID);
    push_to_default(&redis, &[payload("until_executed", json!({}))]);
    let w = Worker::builder(&redis).jobs(p.path()).start();
    wait_until("the job started", WAIT, || {
        p.path().join("started").exists()
    });
    // Held while it runs.
    assert_eq!(holders(&redis, DIGEST), [JID]);
    p.write("release", "");
    wait_until("the retry is written", WAIT, || redis.zcard("retry") == 1);
    assert!(released(&redis, DIGEST), "{}", w.output());
}

#[test]
fn until_executed_keeps_a_lock_another_job_holds() {
    let redis = RedisServer::start();
    let p = project(false, 0);
    hold(&redis, DIGEST, OTHER);
    push_to_default(&redis, &[payload("until_executed", json!({}))]);
    let w = Worker::builder(&redis).jobs(p.path()).start();
    wait_until("the job is dropped", WAIT, || {
        w.saw("not run, dropped") && redis.working_jobs().is_empty()
    });
    assert!(!p.path().join("started").exists());
    assert_eq!(holders(&redis, DIGEST), [OTHER]);
    assert!(exists(&redis, DIGEST) && in_digests(&redis, DIGEST));
}

#[test]
fn until_executing_is_released_before_the_run_and_taken_again_after_a_failure() {
    let redis = RedisServer::start();
    let p = project(true, 1);
    hold(&redis, DIGEST, JID);
    push_to_default(&redis, &[payload("until_executing", json!({}))]);
    let w = Worker::builder(&redis).jobs(p.path()).start();
    wait_until("the job started", WAIT, || {
        p.path().join("started").exists()
    });
    assert!(released(&redis, DIGEST), "{}", w.output());
    p.write("release", "");
    wait_until("the retry is written", WAIT, || redis.zcard("retry") == 1);
    assert_eq!(holders(&redis, DIGEST), [JID], "{}", w.output());
    assert!(in_digests(&redis, DIGEST));
}

#[test]
fn until_expired_leaves_the_lock_to_its_ttl() {
    let redis = RedisServer::start();
    let p = project(false, 0);
    hold(&redis, DIGEST, JID);
    push_to_default(
        &redis,
        &[payload("until_expired", json!({"lock_ttl": 600}))],
    );
    let _w = Worker::builder(&redis).jobs(p.path()).start();
    wait_done(&redis, &p);
    assert_eq!(holders(&redis, DIGEST), [JID]);
}

#[test]
fn while_executing_holds_the_runtime_lock_while_it_runs_only() {
    let redis = RedisServer::start();
    let p = project(true, 0);
    let run = format!("{DIGEST}:RUN");
    push_to_default(&redis, &[payload("while_executing", json!({}))]);
    let w = Worker::builder(&redis).jobs(p.path()).start();
    wait_until("the job started", WAIT, || {
        p.path().join("started").exists()
    });
    assert_eq!(holders(&redis, &run), [JID], "{}", w.output());
    assert_eq!(
        redis::cmd("GET")
            .arg(&run)
            .query::<Option<String>>(&mut redis.conn())
            .unwrap()
            .as_deref(),
        Some(JID)
    );
    assert!(in_digests(&redis, &run));
    p.write("release", "");
    wait_done(&redis, &p);
    assert!(released(&redis, &run), "{}", w.output());
}

#[test]
fn until_and_while_executing_trades_the_outer_lock_for_the_runtime_lock() {
    let redis = RedisServer::start();
    let p = project(true, 0);
    let run = format!("{DIGEST}:RUN");
    hold(&redis, DIGEST, JID);
    push_to_default(&redis, &[payload("until_and_while_executing", json!({}))]);
    let w = Worker::builder(&redis).jobs(p.path()).start();
    wait_until("the job started", WAIT, || {
        p.path().join("started").exists()
    });
    assert!(released(&redis, DIGEST), "{}", w.output());
    assert_eq!(holders(&redis, &run), [JID]);
    p.write("release", "");
    wait_done(&redis, &p);
    assert!(released(&redis, &run), "{}", w.output());
    assert!(released(&redis, DIGEST));
}

/// A while_executing job whose runtime lock another job holds, under `on_conflict`.
fn conflicted(on_conflict: &str) -> (RedisServer, Project, Worker) {
    conflicted_with(on_conflict, json!({}))
}

fn conflicted_with(on_conflict: &str, mut extra: Value) -> (RedisServer, Project, Worker) {
    let redis = RedisServer::start();
    let p = project(false, 0);
    let run = format!("{DIGEST}:RUN");
    hold(&redis, &run, OTHER);
    if !on_conflict.is_empty() {
        extra["on_conflict"] = json!({"client": "log", "server": on_conflict});
    }
    push_to_default(&redis, &[payload("while_executing", extra)]);
    let w = Worker::builder(&redis).jobs(p.path()).start();
    (redis, p, w)
}

fn left_alone(redis: &RedisServer, p: &Project) {
    assert!(!p.path().join("started").exists());
    let run = format!("{DIGEST}:RUN");
    assert_eq!(holders(redis, &run), [OTHER]);
    assert!(in_digests(redis, &run));
}

#[test]
fn a_held_runtime_lock_with_on_conflict_reject_sends_the_job_to_dead() {
    let (redis, p, w) = conflicted("reject");
    wait_until("the job is dead", WAIT, || redis.zcard("dead") == 1);
    let dead = one_entry(&redis, "dead");
    assert_eq!(
        (dead["jid"].as_str(), dead["error_class"].as_str()),
        (Some(JID), Some("SidekiqUniqueJobs::Conflict")),
        "{}",
        w.output()
    );
    assert_eq!(redis.zcard("retry"), 0);
    left_alone(&redis, &p);
}

/// The gem's reject puts the job in the dead set itself (on_conflict/reject.rb), whatever its
/// `retry` says: `retry: false` must not turn it into a silent drop.
#[test]
fn reject_sends_to_dead_even_with_retry_false() {
    let (redis, p, w) = conflicted_with("reject", json!({"retry": false}));
    wait_until("the job is dead", WAIT, || redis.zcard("dead") == 1);
    assert_eq!(
        one_entry(&redis, "dead")["jid"].as_str(),
        Some(JID),
        "{}",
        w.output()
    );
    left_alone(&redis, &p);
}

#[test]
fn a_held_runtime_lock_with_on_conflict_reschedule_pushes_it_again_later() {
    let (redis, p, w) = conflicted("reschedule");
    wait_until("the job is rescheduled", WAIT, || {
        redis.zcard("schedule") == 1
    });
    let again = one_entry(&redis, "schedule");
    assert_ne!(
        again["jid"].as_str(),
        Some(JID),
        "a new job, as perform_in makes"
    );
    assert_eq!(
        (again["class"].as_str(), &again["args"]),
        (Some("UniqueJob"), &json!([1]))
    );
    assert_eq!(
        again["lock_digest"].as_str(),
        Some(DIGEST),
        "{}",
        w.output()
    );
    wait_until("the original is acknowledged", WAIT, || {
        redis.working_jobs().is_empty()
    });
    assert_eq!(redis.zcard("retry") + redis.zcard("dead"), 0);
    left_alone(&redis, &p);
}

#[test]
fn a_held_runtime_lock_with_on_conflict_raise_is_a_failure_that_retries() {
    let (redis, p, w) = conflicted("raise");
    wait_until("the retry is written", WAIT, || redis.zcard("retry") == 1);
    let retry = one_entry(&redis, "retry");
    assert_eq!(
        retry["error_class"].as_str(),
        Some("SidekiqUniqueJobs::Conflict"),
        "{}",
        w.output()
    );
    left_alone(&redis, &p);
}

#[test]
fn a_held_runtime_lock_without_a_strategy_drops_the_job_with_a_line() {
    let (redis, p, w) = conflicted("");
    wait_until("the job is dropped", WAIT, || {
        w.saw("not run, dropped") && redis.working_jobs().is_empty()
    });
    assert_eq!(
        redis.zcard("retry") + redis.zcard("dead") + redis.zcard("schedule"),
        0
    );
    left_alone(&redis, &p);
}

#[test]
fn fields_that_do_not_parse_run_the_job_unlocked_with_one_warning() {
    let redis = RedisServer::start();
    let p = project(false, 0);
    hold(&redis, DIGEST, JID);
    push_to_default(
        &redis,
        &[payload("until_executed", json!({"lock_ttl": "soon"}))],
    );
    let w = Worker::builder(&redis).jobs(p.path()).start();
    wait_done(&redis, &p);
    let warned: Vec<String> = w
        .lines()
        .into_iter()
        .filter(|l| l.contains("sidekiq-unique-jobs"))
        .collect();
    assert_eq!(warned.len(), 1, "{}", w.output());
    assert!(
        warned[0].contains("WARN") && warned[0].contains(JID),
        "{warned:?}"
    );
    // Nothing of the lock is touched.
    assert_eq!(holders(&redis, DIGEST), [JID]);
}

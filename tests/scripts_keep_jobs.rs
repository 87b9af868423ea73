//! A script that pops a job never destroys it on error: a queue key of the wrong type leaves
//! the job where it was or puts it in `dead` with the reason (schedule/retry poller, orphan
//! recovery, requeue and drain at shutdown); one bad identity does not stop the orphan sweep;
//! an outcome write that fails is retried until it lands.
//! Each test owns its redis-server; waits are conditions with deadlines, never timings.

mod support;

use serde_json::Value;
use std::time::Duration;
use support::*;

fn zrange(redis: &RedisServer, key: &str) -> Vec<String> {
    redis::cmd("ZRANGE")
        .arg(&[key, "0", "-1"])
        .query(&mut redis.conn())
        .unwrap_or_default()
}

fn set(redis: &RedisServer, key: &str, value: &str) {
    let _: () = redis::cmd("SET")
        .arg(&[key, value])
        .query(&mut redis.conn())
        .unwrap();
}

fn job(class: &str, queue: &str, jid: &str) -> String {
    format!(
        r#"{{"retry":true,"queue":"{queue}","class":"{class}","args":[],"jid":"{jid}","created_at":1.5,"enqueued_at":1.5}}"#
    )
}

/// A due scheduled job whose queue key is a string ends in `dead` with the reason; the good
/// job beside it is enqueued and runs.
#[test]
fn scheduled_job_for_a_queue_key_of_the_wrong_type_goes_to_dead() {
    let redis = RedisServer::start();
    set(&redis, "queue:bad", "not a list");
    let p = Project::with_jobs(&[("OkJob", "ok", RECORD_RAN)]);
    let mut c = redis.conn();
    let bad = job("OkJob", "bad", "badjid");
    let good = job("OkJob", "default", "goodjid");
    let _: () = redis::cmd("ZADD")
        .arg("schedule")
        .arg(1)
        .arg(&bad)
        .arg(2)
        .arg(&good)
        .query(&mut c)
        .unwrap();
    let w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["--poll-interval", "0.2"])
        .start();
    wait_until("the good job ran", Duration::from_secs(20), || {
        p.path().join("ran.log").exists()
    });
    wait_until("the bad job is dead", Duration::from_secs(20), || {
        !zrange(&redis, "dead").is_empty()
    });
    assert!(zrange(&redis, "schedule").is_empty());
    let dead = zrange(&redis, "dead");
    assert_eq!(dead.len(), 1);
    let d: Value = serde_json::from_str(&dead[0]).unwrap();
    assert_eq!(d["jid"], "badjid");
    assert_eq!(d["error_class"], "Playguard::BadQueueKey");
    assert!(
        d["error_message"].as_str().unwrap().contains("queue:bad"),
        "{d}"
    );
    w.wait_for_line("queue:bad", Duration::from_secs(10));
}

/// Dead processes: one whose working list is not a list (its recovery fails), one whose queue
/// key is a string (its job must stay put), one ordinary: the ordinary one is recovered.
#[test]
fn one_failing_identity_does_not_stop_the_orphan_sweep() {
    let redis = RedisServer::start();
    let p = Project::with_jobs(&[("OkJob", "ok", RECORD_RAN)]);
    let mut c = redis.conn();
    let entry = |q: &str| format!(r#"{{"queues":["{q}"],"ns":""}}"#);
    // Inserted first, so the sweep meets it first (a small hash keeps insertion order).
    let _: () = redis::cmd("HSET")
        .arg("playguard:fetchers")
        .arg("gone-a:1:x")
        .arg(entry("default"))
        .arg("gone-b:2:x")
        .arg(entry("wq"))
        .arg("gone-c:3:x")
        .arg(entry("default"))
        .query(&mut c)
        .unwrap();
    set(&redis, "playguard:working:gone-a:1:x:default", "not a list");
    set(&redis, "queue:wq", "not a list");
    let stuck = job("OkJob", "wq", "stuckjid");
    let _: () = redis::cmd("LPUSH")
        .arg("playguard:working:gone-b:2:x:wq")
        .arg(&stuck)
        .query(&mut c)
        .unwrap();
    let _: () = redis::cmd("LPUSH")
        .arg("playguard:working:gone-c:3:x:default")
        .arg(job("OkJob", "default", "orphanjid"))
        .query(&mut c)
        .unwrap();
    let w = Worker::builder(&redis).jobs(p.path()).start();
    wait_until(
        "the ordinary orphan was recovered and ran",
        Duration::from_secs(30),
        || p.path().join("ran.log").exists(),
    );
    wait_until(
        "the bad identities were reported",
        Duration::from_secs(20),
        || w.saw("gone-a:1:x") && w.saw("queue:wq"),
    );
    assert_eq!(redis.lrange("playguard:working:gone-b:2:x:wq"), vec![stuck]);
    let left: Vec<String> = redis::cmd("HKEYS")
        .arg("playguard:fetchers")
        .query(&mut c)
        .unwrap();
    assert!(
        left.contains(&"gone-b:2:x".to_string()),
        "kept to retry: {left:?}"
    );
    assert!(!left.contains(&"gone-c:3:x".to_string()), "{left:?}");
}

/// At shutdown the running job is pushed back, but its queue key became a string: the job
/// stays in the working list (for recovery) instead of vanishing.
#[test]
fn requeue_and_drain_keep_the_job_when_the_queue_key_has_the_wrong_type() {
    let redis = RedisServer::start();
    let p = Project::with_jobs(&[(
        "SlowJob",
        "slow",
        "#!/bin/sh\necho started > started.txt\nexec sleep 30\n",
    )]);
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-t", "1"])
        .start();
    let payload = job("SlowJob", "default", "slowjid");
    let _: () = redis::cmd("LPUSH")
        .arg("queue:default")
        .arg(&payload)
        .query(&mut redis.conn())
        .unwrap();
    wait_until("the job runs", Duration::from_secs(20), || {
        p.path().join("started.txt").exists()
    });
    set(&redis, "queue:default", "not a list");
    w.signal("TERM");
    w.wait_exit(Duration::from_secs(30));
    assert_eq!(redis.working_jobs(), vec![payload], "{}", w.output());
    assert!(w.saw("queue:default"), "{}", w.output());
}

/// The failing job's retry write fails (the `retry` key is a string): it is retried until it
/// lands once the key is fixed, instead of the job being lost.
#[test]
fn a_failed_outcome_write_is_retried_until_it_lands() {
    let redis = RedisServer::start();
    let p = Project::with_jobs(&[("BadJob", "bad", "#!/bin/sh\necho boom >&2\nexit 1\n")]);
    set(&redis, "retry", "not a zset");
    let w = Worker::builder(&redis).jobs(p.path()).start();
    enqueue(&redis, &["BadJob"]);
    w.wait_for_line("could not record", Duration::from_secs(20));
    let _: () = redis::cmd("DEL")
        .arg("retry")
        .query(&mut redis.conn())
        .unwrap();
    wait_until("the retry entry landed", Duration::from_secs(20), || {
        zrange(&redis, "retry").len() == 1
    });
    let r: Value = serde_json::from_str(&zrange(&redis, "retry")[0]).unwrap();
    assert_eq!(r["error_message"], "boom");
    assert!(redis.working_jobs().is_empty());
}

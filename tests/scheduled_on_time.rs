//! The scheduled poller wakes at the earliest due score it has seen (`src/loops/scheduled.rs`)
//! and earlier when this process itself writes a nearer retry (`src/job/next_due.rs`), so a job
//! starts on time although the poll interval is long. Each test owns its redis-server; the
//! margins are wide (seconds, against the poll interval's tens of seconds): what is checked is
//! that the job did not wait for the next random poll.

mod support;

use std::time::Duration;
use support::*;

/// Appends the epoch time of its start to `ran.log`; fails while `ran.log` has one line.
const RECORD_START_FAIL_FIRST: &str = "#!/bin/sh\ndate +%s.%N >> ran.log\n\
    [ \"$(wc -l < ran.log)\" -ge 2 ]\n";

/// Appends the epoch time of its start to `ran.log`.
const RECORD_START: &str = "#!/bin/sh\ndate +%s.%N >> ran.log\n";

fn now() -> f64 {
    playguard::test_support::now_f64()
}

/// The start times in `ran.log`.
fn starts(p: &Project) -> Vec<f64> {
    p.lines("ran.log")
        .iter()
        .map(|l| l.trim().parse().unwrap())
        .collect()
}

fn job(class: &str, jid: &str) -> String {
    format!(
        r#"{{"retry":true,"queue":"default","class":"{class}","args":[],"jid":"{jid}","created_at":1.5}}"#
    )
}

/// Wait for the worker's first heartbeat: its poller starts right after it, with a first poll.
fn wait_for_first_beat(redis: &RedisServer) {
    wait_until(
        "the worker's first heartbeat",
        Duration::from_secs(20),
        || {
            redis::cmd("SCARD")
                .arg("processes")
                .query::<i64>(&mut redis.conn())
                .unwrap_or(0)
                > 0
        },
    );
}

/// A job already in `schedule` when the worker starts, due 8 s later: the first poll sees it
/// is not due yet and the poller sleeps until its score, not until the next random poll
/// (`--poll-interval 40`: one process polls every 20 to 60 s).
#[test]
fn a_scheduled_job_seen_by_a_poll_starts_at_its_time() {
    let redis = RedisServer::start();
    let p = Project::with_jobs(&[("OnTime", "on_time", RECORD_START)]);
    let due = now() + 8.0;
    let _: () = redis::cmd("ZADD")
        .arg("schedule")
        .arg(due)
        .arg(job("OnTime", "ontimejid"))
        .query(&mut redis.conn())
        .unwrap();
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["--poll-interval", "40"])
        .start();
    wait_for_first_beat(&redis);
    assert!(
        now() < due - 2.0,
        "the worker took too long to start for this test to mean anything"
    );
    assert_eq!(redis.zcard("schedule"), 1, "not moved before its time");
    wait_until("the scheduled job ran", Duration::from_secs(60), || {
        !starts(&p).is_empty()
    });
    let ran = starts(&p)[0];
    assert!(ran >= due, "ran at {ran}, before its time {due}");
    // The next random poll is at least 20 s after the first: 12 s after the due time.
    assert!(
        ran < due + 4.0,
        "ran {:.3} s after its time: it waited for a poll\n{}",
        ran - due,
        w.output()
    );
    w.stop(Duration::from_secs(20));
}

/// A job that fails in this process is written to `retry` (15 to 24 s ahead, Sidekiq's first
/// backoff); the poller, asleep until its next random poll (`--poll-interval 100`: 50 to 150 s
/// away), is woken by that write and moves the retry at its score.
#[test]
fn a_retry_written_by_this_process_wakes_the_poller() {
    let redis = RedisServer::start();
    let p = Project::with_jobs(&[("FailOnce", "fail_once", RECORD_START_FAIL_FIRST)]);
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["--poll-interval", "100"])
        .start();
    wait_for_first_beat(&redis);
    let started = now();
    push_to_default(&redis, job("FailOnce", "failoncejid"));
    wait_until("the retry is written", Duration::from_secs(20), || {
        redis.zcard("retry") == 1
    });
    let scored: Vec<(String, f64)> = redis::cmd("ZRANGE")
        .arg(&["retry", "0", "0", "WITHSCORES"])
        .query(&mut redis.conn())
        .unwrap();
    let at = scored[0].1;
    assert!(
        at < started + 45.0,
        "Sidekiq's first backoff is at most 24 s; retry at {at}"
    );
    wait_until("the retry ran", Duration::from_secs(60), || {
        starts(&p).len() >= 2
    });
    let ran = starts(&p)[1];
    assert!(ran >= at, "retried at {ran}, before its score {at}");
    // The next random poll is at least 50 s after the first, 25 s after the score.
    assert!(
        ran < at + 4.0,
        "retried {:.3} s after its score: it waited for a poll\n{}",
        ran - at,
        w.output()
    );
    wait_until("the retry is done", Duration::from_secs(20), || {
        redis.zcard("retry") == 0 && redis.llen("queue:default") == 0
    });
    w.stop(Duration::from_secs(20));
}

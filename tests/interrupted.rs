//! A job that always outlives `-t` is requeued by each shutdown with `interrupted_count`
//! raised in its payload, and the shutdown that interrupts it a fourth time (more than the
//! default 3) sends it to dead as `Playguard::Interrupted` instead.
mod support;

use serde_json::Value;
use std::time::Duration;
use support::*;

#[test]
fn a_job_interrupted_more_than_three_times_goes_to_dead_reliable_fetch() {
    interrupted_four_times("reliable");
}

#[test]
fn a_job_interrupted_more_than_three_times_goes_to_dead_basic_fetch() {
    interrupted_four_times("basic");
}

fn interrupted_four_times(fetch: &str) {
    let redis = RedisServer::start();
    let p = Project::new();
    p.script(
        "jobs/bin/slow",
        "#!/bin/sh\necho started >> started.txt\nexec sleep 60\n",
    );
    p.write(
        "jobs/app.toml",
        "[[job]]\nclass = \"SlowJob\"\nrun = [\"jobs/bin/slow\"]\n",
    );
    let jid = enqueue(&redis, &["SlowJob", "7"]);
    for round in 1..=4 {
        let mut w = Worker::builder(&redis)
            .jobs(p.path())
            .args(["-t", "1", "--fetch", fetch])
            .start();
        wait_until("the job started", Duration::from_secs(30), || {
            p.lines("started.txt").len() == round
        });
        w.stop(Duration::from_secs(30));
        let queued = redis.lrange("queue:default");
        if round <= 3 {
            assert_eq!(queued.len(), 1, "round {round}: {queued:?}\n{}", w.output());
            let job: Value = serde_json::from_str(&queued[0]).unwrap();
            assert_eq!(job["jid"], jid.as_str());
            assert_eq!(job["interrupted_count"], round, "{job}");
        } else {
            assert!(queued.is_empty(), "not requeued a fourth time: {queued:?}");
            assert!(
                w.saw("interrupted by shutdown too often: moved to dead"),
                "{}",
                w.output()
            );
        }
    }
    let dead: Vec<String> = redis::cmd("ZRANGE")
        .arg("dead")
        .arg(0)
        .arg(-1)
        .query(&mut redis.conn())
        .unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    let entry: Value = serde_json::from_str(&dead[0]).unwrap();
    assert_eq!(entry["jid"], jid.as_str());
    assert_eq!(entry["error_class"], "Playguard::Interrupted");
    assert_eq!(entry["interrupted_count"], 4);
    assert!(entry["error_message"].as_str().unwrap().contains("-t"));
}

/// A cycle that stops at a phase boundary within `-t` did not outlive it: each shutdown puts it
/// back uncounted, so a rolling restart of more workers than the limit cannot kill it.
#[test]
fn a_cycle_stopped_at_a_phase_boundary_in_time_is_requeued_uncounted() {
    let redis = RedisServer::start();
    let p = Project::new();
    p.script(
        "jobs/bin/first",
        "#!/bin/sh\necho started >> started.txt\nexec sleep 1\n",
    );
    p.script("jobs/bin/second", "#!/bin/sh\necho second >> second.txt\n");
    p.write(
        "jobs/app.toml",
        r#"[[job]]
class = "CycleJob"
lock = { key = "lock:cycle:{args.0}", ttl_secs = 30 }
[[job.phase]]
name = "first"
run = ["jobs/bin/first"]
[[job.phase]]
name = "second"
run = ["jobs/bin/second"]
"#,
    );
    let jid = enqueue(&redis, &["CycleJob", "7"]);
    for round in 1..=5 {
        let mut w = Worker::builder(&redis)
            .jobs(p.path())
            .args(["-t", "20"])
            .start();
        wait_until("the first phase started", Duration::from_secs(30), || {
            p.lines("started.txt").len() == round
        });
        w.stop(Duration::from_secs(30));
        let queued = redis.lrange("queue:default");
        assert_eq!(queued.len(), 1, "round {round}: {queued:?}\n{}", w.output());
        let job: Value = serde_json::from_str(&queued[0]).unwrap();
        assert_eq!(job["jid"], jid.as_str());
        assert!(
            job.get("interrupted_count").is_none(),
            "round {round}: {job}"
        );
    }
    assert!(p.lines("second.txt").is_empty(), "no second phase started");
    assert_eq!(redis.zcard("dead"), 0);
}

//! Liveness as a lease (issue 13), with real worker processes and a real redis-server: a frozen
//! worker's command is killed before another process recovers its job, and comes back without
//! a duplicate; a SIGKILLed holder's reconcile lock is released by the sweep, so the recovered
//! job reconciles the Marquee long before the lease would have expired; a worker cut off from
//! Redis stops its own job and hands it back once Redis answers again.
//! Commands write stamp files: `<start|tick|stop> <pid> <ns>` (and the fence for phases).
mod support;

use std::time::Duration;
use support::*;

/// A command that stamps its start, ticks every 0.2 s until `finish` exists, then stamps stop.
const LONG: &str = "#!/bin/sh\n\
    echo \"start $$ $(date +%s%N) ${PLAYGUARD_FENCE:-0}\" >> stamps\n\
    while [ ! -f finish ]; do echo \"tick $$ $(date +%s%N)\" >> stamps; sleep 0.2; done\n\
    echo \"stop $$ $(date +%s%N)\" >> stamps\n";

#[derive(Debug)]
struct Stamp {
    kind: String,
    pid: i32,
    ns: u128,
    fence: i64,
}

fn stamps(p: &Project) -> Vec<Stamp> {
    std::fs::read_to_string(p.path().join("stamps"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            Some(Stamp {
                kind: f.first()?.to_string(),
                pid: f.get(1)?.parse().ok()?,
                ns: f.get(2)?.parse().ok()?,
                fence: f.get(3).and_then(|x| x.parse().ok()).unwrap_or(0),
            })
        })
        .collect()
}

fn starts(p: &Project) -> Vec<Stamp> {
    stamps(p)
        .into_iter()
        .filter(|s| s.kind == "start")
        .collect()
}

#[test]
fn frozen_worker_command_is_killed_before_its_job_runs_again() {
    let redis = RedisServer::start();
    let p = Project::with_jobs(&[("LongJob", "long", LONG)]);
    let w1 = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-c", "2"])
        .start();
    let id1 = w1.identity(&redis);
    enqueue(&redis, &["LongJob"]);
    wait_until("the first copy started", Duration::from_secs(20), || {
        starts(&p).len() == 1
    });
    let first = starts(&p)[0].pid;
    let w2 = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-c", "2"])
        .start();
    w2.identity(&redis);

    // Frozen past the alive TTL: the second worker's sweep recovers the job.
    w1.signal("STOP");
    wait_until(
        "the second worker runs the recovered job",
        Duration::from_secs(60),
        || starts(&p).len() == 2,
    );
    let second = &starts(&p)[1];
    let first_alive_then = pid_alive(first);
    let last_tick_of_first = stamps(&p)
        .iter()
        .filter(|s| s.pid == first)
        .map(|s| s.ns)
        .max()
        .unwrap();
    w1.signal("CONT");
    assert!(
        !first_alive_then,
        "the first copy was still running when the second started"
    );
    assert!(
        last_tick_of_first < second.ns,
        "the two copies overlapped: the first ticked {} ms after the second started",
        (last_tick_of_first - second.ns) / 1_000_000
    );

    // Back from the freeze: it hands the job back only if it is still its own, and it was not.
    w1.wait_for_line(
        "the orphan sweep had already returned it",
        Duration::from_secs(30),
    );
    std::fs::write(p.path().join("finish"), "").unwrap();
    wait_until("the second copy finished", Duration::from_secs(30), || {
        stamps(&p).iter().any(|s| s.kind == "stop")
    });
    let working1 = format!("playguard:working:{id1}:default");
    wait_until(
        "queue and both working lists empty",
        Duration::from_secs(30),
        || redis.llen("queue:default") == 0 && redis.working_jobs().is_empty(),
    );
    assert_eq!(redis.llen(&working1), 0);
    let retries: usize = redis::cmd("ZCARD")
        .arg("retry")
        .query(&mut redis.conn())
        .unwrap();
    assert_eq!(retries, 0, "no retry entry beside the recovered copy");
    assert_eq!(
        starts(&p).len(),
        2,
        "exactly one recovered run, no duplicate"
    );
    assert!(
        w1.saw("liveness lease lapsed"),
        "the first worker knew why its job stopped:\n{}",
        w1.output()
    );
    for w in [&w1, &w2] {
        w.signal("TERM");
    }
    let (mut w1, mut w2) = (w1, w2);
    assert_eq!(w1.wait_exit(Duration::from_secs(30)), Some(0));
    assert_eq!(w2.wait_exit(Duration::from_secs(30)), Some(0));
}

fn reconcile_manifest(ttl_secs: u32) -> String {
    format!(
        "[[job]]\nclass = \"PlayguardJob\"\n\
         lock = {{ key = \"playguard:marquee:{{args.0}}\", ttl_secs = {ttl_secs}, when_locked = \"skip\", label = \"Marquee {{args.0}}\" }}\n\
         on_lock_lost = \"abort\"\n\
         [[job.phase]]\nname = \"sync\"\nrun = [\"jobs/bin/long\"]\n"
    )
}

#[test]
fn sigkilled_holder_lock_is_released_and_the_marquee_reconciled_again() {
    let redis = RedisServer::start();
    let p = Project::new();
    p.script("jobs/bin/long", LONG);
    p.write("jobs/app.toml", &reconcile_manifest(600));
    let mut w1 = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-c", "2"])
        .start();
    let id1 = w1.identity(&redis);
    let jid = enqueue(&redis, &["PlayguardJob", "7"]);
    wait_until(
        "the first cycle's phase started",
        Duration::from_secs(20),
        || starts(&p).len() == 1,
    );
    let first = starts(&p)[0].pid;

    // The holder record, written with the acquisition.
    let mut c = redis.conn();
    let token: String = redis::cmd("GET")
        .arg("playguard:marquee:7")
        .query(&mut c)
        .unwrap();
    let rec: String = redis::cmd("HGET")
        .arg(format!("playguard:locks:{id1}"))
        .arg("playguard:marquee:7")
        .query(&mut c)
        .unwrap();
    let v: serde_json::Value = serde_json::from_str(&rec).unwrap();
    let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        [
            "token",
            "jid",
            "fence",
            "label",
            "class",
            "acquired_at",
            "ttl_ms"
        ],
        "{rec}"
    );
    assert_eq!(v["token"], token.as_str());
    assert_eq!(v["jid"], jid.as_str());
    assert_eq!(v["fence"].as_i64(), Some(starts(&p)[0].fence));
    assert_eq!(v["label"], "Marquee 7");
    assert_eq!(v["class"], "PlayguardJob");
    assert_eq!(v["ttl_ms"].as_i64(), Some(600_000));
    assert!(v["acquired_at"].as_i64().unwrap() > 1_600_000_000_000);

    let w2 = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-c", "2"])
        .start();
    let id2 = w2.identity(&redis);
    w1.kill9();
    // The lease has ~600 s left; the sweep must free it rather than wait for it.
    wait_until(
        "the recovered job reconciles the Marquee again",
        Duration::from_secs(45),
        || starts(&p).len() == 2,
    );
    let again = &starts(&p)[1];
    assert!(!pid_alive(first), "the dead holder's phase died with it");
    assert!(
        again.fence > starts(&p)[0].fence,
        "a new acquisition, with a newer fence"
    );
    let left: i64 = redis::cmd("EXISTS")
        .arg(format!("playguard:locks:{id1}"))
        .query(&mut c)
        .unwrap();
    assert_eq!(left, 0, "the dead holder's record is gone");
    let rec2: Option<String> = redis::cmd("HGET")
        .arg(format!("playguard:locks:{id2}"))
        .arg("playguard:marquee:7")
        .query(&mut c)
        .unwrap();
    assert!(rec2.is_some(), "the new holder is recorded");
    assert!(
        !w2.saw("already locked"),
        "the recovered job was not skipped:\n{}",
        w2.output()
    );

    std::fs::write(p.path().join("finish"), "").unwrap();
    wait_until(
        "cycle done: lock and record gone",
        Duration::from_secs(30),
        || {
            let mut c = redis.conn();
            let held: i64 = redis::cmd("EXISTS")
                .arg("playguard:marquee:7")
                .arg(format!("playguard:locks:{id2}"))
                .query(&mut c)
                .unwrap();
            held == 0 && redis.llen("queue:default") == 0
        },
    );
    w2.signal("TERM");
    let mut w2 = w2;
    assert_eq!(w2.wait_exit(Duration::from_secs(30)), Some(0));
}

#[test]
fn worker_cut_off_from_redis_stops_its_job_and_hands_it_back() {
    let redis = RedisServer::start();
    let p = Project::with_jobs(&[("LongJob", "long", LONG)]);
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-c", "2"])
        .start();
    w.identity(&redis);
    enqueue(&redis, &["LongJob"]);
    wait_until("the job started", Duration::from_secs(20), || {
        starts(&p).len() == 1
    });
    let first = starts(&p)[0].pid;
    // Nobody can judge us dead while Redis is paused, but the alive key may lapse the moment
    // it answers again: the worker stops the job itself before that.
    redis.pause();
    wait_until(
        "the worker killed its own command",
        Duration::from_secs(40),
        || !pid_alive(first),
    );
    redis.resume();
    wait_until(
        "the job went back and runs again",
        Duration::from_secs(40),
        || starts(&p).len() == 2,
    );
    std::fs::write(p.path().join("finish"), "").unwrap();
    wait_until("the second run finished", Duration::from_secs(30), || {
        stamps(&p).iter().any(|s| s.kind == "stop")
    });
    wait_until("nothing left queued", Duration::from_secs(30), || {
        redis.llen("queue:default") == 0
    });
    let retries: usize = redis::cmd("ZCARD")
        .arg("retry")
        .query(&mut redis.conn())
        .unwrap();
    assert_eq!(retries, 0, "handed back, not retried");
    w.stop(Duration::from_secs(30));
    assert_eq!(starts(&p).len(), 2);
}

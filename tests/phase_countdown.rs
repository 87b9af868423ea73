//! A frozen worker's phase (SIGSTOP: it cannot kill anything itself) is killed by its command
//! guardian before the phase's lock can expire in Redis, whatever `ttl_secs` says and with
//! either fetch: the guardian's countdown is the smaller of the liveness budget and the lock's
//! deadline. Before, only the liveness countdown (7-13 s after the last beat) existed, and
//! none at all with `--fetch basic`, so a new holder's phase could run beside the frozen one.
//! Real binary, real redis-server; waits are conditions with deadlines.
mod support;

use std::time::Duration;
use support::*;

const LOCK: &str = "playguard:marquee:m1";

fn frozen_phase_dies_before_its_lock_expires(fetch: &str) {
    let redis = RedisServer::start();
    let p = Project::new();
    p.script(
        "jobs/bin/long",
        "#!/bin/sh\necho $$ > phase.pid\nexec sleep 120\n",
    );
    p.write(
        "jobs/app.toml",
        "[[job]]\nclass = \"MarqueeCycle\"\n\
         lock = { key = \"playguard:marquee:{args.0}\", ttl_secs = 5, label = \"Marquee {args.0}\" }\n\
         [[job.phase]]\nname = \"sync\"\nrun = [\"jobs/bin/long\"]\n",
    );
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["--fetch", fetch])
        .start();
    enqueue(&redis, &["MarqueeCycle", "m1"]);
    wait_until("the phase started", Duration::from_secs(30), || {
        p.read("phase.pid").trim().parse::<i32>().is_ok()
    });
    let phase: i32 = p.read("phase.pid").trim().parse().unwrap();
    w.signal("STOP");
    // Until the lock is gone from Redis: from then on another holder may take it, so the
    // frozen holder's phase must already be dead.
    let mut c = redis.conn();
    let mut phase_gone_first = None;
    wait_until("the lock expired in Redis", Duration::from_secs(30), || {
        let held: bool = redis::cmd("EXISTS").arg(LOCK).query(&mut c).unwrap();
        let alive = pid_alive(phase);
        if !held {
            phase_gone_first = Some(!alive);
        }
        !held
    });
    w.signal("CONT");
    assert_eq!(
        phase_gone_first,
        Some(true),
        "the frozen worker's phase outlived its lock ({fetch} fetch)"
    );
    w.stop(Duration::from_secs(30));
}

#[test]
fn a_frozen_workers_phase_dies_before_its_lock_expires_with_reliable_fetch() {
    frozen_phase_dies_before_its_lock_expires("reliable");
}

#[test]
fn a_frozen_workers_phase_dies_before_its_lock_expires_with_basic_fetch() {
    frozen_phase_dies_before_its_lock_expires("basic");
}

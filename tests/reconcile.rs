//! The phased reconcile cycle with real worker processes and a real redis-server: exclusion
//! per Marquee, renewal, phases killed at the lease deadline, Redis loss, seed 004's paused
//! worker. Phase scripts write a ledger: `<start|end> <marquee> <phase> <fence> <pid> <epoch>`.
mod support;

use std::time::Duration;
use support::*;

fn manifest(ttl: f64, phases: &[(&str, &str)]) -> String {
    let mut s = format!(
        "[[job]]\nclass = \"PlayguardJob\"\n\
         lock = {{ key = \"playguard:marquee:{{args.0}}\", ttl_secs = {ttl}, when_locked = \"skip\", label = \"Marquee {{args.0}}\" }}\n\
         on_lock_lost = \"abort\"\n"
    );
    for (name, script) in phases {
        s += &format!("[[job.phase]]\nname = \"{name}\"\nrun = [\"{script}\"]\n");
    }
    s
}

#[test]
fn two_workers_never_overlap_on_one_marquee_and_different_marquees_run_in_parallel() {
    let redis = RedisServer::start();
    let p = Project::new();
    p.script("jobs/bin/phase", &phase_ledger_script(0.4));
    p.write(
        "jobs/app.toml",
        &manifest(
            10.0,
            &[
                ("sync_git", "jobs/bin/phase"),
                ("pull_images", "jobs/bin/phase"),
            ],
        ),
    );
    let w1 = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-c", "6"])
        .start();
    let w2 = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-c", "6"])
        .start();
    w1.wait_for_line("playguard starting", Duration::from_secs(10));
    w2.wait_for_line("playguard starting", Duration::from_secs(10));
    for _ in 0..10 {
        enqueue(&redis, &["PlayguardJob", "1", "--queue", "default"]);
    }
    enqueue(&redis, &["PlayguardJob", "2"]);
    enqueue(&redis, &["PlayguardJob", "3"]);
    let skipped = || {
        [&w1, &w2]
            .iter()
            .map(|w| w.count_lines("Marquee 1 is already locked"))
            .sum::<usize>()
    };
    let done_cycles = |e: &[PhaseEntry], m: &str| {
        e.iter()
            .filter(|x| x.kind == "end" && x.marquee == m && x.phase == "pull_images")
            .count()
    };
    wait_until("all 12 jobs accounted for", Duration::from_secs(60), || {
        let e = phase_ledger(&p);
        done_cycles(&e, "1") + skipped() == 10
            && done_cycles(&e, "2") == 1
            && done_cycles(&e, "3") == 1
    });
    let e = phase_ledger(&p);
    for m in ["1", "2", "3"] {
        let iv = phase_intervals(&e, m);
        for pair in iv.windows(2) {
            assert!(
                pair[0].1 <= pair[1].0,
                "Marquee {m}: phases overlap: {pair:?}"
            );
            assert!(
                pair[0].2 <= pair[1].2,
                "Marquee {m}: fences go backwards: {pair:?}"
            );
        }
    }
    assert!(skipped() >= 1, "some jobs for Marquee 1 were skipped");
    assert_eq!(redis.zcard("retry"), 0, "skips are not retried");
    // Marquees 2 and 3 were reconciled at the same time.
    let (a, b) = (phase_intervals(&e, "2"), phase_intervals(&e, "3"));
    let overlap = a.iter().any(|x| b.iter().any(|y| x.0 < y.1 && y.0 < x.1));
    assert!(overlap, "different Marquees ran in parallel: {a:?} {b:?}");
}

#[test]
fn renewal_carries_a_cycle_longer_than_the_ttl() {
    let redis = RedisServer::start();
    let p = Project::new();
    p.script("jobs/bin/phase", &phase_ledger_script(2.0));
    p.write(
        "jobs/app.toml",
        &manifest(
            3.0,
            &[
                ("a", "jobs/bin/phase"),
                ("b", "jobs/bin/phase"),
                ("c", "jobs/bin/phase"),
                ("d", "jobs/bin/phase"),
            ],
        ),
    );
    let w = Worker::builder(&redis).jobs(p.path()).start();
    enqueue(&redis, &["PlayguardJob", "7"]);
    wait_until("cycle complete", Duration::from_secs(30), || {
        w.saw("lock released (cycle complete)")
    });
    let e = phase_ledger(&p);
    let ends: Vec<&str> = e
        .iter()
        .filter(|x| x.kind == "end")
        .map(|x| x.phase.as_str())
        .collect();
    assert_eq!(ends, ["a", "b", "c", "d"]);
    assert!(!w.saw("lock lost"), "{}", w.output());
    let exists: bool = redis::cmd("EXISTS")
        .arg("playguard:marquee:7")
        .query(&mut redis.conn())
        .unwrap();
    assert!(!exists, "released at the end");
}

#[test]
fn a_hung_phase_is_killed_before_its_lease_can_expire() {
    let redis = RedisServer::start();
    let p = Project::new();
    // The phase starts a grandchild too: the whole process group must go.
    p.script(
        "jobs/bin/hang",
        "#!/bin/sh\nsleep 60 &\necho $! > grandchild.pid\necho $$ > child.pid\nsleep 60\n",
    );
    p.script("jobs/bin/phase", &phase_ledger_script(0.0));
    p.write(
        "jobs/app.toml",
        &manifest(
            2.0,
            &[("hang", "jobs/bin/hang"), ("after", "jobs/bin/phase")],
        ),
    );
    let w = Worker::builder(&redis).jobs(p.path()).start();
    enqueue(&redis, &["PlayguardJob", "9"]);
    let read_pid = |f: &str| {
        std::fs::read_to_string(p.path().join(f))
            .ok()
            .and_then(|s| s.trim().parse::<i32>().ok())
    };
    wait_until("hung phase started", Duration::from_secs(10), || {
        read_pid("grandchild.pid").is_some() && read_pid("child.pid").is_some()
    });
    let (child, grandchild) = (
        read_pid("child.pid").unwrap(),
        read_pid("grandchild.pid").unwrap(),
    );
    // The moment the lease key is gone (another holder could now acquire), the phase is dead.
    let mut c = redis.conn();
    wait_until("lease key expired", Duration::from_secs(10), || {
        !redis::cmd("EXISTS")
            .arg("playguard:marquee:9")
            .query::<bool>(&mut c)
            .unwrap()
    });
    assert!(
        !pid_alive(child),
        "phase process still alive after its lease expired"
    );
    assert!(
        !pid_alive(grandchild),
        "phase's grandchild still alive after its lease expired"
    );
    wait_until("abort logged", Duration::from_secs(10), || {
        w.saw("aborted: lock lost")
    });
    assert!(
        phase_ledger(&p).iter().all(|e| e.phase != "after"),
        "no later phase started"
    );
    assert_eq!(redis.zcard("retry"), 0);
}

#[test]
fn redis_lost_during_a_phase_starts_no_further_phase_and_the_worker_survives() {
    let mut redis = RedisServer::start();
    let p = Project::new();
    p.script("jobs/bin/phase", &phase_ledger_script(1.5));
    p.script(
        "jobs/bin/mark",
        "#!/bin/sh\necho \"$PLAYGUARD_ARGS\" >> marks.log\n",
    );
    p.write(
        "jobs/app.toml",
        &(manifest(
            30.0,
            &[("first", "jobs/bin/phase"), ("second", "jobs/bin/phase")],
        ) + "[[job]]\nclass = \"MarkJob\"\nrun = [\"jobs/bin/mark\"]\n"),
    );
    let w = Worker::builder(&redis).jobs(p.path()).start();
    enqueue(&redis, &["PlayguardJob", "5"]);
    wait_until("first phase running", Duration::from_secs(10), || {
        phase_ledger(&p).iter().any(|e| e.kind == "start")
    });
    redis.stop();
    wait_until("cycle aborted", Duration::from_secs(20), || {
        w.saw("aborted: lock lost")
    });
    redis.restart();
    enqueue(&redis, &["MarkJob", "\"after-restart\""]);
    wait_until(
        "next job ran after Redis returned",
        Duration::from_secs(30),
        || {
            std::fs::read_to_string(p.path().join("marks.log"))
                .unwrap_or_default()
                .contains("after-restart")
        },
    );
    assert!(
        phase_ledger(&p).iter().all(|e| e.phase != "second"),
        "no further phase started"
    );
}

#[test]
fn paused_worker_loses_its_lease_and_leaves_the_new_owner_alone() {
    // Seed 004: worker A freezes past its lease, B acquires with a higher fence, A wakes.
    let redis = RedisServer::start();
    let p = Project::new();
    p.script("jobs/bin/short", &phase_ledger_script(0.5));
    p.script("jobs/bin/long", &phase_ledger_script(2.0));
    p.write(
        "jobs/app.toml",
        &manifest(3.0, &[("one", "jobs/bin/short"), ("two", "jobs/bin/long")]),
    );
    let a = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-c", "1"])
        .start();
    enqueue(&redis, &["PlayguardJob", "4"]);
    wait_until("A in phase one", Duration::from_secs(10), || {
        phase_ledger(&p).iter().any(|e| e.kind == "start")
    });
    a.signal("STOP");
    let mut c = redis.conn();
    wait_until("A's lease expired", Duration::from_secs(10), || {
        !redis::cmd("EXISTS")
            .arg("playguard:marquee:4")
            .query::<bool>(&mut c)
            .unwrap()
    });
    let b = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-c", "1"])
        .start();
    enqueue(&redis, &["PlayguardJob", "4"]);
    wait_until("B holds the lock", Duration::from_secs(10), || {
        b.saw("lock acquired")
    });
    let fence_b: i64 = redis::cmd("GET")
        .arg("playguard:marquee:4:fence")
        .query(&mut c)
        .unwrap();
    let token_b: String = redis::cmd("GET")
        .arg("playguard:marquee:4")
        .query(&mut c)
        .unwrap();
    a.signal("CONT");
    wait_until("A aborted", Duration::from_secs(10), || {
        a.saw("aborted: lock lost")
    });
    let still: Option<String> = redis::cmd("GET")
        .arg("playguard:marquee:4")
        .query(&mut c)
        .unwrap();
    assert_eq!(
        still.as_deref(),
        Some(token_b.as_str()),
        "B's lock survived A's cleanup"
    );
    wait_until("B finished", Duration::from_secs(20), || {
        b.saw("lock released (cycle complete)")
    });
    let e = phase_ledger(&p);
    let a_fence = e.iter().map(|x| x.fence).min().unwrap();
    assert!(
        fence_b > a_fence,
        "B's fence {fence_b} is higher than A's {a_fence}"
    );
    assert!(
        !e.iter().any(|x| x.phase == "two" && x.fence == a_fence),
        "A started no further phase: {e:?}"
    );
    assert!(e
        .iter()
        .any(|x| x.kind == "end" && x.phase == "two" && x.fence == fence_b));
}

#[test]
fn the_running_phase_is_visible_to_sidekiqs_workers_api() {
    if !ruby_available() {
        return;
    }
    let redis = RedisServer::start();
    let p = Project::new();
    p.script("jobs/bin/quick", &phase_ledger_script(0.0));
    p.script("jobs/bin/slow", &phase_ledger_script(30.0));
    p.write(
        "jobs/app.toml",
        &manifest(
            60.0,
            &[
                ("sync_git", "jobs/bin/quick"),
                ("pull_images", "jobs/bin/slow"),
            ],
        ),
    );
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-t", "1"])
        .start();
    enqueue(&redis, &["PlayguardJob", "6"]);
    let mut seen = String::new();
    wait_until(
        "Workers API shows the phase",
        Duration::from_secs(20),
        || {
            seen = ruby(
                &redis,
                r#"Sidekiq::Workers.new.each { |_p, _t, w| puts [w["phase"], w["payload"]["args"].inspect, w["queue"]].join(" ") }"#,
            );
            seen.trim() == "pull_images [6] default"
        },
    );
    w.stop(Duration::from_secs(15));
}

/// The last phase's proof of ownership (folded into the release when there is no database):
/// a lock taken over while the last phase ran ends the cycle as lost, never complete, and the
/// new owner's lock survives; a lock that vanished likewise.
#[test]
fn a_lock_lost_during_the_last_phase_is_lost_not_complete() {
    let redis = RedisServer::start();
    let p = Project::new();
    p.script("jobs/bin/phase", &phase_ledger_script(1.0));
    p.write(
        "jobs/app.toml",
        &manifest(30.0, &[("only", "jobs/bin/phase")]),
    );
    let w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-c", "2"])
        .start();
    let mut c = redis.conn();
    for (marquee, takeover) in [("8", true), ("9", false)] {
        enqueue(&redis, &["PlayguardJob", marquee]);
        let key = format!("playguard:marquee:{marquee}");
        wait_until("the phase is running", Duration::from_secs(10), || {
            phase_ledger(&p)
                .iter()
                .any(|e| e.kind == "start" && e.marquee == marquee)
        });
        if takeover {
            let _: () = redis::cmd("SET")
                .arg(&key)
                .arg("another-owner")
                .query(&mut c)
                .unwrap();
        } else {
            let _: () = redis::cmd("DEL").arg(&key).query(&mut c).unwrap();
        }
        wait_until("the phase ended", Duration::from_secs(10), || {
            phase_ledger(&p)
                .iter()
                .any(|e| e.kind == "end" && e.marquee == marquee)
        });
        wait_until("the cycle ended", Duration::from_secs(10), || {
            w.output().matches("aborted: lock lost").count() == 1 + usize::from(!takeover)
        });
        let still: Option<String> = redis::cmd("GET").arg(&key).query(&mut c).unwrap();
        if takeover {
            assert_eq!(
                still.as_deref(),
                Some("another-owner"),
                "the new owner's lock survived"
            );
        } else {
            assert_eq!(still, None, "a vanished lock is not recreated");
        }
    }
    assert!(
        !w.saw("lock released (cycle complete)"),
        "neither cycle was complete"
    );
    let records: Vec<String> = redis::cmd("KEYS")
        .arg("playguard:locks:*")
        .query(&mut c)
        .unwrap();
    for r in records {
        let n: i64 = redis::cmd("HLEN").arg(&r).query(&mut c).unwrap();
        assert_eq!(n, 0, "holder records dropped from {r}");
    }
    assert_eq!(redis.zcard("retry"), 0);
}

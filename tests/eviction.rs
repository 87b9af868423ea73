//! Redis that may evict keys, against a real redis-server: with reliable fetch a
//! `maxmemory-policy` other than noeviction stops the start (exit 2, one line naming the
//! policy and the fix) unless `--allow-eviction`; with it, and with basic fetch, a WARN at
//! start and whenever the policy changes, a gauge and /health detail. And whatever the cause
//! (eviction, a flush by an operator, a failover to a lagging replica), an alive key that
//! vanished is a lapsed lease at the next beat (the test DELs it on its own server): the
//! running copy stops, so it cannot run beside the copy
//! another worker recovered for longer than about one beat (the overlap is printed).
//! Each test owns its redis-server; waits are conditions with deadlines, never timings.

mod support;

use std::time::Duration;
use support::*;

fn config_set(redis: &RedisServer, name: &str, value: &str) {
    let _: () = redis::cmd("CONFIG")
        .arg(&["SET", name, value])
        .query(&mut redis.conn())
        .unwrap();
}

/// Before: the policy was never read; the worker started and ran.
#[test]
fn reliable_fetch_refuses_an_evicting_policy_unless_allowed() {
    let redis = RedisServer::start_with(&["--maxmemory-policy", "allkeys-lru"]);
    let p = Project::with_jobs(&[("OkJob", "ok", RECORD_RAN)]);
    let mut w = Worker::builder(&redis).jobs(p.path()).start();
    assert_eq!(
        w.wait_exit(Duration::from_secs(30)),
        Some(2),
        "{}",
        w.output()
    );
    let line = w
        .line_with("maxmemory-policy is allkeys-lru")
        .unwrap_or_else(|| panic!("names the policy:\n{}", w.output()));
    assert!(
        line.contains("noeviction") && line.contains("--allow-eviction"),
        "names the fix: {line}"
    );
    assert_eq!(
        w.count_lines("maxmemory-policy"),
        1,
        "one line:\n{}",
        w.output()
    );

    let port = free_port();
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args([
            "--allow-eviction",
            "--metrics-addr",
            &format!("127.0.0.1:{port}"),
        ])
        .start();
    w.wait_for_line("playguard starting", Duration::from_secs(30));
    assert!(
        w.saw("WARN") && w.saw("maxmemory-policy is allkeys-lru"),
        "{}",
        w.output()
    );
    enqueue(&redis, &["OkJob"]);
    wait_until("the job ran", Duration::from_secs(30), || {
        p.lines("ran.log").len() == 1
    });
    wait_until(
        "the gauge shows the policy",
        Duration::from_secs(20),
        || {
            scrape(port)
                .get("playguard_redis_maxmemory_policy{policy=\"allkeys-lru\"}")
                .copied()
                == Some(1.0)
        },
    );
    // A change at run time is seen at a beat: WARN once, gauge and /health follow.
    config_set(&redis, "maxmemory-policy", "volatile-ttl");
    w.wait_for_line("maxmemory-policy is volatile-ttl", Duration::from_secs(20));
    let (status, body) = http_get(port, "/health").unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("maxmemory-policy is volatile-ttl"), "{body}");
    assert_eq!(scrape(port)["playguard_redis_evicting"], 1.0);
    config_set(&redis, "maxmemory-policy", "noeviction");
    w.wait_for_line("maxmemory-policy no longer evicts", Duration::from_secs(20));
    assert_eq!(scrape(port)["playguard_redis_evicting"], 0.0);
    w.signal("TERM");
    assert_eq!(w.wait_exit(Duration::from_secs(30)), Some(0));
}

#[test]
fn basic_fetch_warns_of_an_evicting_policy_and_runs() {
    let redis = RedisServer::start_with(&["--maxmemory-policy", "volatile-lru"]);
    let p = Project::with_jobs(&[("OkJob", "ok", RECORD_RAN)]);
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["--fetch", "basic"])
        .start();
    w.wait_for_line("maxmemory-policy is volatile-lru", Duration::from_secs(30));
    enqueue(&redis, &["OkJob"]);
    wait_until("the job ran", Duration::from_secs(30), || {
        p.lines("ran.log").len() == 1
    });
    w.signal("TERM");
    assert_eq!(w.wait_exit(Duration::from_secs(30)), Some(0));
}

/// A command that stamps `start <pid> <ns>`, then `tick <pid> <ns>` every 0.1 s until `finish`
/// exists, then `stop`.
const LONG: &str = "#!/bin/sh\n\
    echo \"start $$ $(date +%s%N)\" >> stamps\n\
    while [ ! -f finish ]; do echo \"tick $$ $(date +%s%N)\" >> stamps; sleep 0.1; done\n\
    echo \"stop $$ $(date +%s%N)\" >> stamps\n";

/// (kind, pid, ns) of every stamp.
fn stamps(p: &Project) -> Vec<(String, i32, u128)> {
    p.lines("stamps")
        .iter()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            Some((
                f.first()?.to_string(),
                f.get(1)?.parse().ok()?,
                f.get(2)?.parse().ok()?,
            ))
        })
        .collect()
}

fn starts(p: &Project) -> Vec<(i32, u128)> {
    stamps(p)
        .into_iter()
        .filter(|s| s.0 == "start")
        .map(|s| (s.1, s.2))
        .collect()
}

/// Before: the beat re-created the vanished key without noticing, and the first copy ran on
/// beside the recovered one until it finished.
#[test]
fn a_vanished_alive_key_stops_the_running_copy_at_the_next_beat() {
    let redis = RedisServer::start();
    let p = Project::with_jobs(&[("LongJob", "long", LONG)]);
    let w1 = Worker::builder(&redis).jobs(p.path()).start();
    let id1 = w1.identity(&redis);
    enqueue(&redis, &["LongJob"]);
    wait_until("the first copy started", Duration::from_secs(20), || {
        starts(&p).len() == 1
    });
    let first = starts(&p)[0].0;
    let w2 = Worker::builder(&redis).jobs(p.path()).start();
    w2.identity(&redis);

    // As an eviction would: the key goes, right after one of w1's beats, and with it the
    // key that spaces sweeps out (`playguard:sweep`), so w2's next sweep, within one sweep
    // period and before w1's next beat, recovers the job: the worst case for the overlap.
    let beat = |redis: &RedisServer| -> Option<String> {
        redis::cmd("HGET")
            .arg(&id1)
            .arg("beat")
            .query(&mut redis.conn())
            .unwrap()
    };
    let before = beat(&redis);
    wait_until("w1 beats", Duration::from_secs(20), || {
        beat(&redis) != before
    });
    let gone_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let _: () = redis::cmd("DEL")
        .arg(format!("playguard:alive:{id1}"))
        .arg("playguard:sweep")
        .query(&mut redis.conn())
        .unwrap();
    wait_until("the first copy stopped", Duration::from_secs(20), || {
        !pid_alive(first)
    });
    w1.wait_for_line("our alive key had vanished", Duration::from_secs(20));
    wait_until("the job runs again", Duration::from_secs(30), || {
        starts(&p).len() >= 2
    });
    let second = starts(&p)[1];
    let last_of_first = stamps(&p)
        .iter()
        .filter(|s| s.1 == first)
        .map(|s| s.2)
        .max()
        .unwrap();
    let ms = |a: u128, b: u128| (a as f64 - b as f64) / 1e6;
    eprintln!(
        "alive key deleted: first copy's last tick {:.0} ms after the delete; second copy started {:.0} ms after it; overlap {:.0} ms",
        ms(last_of_first, gone_at),
        ms(second.1, gone_at),
        ms(last_of_first, second.1).max(0.0)
    );
    assert_ne!(second.0, first);

    std::fs::write(p.path().join("finish"), "").unwrap();
    wait_until("the second copy finished", Duration::from_secs(30), || {
        stamps(&p).iter().any(|s| s.0 == "stop")
    });
    wait_until(
        "queue and working lists empty",
        Duration::from_secs(30),
        || redis.llen("queue:default") == 0 && redis.working_jobs().is_empty(),
    );
    // A copy w1 took by its blocked pop before it learnt of the lapse is stopped with the
    // first and runs once more: at least once, never beside a live copy past that beat.
    let copies = starts(&p);
    for (pid, _) in &copies {
        wait_until("every copy ended", Duration::from_secs(20), || {
            !pid_alive(*pid)
        });
    }
    eprintln!("copies started: {}", copies.len());
    for w in [&w1, &w2] {
        w.signal("TERM");
    }
    let (mut w1, mut w2) = (w1, w2);
    assert_eq!(w1.wait_exit(Duration::from_secs(30)), Some(0));
    assert_eq!(w2.wait_exit(Duration::from_secs(30)), Some(0));
}

//! Lock keys rendered from job data: an argument that would make the key collide with another
//! key (`9:fence`, a key of another class, an empty, missing or null argument) is refused
//! before any Redis write and the job goes to `dead` as Playguard::BadLockKey; `{{`/`}}` put
//! literal braces (a Cluster hash tag) in a key.
//! Each test owns its redis-server; waits are conditions with deadlines, never timings.

mod support;

use serde_json::Value;
use std::time::Duration;
use support::*;

fn dead(redis: &RedisServer) -> Vec<Value> {
    let raw: Vec<String> = redis::cmd("ZRANGE")
        .arg(&["dead", "0", "-1"])
        .query(&mut redis.conn())
        .unwrap();
    raw.iter()
        .map(|r| serde_json::from_str(r).unwrap())
        .collect()
}

fn keys(redis: &RedisServer, pattern: &str) -> Vec<String> {
    let mut k: Vec<String> = redis::cmd("KEYS")
        .arg(pattern)
        .query(&mut redis.conn())
        .unwrap();
    k.sort();
    k
}

/// Each argument that cannot name a Marquee of its own ends in dead, untouched keys, no phase run.
#[test]
fn arguments_that_would_collide_are_refused_and_the_job_is_dead() {
    let redis = RedisServer::start();
    let p = Project::new();
    p.script(
        "jobs/bin/phase",
        "#!/bin/sh\nprintf '%s %s\\n' \"$PLAYGUARD_ARGS\" \"$PLAYGUARD_LOCK_KEY\" >> ran.log\n",
    );
    p.write(
        "jobs/app.toml",
        r#"
[[job]]
class = "PlayguardJob"
lock = { key = "playguard:marquee:{args.0}", ttl_secs = 30, label = "Marquee {args.0}" }
[[job.phase]]
name = "a"
run = ["jobs/bin/phase"]

[[job]]
class = "Tagged"
lock = { key = "pg:{{marquee-{args.0}}}", ttl_secs = 30 }
[[job.phase]]
name = "a"
run = ["jobs/bin/phase"]
"#,
    );
    // Marquee 9 holds its lock (fence 4) while the bad jobs arrive.
    let mut c = redis.conn();
    let _: () = redis::cmd("SET")
        .arg(&["playguard:marquee:9", "other-token", "EX", "600"])
        .query(&mut c)
        .unwrap();
    let _: () = redis::cmd("SET")
        .arg(&["playguard:marquee:9:fence", "4"])
        .query(&mut c)
        .unwrap();
    let before = keys(&redis, "*");
    let bad = [
        r#"["9:fence"]"#,
        r#"["9:"]"#,
        r#"[""]"#,
        "[]",
        "[null]",
        r#"[{"id":9}]"#,
        r#"["a b"]"#,
        r#"["x}"]"#,
    ];
    let w = Worker::builder(&redis).jobs(p.path()).start();
    for (i, args) in bad.iter().enumerate() {
        let payload = format!(
            r#"{{"class":"PlayguardJob","args":{args},"queue":"default","jid":"bad{i}","retry":true,"created_at":1.5,"enqueued_at":1.5}}"#
        );
        let _: () = redis::cmd("LPUSH")
            .arg("queue:default")
            .arg(&payload)
            .query(&mut c)
            .unwrap();
    }
    wait_until("every bad job is dead", Duration::from_secs(30), || {
        dead(&redis).len() == bad.len()
    });
    for d in dead(&redis) {
        assert_eq!(d["error_class"], "Playguard::BadLockKey", "{d}");
        let msg = d["error_message"].as_str().unwrap();
        assert!(msg.contains("lock key") && msg.contains("args.0"), "{msg}");
    }
    // The log goes out through a writer thread, so its line can trail the dead entry.
    w.wait_for_line("Playguard::BadLockKey", Duration::from_secs(10));
    let retry: i64 = redis::cmd("ZCARD").arg("retry").query(&mut c).unwrap();
    assert_eq!(retry, 0, "a key that can never be valid is not retried");
    assert!(!p.path().join("ran.log").exists(), "no phase ran");
    let fence: String = redis::cmd("GET")
        .arg("playguard:marquee:9:fence")
        .query(&mut c)
        .unwrap();
    assert_eq!(fence, "4");
    let after: Vec<String> = keys(&redis, "*")
        .into_iter()
        .filter(|k| k.starts_with("playguard:marquee") || k.starts_with("pg:"))
        .collect();
    let before: Vec<String> = before
        .into_iter()
        .filter(|k| k.starts_with("playguard:marquee"))
        .collect();
    assert_eq!(after, before, "no lock key was written");

    // Braces: `{{`/`}}` are literal, so the key carries a Cluster hash tag.
    enqueue(&redis, &["Tagged", "7"]);
    wait_until("the tagged job ran", Duration::from_secs(20), || {
        std::fs::read_to_string(p.path().join("ran.log")).is_ok_and(|s| s.contains("pg:"))
    });
    let ran = std::fs::read_to_string(p.path().join("ran.log")).unwrap();
    assert_eq!(ran, "[7] pg:{marquee-7}\n");
    // The release follows the phase's exit: wait for it rather than race it.
    wait_until("the tagged lock released", Duration::from_secs(20), || {
        keys(&redis, "pg:*") == vec!["pg:{marquee-7}:fence"]
    });
}

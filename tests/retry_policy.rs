//! A manifest job's failure policy, checked by what lands in a real redis-server when the real
//! binary runs real failing commands: `retry_in` sets the retry set's score (a list by retry
//! count, its last one repeated, or an expression of `count`, Sidekiq's jitter added),
//! `max_retries` caps the payload's count, exit 97 discards (nothing in retry or dead), 98
//! kills (dead at once), 99 snoozes (`schedule`, retry_count unchanged, capped), and
//! `on_exhausted` runs with the dead job. `playguard check` refuses bad values by file and
//! entry.
mod support;

use serde_json::Value;
use std::process::Command;
use std::time::Duration;
use support::*;

const PATIENCE: Duration = Duration::from_secs(30);

const FAIL: &str = "#!/bin/sh\necho boom >&2\nexit 1\n";
const DISCARD: &str = "#!/bin/sh\necho not worth it >&2\nexit 97\n";
const KILL: &str = "#!/bin/sh\necho hopeless >&2\nexit 98\n";
const SNOOZE: &str = "#!/bin/sh\necho busy >&2\necho snooze 600 >&2\nexit 99\n";
/// Writes the JSON it gets on stdin to `exhausted.json` (renamed once whole).
const GAVE_UP: &str = "#!/bin/sh\ncat > exhausted.tmp && mv exhausted.tmp exhausted.json\n";

const MANIFEST: &str = r#"
[[job]]
class = "ListJob"
run = ["jobs/bin/fail"]
retry_in = [300, 3600]

[[job]]
class = "ExprJob"
run = ["jobs/bin/fail"]
retry_in = "count * 1000 + 500"

[[job]]
class = "CappedJob"
run = ["jobs/bin/fail"]
max_retries = 2
on_exhausted = ["jobs/bin/gave-up"]

[[job]]
class = "DiscardJob"
run = ["jobs/bin/discard"]

[[job]]
class = "KillJob"
run = ["jobs/bin/kill"]

[[job]]
class = "SnoozeJob"
run = ["jobs/bin/snooze"]
"#;

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

fn payload(class: &str, jid: &str, extra: &str) -> String {
    format!(
        r#"{{"class":"{class}","args":[],"jid":"{jid}","queue":"default","retry":25,"created_at":1.0,"enqueued_at":1.0{extra}}}"#
    )
}

/// Every member of the sorted set `key` with its score, by jid.
fn members(redis: &RedisServer, key: &str) -> Vec<(Value, f64)> {
    let m: Vec<(String, f64)> = redis::cmd("ZRANGE")
        .arg(key)
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query(&mut redis.conn())
        .unwrap();
    m.into_iter()
        .map(|(p, s)| (serde_json::from_str(&p).unwrap(), s))
        .collect()
}

fn find<'a>(set: &'a [(Value, f64)], jid: &str) -> Option<&'a (Value, f64)> {
    set.iter().find(|(j, _)| j["jid"] == jid)
}

/// `score` is `delay` plus Sidekiq's jitter (rand(10) * (count + 1)) after a failure between
/// `before` and `after`.
fn assert_delay(score: f64, before: f64, after: f64, delay: f64, count: f64, what: &str) {
    let (lo, hi) = (before + delay, after + delay + 9.0 * (count + 1.0));
    assert!(
        score >= lo.floor() && score <= hi.ceil(),
        "{what}: score {score} not in [{lo}, {hi}]"
    );
}

#[test]
fn what_lands_in_redis_follows_the_manifest_policy() {
    let redis = RedisServer::start();
    let p = Project::new();
    for (name, body) in [
        ("fail", FAIL),
        ("discard", DISCARD),
        ("kill", KILL),
        ("snooze", SNOOZE),
        ("gave-up", GAVE_UP),
    ] {
        p.script(&format!("jobs/bin/{name}"), body);
    }
    p.write("jobs/app.toml", MANIFEST);
    let later = r#","retry_count":1,"failed_at":1.0"#;
    let before = now();
    push_to_default(
        &redis,
        vec![
            payload("ListJob", "list-first", ""),
            payload("ListJob", "list-third", later),
            payload("ExprJob", "expr-third", later),
            payload("CappedJob", "capped", later),
            payload("DiscardJob", "discard", ""),
            payload("KillJob", "kill", ""),
            payload("SnoozeJob", "snooze", r#","retry_count":3,"failed_at":1.0"#),
            payload("SnoozeJob", "snoozed-out", r#","playguard_snoozes":100"#),
        ],
    );
    let w = Worker::builder(&redis).jobs(p.path()).start();
    wait_until("every job settled", PATIENCE, || {
        redis.llen("queue:default") == 0
            && redis.working_jobs().is_empty()
            && redis.zcard("retry") + redis.zcard("dead") + redis.zcard("schedule") == 7
            && w.saw("discarded by its exit code")
    });
    let after = now();
    let retry = members(&redis, "retry");
    let dead = members(&redis, "dead");
    let schedule = members(&redis, "schedule");

    // retry_in: a list by retry count (its last one past the end), an expression of count.
    let (j, s) = find(&retry, "list-first").expect("list-first retried");
    assert_eq!(j["retry_count"], 0);
    assert_delay(*s, before, after, 300.0, 0.0, "list, count 0");
    let (j, s) = find(&retry, "list-third").expect("list-third retried");
    assert_eq!(j["retry_count"], 2);
    assert_delay(*s, before, after, 3600.0, 2.0, "list past its end");
    let (_, s) = find(&retry, "expr-third").expect("expr-third retried");
    assert_delay(*s, before, after, 2500.0, 2.0, "expression at count 2");

    // max_retries = 2 over the payload's retry: 25: its third failure is its last.
    let (j, _) = find(&dead, "capped").expect("capped job dead at max_retries");
    assert_eq!(j["retry_count"], 2);
    assert!(find(&retry, "capped").is_none());
    wait_until("on_exhausted ran", PATIENCE, || {
        p.path().join("exhausted.json").exists()
    });
    let hook: Value = serde_json::from_str(&p.read("exhausted.json")).unwrap();
    assert_eq!(hook["job"]["jid"], "capped");
    assert_eq!(hook["event"], "death");

    // Exit 97: dropped, nothing kept anywhere; the line says when (discarded_at).
    for set in [&retry, &dead, &schedule] {
        assert!(find(set, "discard").is_none());
    }
    assert!(w
        .line_with("discarded by its exit code")
        .unwrap()
        .contains("discarded_at"));

    // Exit 98: dead at once, retries unused.
    let (j, _) = find(&dead, "kill").expect("killed job in dead");
    assert_eq!(j["retry_count"], 0);
    assert_eq!(j["error_message"], "hopeless");
    assert!(find(&retry, "kill").is_none());

    // Exit 99: back to schedule in 600 s, retry_count as it was, the snooze counted.
    let (j, s) = find(&schedule, "snooze").expect("snoozed job in schedule");
    assert_eq!(j["retry_count"], 3);
    assert_eq!(j["playguard_snoozes"], 1);
    assert!(j.get("error_message").is_none());
    assert!(
        *s >= (before + 600.0).floor() && *s <= (after + 600.0).ceil(),
        "{s}"
    );
    // Past the cap a snooze is a failure: retried as usual.
    let (j, _) = find(&retry, "snoozed-out").expect("snooze past the cap retried");
    assert_eq!(j["retry_count"], 0);
    assert_eq!(find(&retry, "snooze"), None);
    assert_eq!(dead.len(), 2);
}

#[test]
fn check_refuses_bad_policies_naming_file_and_entry() {
    let redis = RedisServer::start();
    for (bad, says) in [
        ("retry_in = [10, -5]", "-5"),
        ("retry_in = []", "empty"),
        ("retry_in = \"count ** 4 + system\"", "unknown name"),
        ("retry_in = \"10 - count * 5\"", "negative"),
        ("retry_in = \"count +\"", "retry_in"),
        ("max_retries = -1", "max_retries"),
        ("on_exhausted = []", "on_exhausted"),
    ] {
        let p = Project::with_jobs(&[("OkJob", "ok", "#!/bin/sh\n")]);
        p.write(
            "jobs/policy.toml",
            &format!("[[job]]\nclass = \"Bad\"\nrun = [\"jobs/bin/ok\"]\n{bad}\n"),
        );
        let out = Command::new(bin())
            .args(["check", "-r", &redis.url()])
            .current_dir(p.path())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad}: {err}");
        assert!(
            err.contains("policy.toml")
                && err.contains("[[job]] #1 (class \"Bad\")")
                && err.contains(says),
            "{bad}: {err}"
        );
    }
}

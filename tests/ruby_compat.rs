//! Compatibility with the real Ruby Sidekiq 6.4.1: its client enqueues, playguard runs, its API
//! reads back. Each test owns its redis-server.
mod support;

use serde_json::Value;
use std::collections::HashMap;
use std::time::Duration;
use support::*;

const RECORD: &str = "#!/bin/sh\nprintf '%s\\t%s\\t%s\\n' \"$PLAYGUARD_JID\" \"$PLAYGUARD_CLASS\" \"$PLAYGUARD_ARGS\" >> ledger.tsv\n";
const FAIL: &str =
    "#!/bin/sh\necho \"first line\" >&2\necho \"it broke: $PLAYGUARD_ARGS\" >&2\nexit 1\n";

fn project() -> Project {
    Project::with_jobs(&[
        ("RecordJob", "record", RECORD),
        ("SendReportJob", "record", RECORD),
        ("FailJob", "fail", FAIL),
    ])
}

fn ledger(p: &Project) -> Vec<(String, String, Value)> {
    std::fs::read_to_string(p.path().join("ledger.tsv"))
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let mut it = l.splitn(3, '\t');
            let jid = it.next().unwrap().to_string();
            let class = it.next().unwrap().to_string();
            let args = serde_json::from_str(it.next().unwrap()).expect("PLAYGUARD_ARGS is JSON");
            (jid, class, args)
        })
        .collect()
}

#[test]
fn ruby_enqueued_jobs_run_once_with_exact_args() {
    if !ruby_available() {
        return;
    }
    let redis = RedisServer::start();
    let p = project();
    // Client.push, push_bulk of 1,000, perform_in, and an ActiveJob-shaped wrapper payload.
    let sent = ruby(
        &redis,
        r#"
out = {}
odd = ["ünïcødé ✓", {"nested" => {"deep" => [1, nil, 2.5, true]}}, nil, 3.14159, 2**70, -0.0, 1e-7]
jid = Sidekiq::Client.push("class" => "RecordJob", "args" => odd, "queue" => "default")
out[jid] = odd
bulk = (1..1000).map { |i| [i, "s#{i}"] }
Sidekiq::Client.push_bulk("class" => "RecordJob", "args" => bulk).each_with_index { |j, i| out[j] = bulk[i] }
later = Sidekiq::Client.push("class" => "RecordJob", "args" => ["later", 1.5], "at" => Time.now.to_f + 1)
out[later] = ["later", 1.5]
aj_args = [{"_aj_globalid" => "gid://app/Marquee/7"}, "x", 2**70]
aj = Sidekiq::Client.push("class" => "ActiveJob::QueueAdapters::SidekiqAdapter::JobWrapper",
  "wrapped" => "SendReportJob", "queue" => "default",
  "args" => [{"job_class" => "SendReportJob", "job_id" => "5f7c", "provider_job_id" => nil,
              "queue_name" => "default", "priority" => nil, "arguments" => aj_args,
              "executions" => 0, "exception_executions" => {}, "locale" => "en",
              "timezone" => "UTC", "enqueued_at" => "2026-12-01T00:00:00Z"}])
out[aj] = aj_args
puts JSON.generate(out)
"#,
    );
    let sent: HashMap<String, Value> = serde_json::from_str(sent.trim()).unwrap();
    assert_eq!(sent.len(), 1003);
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-c", "10", "--poll-interval", "0.5"])
        .start();
    wait_until("all 1003 jobs ran", Duration::from_secs(90), || {
        ledger(&p).len() >= 1003
    });
    let runs = ledger(&p);
    let mut seen: HashMap<String, usize> = HashMap::new();
    for (jid, class, args) in &runs {
        *seen.entry(jid.clone()).or_default() += 1;
        let expected = sent.get(jid).unwrap_or_else(|| panic!("unknown jid {jid}"));
        assert_eq!(&args, &expected, "args of {jid} ({class})");
        if jid.len() == 24 && expected.as_array().map(|a| a.len()) == Some(3) && expected[1] == "x"
        {
            assert_eq!(class, "SendReportJob");
        }
    }
    assert_eq!(seen.len(), 1003, "every jid ran");
    assert!(seen.values().all(|n| *n == 1), "each ran exactly once");
    // The float and big-int spellings themselves survived (not just their values).
    let odd = runs
        .iter()
        .find(|r| r.2.as_array().is_some_and(|a| a.len() == 7))
        .unwrap();
    let text = serde_json::to_string(&odd.2).unwrap();
    assert!(
        text.contains("1180591620717411303424") && text.contains("3.14159"),
        "{text}"
    );
    // Sidekiq's own API agrees, once the heartbeat flushed the counters.
    wait_until("Stats.processed == 1003", Duration::from_secs(20), || {
        ruby(&redis, "puts Sidekiq::Stats.new.processed").trim() == "1003"
    });
    w.stop(Duration::from_secs(15));
}

#[test]
fn failures_show_in_ruby_retry_and_dead_sets() {
    if !ruby_available() {
        return;
    }
    let redis = RedisServer::start();
    let p = project();
    ruby(
        &redis,
        r#"
Sidekiq::Client.push("class" => "FailJob", "args" => ["r"], "retry" => 2, "backtrace" => 5,
  "tags" => ["alpha", "beta"], "custom_key" => {"keep" => [1, 2.0]})
Sidekiq::Client.push("class" => "FailJob", "args" => ["d"], "retry" => 0)
Sidekiq::Client.push("class" => "FailJob", "args" => ["gone"], "retry" => false)
Sidekiq::Client.push("class" => "NoSuchJob", "args" => [1])
"#,
    );
    let mut w = Worker::builder(&redis).jobs(p.path()).start();
    wait_until("retry and dead entries", Duration::from_secs(30), || {
        ruby(
            &redis,
            "puts [Sidekiq::RetrySet.new.size, Sidekiq::DeadSet.new.size].inspect",
        )
        .trim()
            == "[2, 1]"
    });
    let report = ruby(
        &redis,
        r#"
r = Sidekiq::RetrySet.new.find { |j| j.args == ["r"] }
n = Sidekiq::RetrySet.new.find { |j| j.klass == "NoSuchJob" }
d = Sidekiq::DeadSet.new.first
puts JSON.generate({
  "r_msg" => r["error_message"], "r_class" => r["error_class"], "r_count" => r["retry_count"],
  "r_failed" => r["failed_at"].is_a?(Float), "r_custom" => r["custom_key"], "r_tags" => r.tags,
  "r_bt" => r.error_backtrace, "r_at" => (r.at - Time.now).round,
  "n_class" => n["error_class"], "n_msg" => n["error_message"],
  "d_args" => d.args, "d_msg" => d["error_message"], "d_count" => d["retry_count"]})
"#,
    );
    let v: Value = serde_json::from_str(report.trim()).unwrap();
    assert_eq!(v["r_msg"], "it broke: [\"r\"]");
    assert_eq!(v["r_class"], "Playguard::CommandFailed");
    assert_eq!(v["r_count"], 0);
    assert_eq!(v["r_failed"], true);
    assert_eq!(v["r_custom"], serde_json::json!({"keep": [1, 2.0]}));
    assert_eq!(v["r_tags"], serde_json::json!(["alpha", "beta"]));
    assert_eq!(
        v["r_bt"],
        serde_json::json!(["it broke: [\"r\"]", "first line"])
    );
    let at = v["r_at"].as_i64().unwrap();
    assert!((14..=25).contains(&at), "first retry in 15..24 s, got {at}");
    assert_eq!(v["n_class"], "NameError");
    assert_eq!(v["n_msg"], "uninitialized constant NoSuchJob");
    assert_eq!(v["d_args"], serde_json::json!(["d"]));
    assert_eq!(v["d_count"], 0);
    // The custom key's number types survive byte for byte in the stored string.
    let mut c = redis.conn();
    let members: Vec<String> = redis::cmd("ZRANGE")
        .arg("retry")
        .arg(0)
        .arg(-1)
        .query(&mut c)
        .unwrap();
    assert!(
        members
            .iter()
            .any(|m| m.contains(r#""custom_key":{"keep":[1,2.0]}"#)),
        "{members:?}"
    );
    wait_until(
        "Stats processed 4 / failed 4",
        Duration::from_secs(20),
        || {
            ruby(
                &redis,
                "s = Sidekiq::Stats.new; puts [s.processed, s.failed].inspect",
            )
            .trim()
                == "[4, 4]"
        },
    );
    w.stop(Duration::from_secs(15));
}

fn garbage_goes_to_dead_and_the_worker_keeps_going(fetch: &str) {
    let redis = RedisServer::start();
    let p = project();
    let mut c = redis.conn();
    let not_utf8: &[u8] = b"\xff\xfe{\"class\":\"RecordJob\"}";
    let garbage: [&[u8]; 3] = [b"{not json", b"[1,2]", not_utf8];
    for g in garbage {
        let _: () = redis::cmd("LPUSH")
            .arg("queue:default")
            .arg(g)
            .query(&mut c)
            .unwrap();
    }
    // Unreadable members of the schedule set must not stall the poller either.
    let _: () = redis::cmd("ZADD")
        .arg("schedule")
        .arg(1)
        .arg(b"\xfe sched")
        .query(&mut c)
        .unwrap();
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["--fetch", fetch, "--poll-interval", "0.2"])
        .start();
    let out = std::process::Command::new(bin())
        .args([
            "enqueue",
            "-r",
            &redis.url(),
            "RecordJob",
            "after-garbage",
            "--in",
            "0.5",
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    wait_until("the next job ran", Duration::from_secs(20), || {
        ledger(&p)
            .iter()
            .any(|r| r.2 == serde_json::json!(["after-garbage"]))
    });
    let dead: Vec<Vec<u8>> = redis::cmd("ZRANGE")
        .arg("dead")
        .arg(0)
        .arg(-1)
        .query(&mut c)
        .unwrap();
    for g in garbage.iter().chain([&&b"\xfe sched"[..]]) {
        assert!(
            dead.iter().any(|d| d == g),
            "{:?} in dead: {dead:?}",
            String::from_utf8_lossy(g)
        );
    }
    w.wait_for_line("invalid job payload", Duration::from_secs(10));
    // Acks are batched after the job's command exits: wait for the last one to land.
    wait_until(
        "nothing left in working lists",
        Duration::from_secs(10),
        || redis.working_jobs().is_empty(),
    );
    w.stop(Duration::from_secs(15));
}

#[test]
fn garbage_goes_to_dead_reliable_fetch() {
    garbage_goes_to_dead_and_the_worker_keeps_going("reliable");
}

#[test]
fn garbage_goes_to_dead_basic_fetch() {
    garbage_goes_to_dead_and_the_worker_keeps_going("basic");
}

#[test]
fn bad_manifest_stops_startup_naming_file_and_entry() {
    let redis = RedisServer::start();
    let p = Project::new();
    p.write("jobs/broken.toml", "[[job]]\nclass = \"Half\"\n");
    let mut w = Worker::builder(&redis).jobs(p.path()).start();
    assert_ne!(w.wait_exit(Duration::from_secs(10)), Some(0));
    let out = w.output();
    assert!(out.contains("broken.toml") && out.contains("Half"), "{out}");
    let chk = std::process::Command::new(bin())
        .args(["check", "-r", &redis.url()])
        .current_dir(p.path())
        .output()
        .unwrap();
    assert!(!chk.status.success());
    assert!(String::from_utf8_lossy(&chk.stderr).contains("broken.toml"));
}

#[test]
fn dead_set_is_trimmed_as_sidekiq_trims_it() {
    let redis = RedisServer::start();
    let p = project();
    let mut c = redis.conn();
    // 10,000 old-but-recent entries, plus one older than 180 days.
    let now = playguard::test_support::now_f64();
    let mut zadd = redis::cmd("ZADD");
    zadd.arg("dead");
    for i in 0..10_000 {
        zadd.arg(now - 1000.0 + i as f64 / 100.0)
            .arg(format!("{{\"jid\":\"old{i}\"}}"));
    }
    zadd.arg(now - 181.0 * 86400.0).arg("{\"jid\":\"ancient\"}");
    let _: () = zadd.query(&mut c).unwrap();
    let job = r#"{"class":"FailJob","args":["d"],"retry":0,"jid":"fresh0000000000000000000","queue":"default"}"#;
    let _: () = redis::cmd("LPUSH")
        .arg("queue:default")
        .arg(job)
        .query(&mut c)
        .unwrap();
    // A payload of an unknown class without `retry` is dropped, as Ruby's global handler does.
    let stray =
        r#"{"class":"NoSuchJob","args":[],"jid":"stray000000000000000000","queue":"default"}"#;
    let _: () = redis::cmd("LPUSH")
        .arg("queue:default")
        .arg(stray)
        .query(&mut c)
        .unwrap();
    let mut w = Worker::builder(&redis).jobs(p.path()).start();
    wait_until(
        "the fresh failure reached dead",
        Duration::from_secs(20),
        || {
            let d: Vec<String> = redis::cmd("ZRANGE")
                .arg("dead")
                .arg(-1)
                .arg(-1)
                .query(&mut c)
                .unwrap();
            d.first().is_some_and(|m| m.contains("fresh0000"))
        },
    );
    wait_until("both jobs counted", Duration::from_secs(20), || {
        redis::cmd("GET")
            .arg("stat:failed")
            .query::<Option<i64>>(&mut c)
            .unwrap()
            == Some(2)
    });
    // api.rb: ZREMRANGEBYSCORE by 180 days, then ZREMRANGEBYRANK 0 -10000 (keeps 9,999).
    let n: i64 = redis::cmd("ZCARD").arg("dead").query(&mut c).unwrap();
    assert_eq!(n, 9_999);
    let ancient: Option<f64> = redis::cmd("ZSCORE")
        .arg("dead")
        .arg("{\"jid\":\"ancient\"}")
        .query(&mut c)
        .unwrap();
    assert!(ancient.is_none());
    let retries: i64 = redis::cmd("ZCARD").arg("retry").query(&mut c).unwrap();
    assert_eq!(
        retries, 0,
        "the stray unknown-class job without `retry` was dropped"
    );
    w.stop(Duration::from_secs(15));
}

//! Payload options a Rails app sets with `sidekiq_options`: `retry_for` (the retry window) and
//! `dead: false` (an exhausted job, or a poison pill, is dropped, not kept in `dead`). Jobs are
//! pushed by the real Ruby Sidekiq 6.4.1 client, which carries these keys as they are.
mod support;

use std::time::Duration;
use support::*;

const FAIL: &str = "#!/bin/sh\necho \"failed: $PLAYGUARD_ARGS\" >&2\nexit 1\n";

fn sets(redis: &RedisServer) -> String {
    ruby(
        redis,
        "puts JSON.generate(retry: Sidekiq::RetrySet.new.map(&:args).sort, \
         dead: Sidekiq::DeadSet.new.map(&:args).sort, \
         failed: Sidekiq::Stats.new.failed)",
    )
    .trim()
    .to_string()
}

/// A job past its `retry_for` window goes to dead on its next failure though its count is far
/// from 25; with `dead: false` it is dropped instead; one inside its window is retried.
#[test]
fn retry_for_window_and_dead_false() {
    if !ruby_available() {
        return;
    }
    let redis = RedisServer::start();
    let p = Project::with_jobs(&[("FailJob", "fail", FAIL)]);
    ruby(
        &redis,
        r#"
two_hours_ago = Time.now.to_f - 7200
Sidekiq::Client.push("class" => "FailJob", "args" => ["past"], "retry_for" => 3600,
  "retry_count" => 3, "failed_at" => two_hours_ago)
Sidekiq::Client.push("class" => "FailJob", "args" => ["past-dead-false"], "retry_for" => 3600,
  "retry_count" => 3, "failed_at" => two_hours_ago, "dead" => false)
Sidekiq::Client.push("class" => "FailJob", "args" => ["inside"], "retry_for" => 3600,
  "retry_count" => 3, "failed_at" => Time.now.to_f - 60)
Sidekiq::Client.push("class" => "FailJob", "args" => ["fresh"], "retry" => 5, "retry_for" => 172800)
Sidekiq::Client.push("class" => "FailJob", "args" => ["zero-dead-false"], "retry" => 0, "dead" => false)
"#,
    );
    let mut w = Worker::builder(&redis).jobs(p.path()).start();
    let want = r#"{"retry":[["fresh"],["inside"]],"dead":[["past"]],"failed":5}"#;
    let mut last = String::new();
    wait_until("five failures settled", Duration::from_secs(30), || {
        last = sets(&redis);
        last == want
    });
    assert_eq!(last, want);
    w.stop(Duration::from_secs(15));
}

/// A poison pill (recovered three times from dead workers) whose payload says `dead: false` is
/// dropped; one without it goes to dead as before.
#[test]
fn poison_pill_with_dead_false_is_dropped() {
    let redis = RedisServer::start();
    let p = Project::with_jobs(&[("FailJob", "fail", FAIL)]);
    let kept =
        r#"{"class":"FailJob","args":["kept"],"jid":"aaaaaaaaaaaaaaaaaaaaaaaa","queue":"default"}"#;
    let dropped = r#"{"class":"FailJob","args":["dropped"],"jid":"bbbbbbbbbbbbbbbbbbbbbbbb","queue":"default","dead":false}"#;
    let mut c = redis.conn();
    redis::cmd("RPUSH")
        .arg("playguard:poison")
        .arg(kept)
        .arg(dropped)
        .query::<()>(&mut c)
        .unwrap();
    let mut w = Worker::builder(&redis).jobs(p.path()).start();
    wait_until("the poison list is empty", Duration::from_secs(20), || {
        redis.llen("playguard:poison") == 0
    });
    let dead: Vec<String> = redis::cmd("ZRANGE")
        .arg("dead")
        .arg(0)
        .arg(-1)
        .query(&mut c)
        .unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert!(dead[0].contains(r#""args":["kept"]"#), "{dead:?}");
    w.wait_for_line(
        "poison pill with dead: false: dropped",
        Duration::from_secs(5),
    );
    w.stop(Duration::from_secs(15));
}

/// Pro's `expires_at`: an expired job is dropped with one line naming its jid, an unexpired
/// one runs. Enterprise `unique_for`/`unique_until`, Pro `bid` and Enterprise `encrypt` go to
/// dead as `Playguard::Unsupported`, whatever `retry` says, with a message naming the option.
#[test]
fn expires_at_honoured_and_unsupported_options_refused() {
    if !ruby_available() {
        return;
    }
    let redis = RedisServer::start();
    let p = Project::with_jobs(&[(
        "RecordJob",
        "record",
        "#!/bin/sh\necho \"$PLAYGUARD_ARGS\" >> ran.txt\n",
    )]);
    let out = ruby(
        &redis,
        r#"
push = ->(extra) { Sidekiq::Client.push({"class" => "RecordJob"}.merge(extra)) }
puts push.({"args" => ["expired"], "expires_at" => Time.now.to_f - 5})
push.({"args" => ["fresh"], "expires_at" => Time.now.to_f + 3600})
push.({"args" => ["unique"], "unique_for" => 3600})
push.({"args" => ["until"], "unique_for" => 60, "unique_until" => "start"})
push.({"args" => ["batch"], "bid" => "b1c2d3", "retry" => false})
push.({"args" => ["secret"], "encrypt" => true, "dead" => false})
push.({"args" => ["plain"], "encrypt" => false})
"#,
    );
    let expired_jid = out.trim().to_string();
    let mut w = Worker::builder(&redis).jobs(p.path()).start();
    let dead = || {
        ruby(
            &redis,
            "puts JSON.generate(Sidekiq::DeadSet.new.map { |j| [j.args[0], j['error_class'], j['error_message']] }.sort)",
        )
    };
    let mut entries = Vec::new();
    wait_until("four refused jobs in dead", Duration::from_secs(30), || {
        entries = serde_json::from_str::<Vec<(String, String, String)>>(dead().trim()).unwrap();
        entries.len() == 4
    });
    let names: Vec<&str> = entries.iter().map(|e| e.0.as_str()).collect();
    assert_eq!(names, ["batch", "secret", "unique", "until"]);
    for (arg, class, message) in &entries {
        assert_eq!(class, "Playguard::Unsupported");
        let option = match arg.as_str() {
            "batch" => "`bid`",
            "secret" => "`encrypt`",
            _ => "`unique_for`",
        };
        assert!(message.contains(option), "{message}");
        assert!(message.contains("Ruby Sidekiq"), "{message}");
    }
    wait_until("the runnable jobs ran", Duration::from_secs(20), || {
        p.lines("ran.txt").len() == 2
    });
    let mut ran = p.lines("ran.txt");
    ran.sort();
    assert_eq!(ran, [r#"["fresh"]"#, r#"["plain"]"#]);
    w.wait_for_line(
        &format!("job {expired_jid} expired"),
        Duration::from_secs(10),
    );
    assert_eq!(w.count_lines(&format!("job {expired_jid} expired")), 1);
    assert_eq!(redis.llen("queue:default"), 0);
    w.stop(Duration::from_secs(15));
}

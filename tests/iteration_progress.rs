//! A cycle's progress in `it-<jid>`, where Sidekiq 8.1's Busy and Retries pages read it, with
//! real workers and a private redis-server. Keys: `it-<jid>`, `queue:default`, `retry`, the
//! test lock `lock:progress`.
//!
//! [`read_as_api_rb`] reads the hash as Sidekiq 8.1.7's `Sidekiq::IterableJobQuery` does
//! (lib/sidekiq/api.rb): one HGETALL of `"it-#{jid}"` per jid, no state when the reply is
//! empty, then `executions` = `raw["ex"].to_i`, `runtime` = `raw["rt"].to_f` and `cursor` =
//! `Sidekiq.load_json(raw["c"])` (the raw string if that is not JSON). The Busy and Retries
//! views (web/views/busy.html.erb, retries.html.erb) show `cursor.inspect`, `executions` and
//! `runtime` from it.

mod support;

use std::time::Duration;
use support::*;

const PATIENCE: Duration = Duration::from_secs(20);

/// What 8.1's `IterableJobQuery::State` makes of `it-<jid>`: (executions, runtime, cursor).
fn read_as_api_rb(redis: &RedisServer, jid: &str) -> Option<(i64, f64, serde_json::Value)> {
    let raw: std::collections::HashMap<String, String> = redis::cmd("HGETALL")
        .arg(format!("it-{jid}"))
        .query(&mut redis.conn())
        .unwrap();
    if raw.is_empty() {
        return None;
    }
    // Ruby's to_i and to_f read a leading number and give 0 for none; these fields must be
    // whole numbers for it to be exact, which the asserts below check through parse().
    let ex = raw
        .get("ex")
        .map_or(0, |v| v.parse().expect("ex is an integer"));
    let rt = raw
        .get("rt")
        .map_or(0.0, |v| v.parse().expect("rt is a float"));
    let c = raw.get("c").map_or(serde_json::Value::Null, |v| {
        serde_json::from_str(v).expect("c is JSON")
    });
    Some((ex, rt, c))
}

fn ttl(redis: &RedisServer, jid: &str) -> i64 {
    redis::cmd("TTL")
        .arg(format!("it-{jid}"))
        .query(&mut redis.conn())
        .unwrap()
}

const MANIFEST: &str = r#"
[[job]]
class = "ProgressJob"
lock = { key = "lock:progress", ttl_secs = 30 }
retry_in = [1]
[[job.phase]]
name = "sync_git"
run = ["jobs/bin/step", "one"]
[[job.phase]]
name = "pull_images"
run = ["jobs/bin/step", "two"]
"#;

/// Touches `$1.started`, waits for `$1.go`; fails once when `$1.fail` exists (and removes it).
const STEP: &str = "#!/bin/sh\n\
    if [ -e \"$1.fail\" ]; then rm \"$1.fail\"; echo 'failing once' >&2; exit 1; fi\n\
    touch \"$1.started\"\n\
    while [ ! -e \"$1.go\" ]; do sleep 0.02; done\n\
    rm \"$1.go\" \"$1.started\"\n";

/// While a cycle runs, `it-<jid>` says which phase it is in, that this is its first run, and
/// how long it has run; the key carries Sidekiq's 30-day TTL and is gone once the cycle
/// completes.
#[test]
fn a_running_cycle_shows_its_phase_runs_and_runtime_as_an_iterable_job() {
    let redis = RedisServer::start();
    let p = Project::new();
    p.script("jobs/bin/step", STEP);
    p.write("jobs/app.toml", MANIFEST);
    let w = Worker::builder(&redis).jobs(p.path()).start();
    let jid = enqueue(&redis, &["ProgressJob"]);

    wait_until("the first phase", PATIENCE, || {
        p.path().join("one.started").exists()
    });
    let (ex, rt, c) = read_as_api_rb(&redis, &jid).expect("state while the cycle runs");
    assert_eq!((ex, c), (1, serde_json::json!("sync_git")));
    assert!(rt >= 0.0);
    let t = ttl(&redis, &jid);
    assert!(t > 30 * 86_400 - 60 && t <= 30 * 86_400, "TTL {t}");

    p.go("one");
    wait_until("the second phase", PATIENCE, || {
        p.path().join("two.started").exists()
    });
    let (ex, rt2, c) = read_as_api_rb(&redis, &jid).unwrap();
    assert_eq!((ex, c), (1, serde_json::json!("pull_images")));
    assert!(rt2 >= rt, "runtime grows: {rt} then {rt2}");

    p.go("two");
    w.wait_for_line("lock released (cycle complete)", PATIENCE);
    wait_until(
        "it-<jid> removed once the cycle completed",
        PATIENCE,
        || read_as_api_rb(&redis, &jid).is_none(),
    );
}

/// A cycle that failed keeps its state for the Retries page (the phase it failed in, one run),
/// and its retry counts a second execution and adds to the runtime.
#[test]
fn a_failed_cycle_keeps_its_state_for_the_retries_page_and_its_retry_counts_on() {
    let redis = RedisServer::start();
    let p = Project::new();
    p.script("jobs/bin/step", STEP);
    p.write("jobs/app.toml", MANIFEST);
    p.write("two.fail", "");
    let w = Worker::builder(&redis).jobs(p.path()).start();
    let jid = enqueue(&redis, &["ProgressJob"]);

    wait_until("the first phase", PATIENCE, || {
        p.path().join("one.started").exists()
    });
    p.go("one");
    w.wait_for_line("fail: retry scheduled", PATIENCE);
    let (ex, rt, c) = read_as_api_rb(&redis, &jid).expect("state kept for the Retries page");
    assert_eq!((ex, c), (1, serde_json::json!("pull_images")));
    assert!(rt > 0.0);

    // retry_in = [1]: the scheduled poller brings it back within seconds.
    wait_until("the retry's first phase", PATIENCE, || {
        p.path().join("one.started").exists()
    });
    let (ex, rt2, c) = read_as_api_rb(&redis, &jid).unwrap();
    assert_eq!((ex, c), (2, serde_json::json!("sync_git")));
    assert!(rt2 >= rt, "runtime adds up over runs: {rt} then {rt2}");
    p.go("one");
    wait_until("the retry's second phase", PATIENCE, || {
        p.path().join("two.started").exists()
    });
    p.go("two");
    w.wait_for_line("lock released (cycle complete)", PATIENCE);
    wait_until(
        "it-<jid> removed once the retry completed",
        PATIENCE,
        || read_as_api_rb(&redis, &jid).is_none(),
    );
    assert_eq!(redis.zcard("retry"), 0);
}

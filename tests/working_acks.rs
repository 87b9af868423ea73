//! Reliable fetch's batched acknowledgements with the real binary and a real redis-server:
//! finished jobs leave `playguard:working:<identity>:default` even while an older job keeps
//! running, and when the list's old end is not what the worker pictured (here: a stray payload
//! the test puts there, as a failover to a lagging replica can) the worker removes each
//! finished job by its own LREM instead of trimming the wrong ones.
mod support;

use serde_json::json;
use std::time::Duration;
use support::*;

fn job(class: &str, i: usize) -> String {
    json!({"retry": true, "queue": "default", "class": class, "args": [i],
        "jid": format!("{class}-{i:04}"), "created_at": 1.0, "enqueued_at": 1.0})
    .to_string()
}

fn project() -> Project {
    let p = Project::new();
    p.script("jobs/bin/hold", BLOCK_UNTIL_RELEASE);
    p.script("jobs/bin/fast", RECORD_JID);
    p.write(
        "jobs/app.toml",
        "[[job]]\nclass = \"HoldJob\"\nrun = [\"jobs/bin/hold\"]\n\n\
         [[job]]\nclass = \"FastJob\"\nrun = [\"jobs/bin/fast\"]\n",
    );
    p
}

fn working(redis: &RedisServer) -> (String, Vec<String>) {
    let mut c = redis.conn();
    let ids: Vec<String> = redis::cmd("SMEMBERS")
        .arg("processes")
        .query(&mut c)
        .unwrap();
    assert_eq!(ids.len(), 1, "{ids:?}");
    let key = format!("playguard:working:{}:default", ids[0]);
    let items: Vec<String> = redis::cmd("LRANGE")
        .arg(&key)
        .arg(0)
        .arg(-1)
        .query(&mut c)
        .unwrap();
    (key, items)
}

fn registered(redis: &RedisServer) -> bool {
    redis::cmd("SCARD")
        .arg("processes")
        .query::<i64>(&mut redis.conn())
        .unwrap()
        == 1
}

#[test]
fn finished_jobs_leave_the_working_list_while_an_older_one_runs() {
    let redis = RedisServer::start();
    let p = project();
    let hold = job("HoldJob", 0);
    push_to_default(&redis, std::slice::from_ref(&hold));
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-c", "5"])
        .start();
    wait_until("registered", Duration::from_secs(20), || registered(&redis));
    wait_until(
        "the long job holds the list",
        Duration::from_secs(20),
        || working(&redis).1 == [hold.clone()],
    );
    let fast: Vec<String> = (0..40).map(|i| job("FastJob", i)).collect();
    push_to_default(&redis, &fast);
    wait_until("40 fast jobs ran", Duration::from_secs(60), || {
        p.lines("ledger.txt").len() >= 40
    });
    wait_until(
        "only the long job is left in the working list",
        Duration::from_secs(20),
        || working(&redis).1 == [hold.clone()],
    );
    std::fs::write(p.path().join("release"), "").unwrap();
    wait_until("the working list is empty", Duration::from_secs(20), || {
        working(&redis).1.is_empty()
    });
    assert_eq!(p.lines("ledger.txt").len(), 40, "each fast job ran once");
    w.stop(Duration::from_secs(20));
}

#[test]
fn a_list_not_as_pictured_is_acknowledged_job_by_job() {
    let redis = RedisServer::start();
    let p = project();
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-c", "10"])
        .start();
    wait_until("registered", Duration::from_secs(20), || registered(&redis));
    // A payload the worker never fetched, at the list's old end.
    let stray = job("StrayJob", 0);
    let (key, _) = working(&redis);
    let _: () = redis::cmd("RPUSH")
        .arg(&key)
        .arg(&stray)
        .query(&mut redis.conn())
        .unwrap();
    let fast: Vec<String> = (0..200).map(|i| job("FastJob", i)).collect();
    push_to_default(&redis, &fast);
    wait_until("200 fast jobs ran", Duration::from_secs(90), || {
        p.lines("ledger.txt").len() >= 200
    });
    wait_until(
        "only the stray payload is left in the working list",
        Duration::from_secs(20),
        || working(&redis).1 == [stray.clone()],
    );
    let mut runs = p.lines("ledger.txt");
    runs.sort();
    runs.dedup();
    assert_eq!(runs.len(), 200, "each fast job ran once");
    w.stop(Duration::from_secs(20));
    // A clean stop drains what is left: the stray payload goes to the queue, not lost.
    let queued = redis.lrange("queue:default");
    assert_eq!(queued, [stray]);
}

/// The trim's guard itself (`lua/ack_oldest.lua`): it trims only when both ends it is told
/// about are where the worker pictured them, and otherwise changes nothing.
#[test]
fn the_trim_guard_refuses_a_list_whose_old_end_differs() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let script = redis::Script::new(include_str!("../lua/ack_oldest.lua"));
    let list = |c: &mut redis::Connection| -> Vec<String> {
        redis::cmd("LRANGE")
            .arg("w")
            .arg(0)
            .arg(-1)
            .query(c)
            .unwrap()
    };
    // LPUSH a b c d: d at the head, a (the oldest) at the right end.
    let _: () = redis::cmd("LPUSH")
        .arg("w")
        .arg(&["a", "b", "c", "d"])
        .query(&mut c)
        .unwrap();
    let trim = |c: &mut redis::Connection, n: usize, first: &str, last: &str| -> i64 {
        script
            .key("w")
            .arg(n)
            .arg(first)
            .arg(last)
            .invoke(c)
            .unwrap()
    };
    assert_eq!(trim(&mut c, 2, "b", "c"), 0, "b is not the oldest");
    assert_eq!(trim(&mut c, 2, "a", "c"), 0, "c is not the second oldest");
    assert_eq!(trim(&mut c, 5, "a", "e"), 0, "the list is shorter");
    assert_eq!(
        list(&mut c),
        ["d", "c", "b", "a"],
        "refusals change nothing"
    );
    assert_eq!(trim(&mut c, 2, "a", "b"), 1);
    assert_eq!(list(&mut c), ["d", "c"]);
    assert_eq!(trim(&mut c, 2, "c", "d"), 1);
    let exists: i64 = redis::cmd("EXISTS").arg("w").query(&mut c).unwrap();
    assert_eq!(exists, 0, "the last trim leaves no key");
}

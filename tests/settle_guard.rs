//! A failed job's outcome is written only while the job is still in our working list: once
//! another process's orphan sweep took it (our liveness lease lapsed; here the test moves it
//! to a queue no worker serves, as `lua/recover.lua` would hand it to another process), a
//! retry written for our copy would make it run one extra time. Real binary, real
//! redis-server; waits are conditions with deadlines.
mod support;

use serde_json::json;
use std::time::Duration;
use support::*;

#[test]
fn a_failure_is_not_written_to_retry_once_the_job_was_recovered_elsewhere() {
    let redis = RedisServer::start();
    let p = Project::new();
    p.script(
        "jobs/bin/fail",
        "#!/bin/sh\ntouch started\nwhile [ ! -e release ]; do sleep 0.05; done\necho boom >&2\nexit 1\n",
    );
    p.write(
        "jobs/app.toml",
        "[[job]]\nclass = \"FailJob\"\nrun = [\"jobs/bin/fail\"]\n",
    );
    let job = json!({"retry": true, "queue": "default", "class": "FailJob", "args": [],
        "jid": "0123456789abcdef01234567", "created_at": 1.0, "enqueued_at": 1.0})
    .to_string();
    push_to_default(&redis, std::slice::from_ref(&job));
    let w = Worker::builder(&redis).jobs(p.path()).start();
    wait_until("the job started", Duration::from_secs(30), || {
        p.path().join("started").exists()
    });
    let mut c = redis.conn();
    let ids: Vec<String> = redis::cmd("SMEMBERS")
        .arg("processes")
        .query(&mut c)
        .unwrap();
    assert_eq!(ids.len(), 1, "{ids:?}");
    let working = format!("playguard:working:{}:default", ids[0]);
    assert_eq!(redis.lrange(&working), std::slice::from_ref(&job));
    // The sweep's move: out of our working list, onto a queue another process serves.
    let moved: i64 = redis::cmd("LMOVE")
        .arg(&working)
        .arg("queue:elsewhere")
        .arg("RIGHT")
        .arg("LEFT")
        .query::<Option<String>>(&mut c)
        .unwrap()
        .map_or(0, |_| 1);
    assert_eq!(moved, 1);
    p.write("release", "");
    w.wait_for_line("outcome not recorded", Duration::from_secs(30));
    assert_eq!(redis.zcard("retry"), 0, "{}", w.output());
    assert_eq!(redis.zcard("dead"), 0);
    assert_eq!(redis.lrange("queue:elsewhere"), [job]);
    assert_eq!(redis.llen(&working), 0);
}

#[test]
fn a_failure_of_a_job_still_ours_is_written_to_retry_and_leaves_the_working_list() {
    let redis = RedisServer::start();
    let p = Project::new();
    p.script("jobs/bin/fail", "#!/bin/sh\necho boom >&2\nexit 1\n");
    p.write(
        "jobs/app.toml",
        "[[job]]\nclass = \"FailJob\"\nrun = [\"jobs/bin/fail\"]\n",
    );
    let job = json!({"retry": true, "queue": "default", "class": "FailJob", "args": [],
        "jid": "0123456789abcdef01234568", "created_at": 1.0, "enqueued_at": 1.0})
    .to_string();
    push_to_default(&redis, std::slice::from_ref(&job));
    let w = Worker::builder(&redis).jobs(p.path()).start();
    wait_until("the retry is written", Duration::from_secs(30), || {
        redis.zcard("retry") == 1
    });
    assert_eq!(redis.working_jobs(), Vec::<String>::new(), "{}", w.output());
    assert!(!w.saw("outcome not recorded"), "{}", w.output());
}

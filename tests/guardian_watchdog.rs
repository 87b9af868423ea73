//! A command guardian that stops answering (SIGSTOP here; an exec stuck on a hung file system
//! blocks it the same way) reaps nothing and reports no exit, so its commands' jobs would run
//! on past their `timeout_secs` while `/health` said 200. The worker notices the unanswered
//! ping, `/health` fails, the guardian is replaced and the job ends (a failure, retried).
//! Real binary, real redis-server; waits are conditions with deadlines.
mod support;

use serde_json::json;
use std::time::Duration;
use support::*;

/// The pid of the guardian serving worker `worker`, found by its argument.
fn guardian_of(worker: i32) -> Option<i32> {
    let arg = format!("playguard-shepherd:{worker}");
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
        cmd.split(|&b| b == 0)
            .any(|a| a == arg.as_bytes())
            .then_some(pid)
    })
}

fn job(class: &str, jid: &str) -> String {
    json!({"retry": true, "queue": "default", "class": class, "args": [],
        "jid": jid, "created_at": 1.0, "enqueued_at": 1.0})
    .to_string()
}

#[test]
fn a_stopped_guardian_fails_health_and_its_jobs_still_end() {
    let redis = RedisServer::start();
    let p = Project::new();
    p.script(
        "jobs/bin/slow",
        "#!/bin/sh\ntouch started\nexec sleep 120\n",
    );
    p.script("jobs/bin/fast", RECORD_JID);
    p.write(
        "jobs/app.toml",
        "[[job]]\nclass = \"SlowJob\"\nrun = [\"jobs/bin/slow\"]\ntimeout_secs = 2\n\n\
         [[job]]\nclass = \"FastJob\"\nrun = [\"jobs/bin/fast\"]\n",
    );
    push_to_default(&redis, &[job("SlowJob", "5105105105105105105105aa")]);
    let port = free_port();
    let w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["--metrics-addr", &format!("127.0.0.1:{port}")])
        .start();
    wait_until("the slow job started", Duration::from_secs(30), || {
        p.path().join("started").exists()
    });
    let old = guardian_of(w.pid()).expect("a guardian runs the command");
    wait_until("/health answers 200", Duration::from_secs(30), || {
        http_get(port, "/health").is_some_and(|(s, _)| s == 200)
    });
    signal(old, "STOP");
    wait_until("/health fails", Duration::from_secs(30), || {
        http_get(port, "/health").is_some_and(|(s, b)| s == 503 && b.contains("guardian"))
    });
    wait_until(
        "the job failed and was retried",
        Duration::from_secs(30),
        || redis.zcard("retry") == 1,
    );
    wait_until(
        "the stopped guardian is gone",
        Duration::from_secs(30),
        || !pid_alive(old),
    );
    w.wait_for_line(
        "the command guardian has not answered",
        Duration::from_secs(30),
    );
    // A new guardian runs the next command, and answers.
    push_to_default(&redis, &[job("FastJob", "fa57fa57fa57fa57fa57fa57")]);
    wait_until("the next job ran", Duration::from_secs(30), || {
        p.lines("ledger.txt").len() == 1
    });
    wait_until("/health answers 200 again", Duration::from_secs(30), || {
        http_get(port, "/health").is_some_and(|(s, _)| s == 200)
    });
    assert_ne!(guardian_of(w.pid()), Some(old));
}

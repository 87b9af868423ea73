//! A failover by a moved name behind a plain `redis://` URL (a VIP, a DNS name, a Kubernetes
//! Service): a proxy this test starts sends new connections to server B while those already
//! open stay on A, and A is made a replica of B (`REPLICAOF`), as a managed Redis does. The
//! worker must notice (READONLY on its old connections), reconnect every connection by name,
//! keep its running job alive, and run a job pushed to B. Waits are conditions with
//! deadlines; the measured figures are printed, never asserted as timings.
mod support;

use std::time::{Duration, Instant};
use support::*;

fn info(server: &RedisServer, section: &str) -> String {
    redis::cmd("INFO")
        .arg(section)
        .query(&mut server.conn())
        .unwrap_or_default()
}

/// `<arg> <pid> <epoch>` lines of ran.log: a note job writes one; the slow job writes `slow`
/// when it starts and `slow-end` when it ends, so a job killed midway has no end line.
fn ran(p: &Project) -> Vec<String> {
    p.lines("ran.log")
        .iter()
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect()
}

fn project() -> Project {
    let p = Project::new();
    p.script(
        "jobs/bin/note",
        "#!/bin/sh\na=$(printf '%s' \"$PLAYGUARD_ARGS\" | tr -d '[]\"')\n\
         echo \"$a $$ $(date +%s.%N)\" >> ran.log\n",
    );
    // Longer than the liveness budget (about 11 s of failed beats), so a worker that cannot
    // beat after the move kills it before its end line.
    p.script(
        "jobs/bin/slow",
        "#!/bin/sh\necho \"slow $$ $(date +%s.%N)\" >> ran.log\nsleep 16\n\
         echo \"slow-end $$ $(date +%s.%N)\" >> ran.log\n",
    );
    p.write(
        "jobs/app.toml",
        "[[job]]\nclass = \"Note\"\nrun = [\"jobs/bin/note\"]\n\
         [[job]]\nclass = \"Slow\"\nrun = [\"jobs/bin/slow\"]\n",
    );
    p
}

#[test]
fn a_moved_name_is_followed_without_killing_running_work() {
    let a = RedisServer::start();
    let b = RedisServer::start_with(&["--replicaof", "127.0.0.1", &a.port.to_string()]);
    wait_until("B in sync with A", Duration::from_secs(20), || {
        info(&b, "replication").contains("master_link_status:up")
    });
    let proxy = Proxy::start(a.port);
    let p = project();
    let mut w = Worker::builder_url(&proxy.url())
        .jobs(p.path())
        .args(["-c", "3"])
        .start();
    w.wait_for_line("playguard starting", Duration::from_secs(10));
    enqueue_url(&proxy.url(), &["Slow"]);
    wait_until("the slow job runs", Duration::from_secs(10), || {
        ran(&p).iter().any(|r| r == "slow")
    });
    enqueue_url(&proxy.url(), &["Note", "before"]);
    wait_until(
        "a job runs before the move",
        Duration::from_secs(10),
        || ran(&p).iter().any(|r| r == "before"),
    );

    // The move: B is promoted, the name points at B, A follows B as a replica. The worker's
    // open connections still reach A through the proxy.
    let _: () = redis::cmd("REPLICAOF")
        .arg("NO")
        .arg("ONE")
        .query(&mut b.conn())
        .unwrap();
    proxy.move_to(b.port);
    let moved = Instant::now();
    let _: () = redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(b.port)
        .query(&mut a.conn())
        .unwrap();
    push_to_default(
        &b,
        r#"{"retry":true,"queue":"default","class":"Note","args":["after"],"jid":"0123456789abcdef01234567","created_at":1,"enqueued_at":1}"#,
    );
    wait_until(
        "a job pushed to B after the move runs",
        Duration::from_secs(30),
        || ran(&p).iter().any(|r| r == "after"),
    );
    let first_job = moved.elapsed();
    wait_until(
        "the slow job that ran across the move ends",
        Duration::from_secs(40),
        || ran(&p).iter().any(|r| r == "slow-end"),
    );
    let runs = ran(&p);
    assert_eq!(
        runs.iter().filter(|r| *r == "slow").count(),
        1,
        "the slow job ran once: {runs:?}\n{}",
        w.output()
    );
    assert!(
        w.child.try_wait().unwrap().is_none(),
        "the worker is up:\n{}",
        w.output()
    );
    // Its beats land on B: the Busy page shows it there.
    wait_until("the worker beats on B", Duration::from_secs(15), || {
        let procs: Vec<String> = redis::cmd("SMEMBERS")
            .arg("processes")
            .query(&mut b.conn())
            .unwrap_or_default();
        !procs.is_empty()
    });
    eprintln!("FIGURES (moved name): move-to-first-job-on-B {first_job:?}");
    w.signal("TERM");
    assert_eq!(
        w.wait_exit(Duration::from_secs(30)),
        Some(0),
        "{}",
        w.output()
    );
}

//! A failover by a moved name behind a plain `redis://` URL (a VIP, a DNS name, a Kubernetes
//! Service): a proxy this test starts sends new connections to server B while those already
//! open stay on A, and A is made a replica of B (`REPLICAOF`), as a managed Redis does. The
//! worker must notice (READONLY on its old connections), reconnect every connection by name,
//! keep its running job alive, and run a job pushed to B; and what it did on A after A stopped
//! replicating is re-applied on B (`fetch/recent.rs`); a silent A (paused) is left on a response
//! timeout. Waits are conditions with deadlines; the measured figures are printed, never
//! asserted as timings.
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

fn now_epoch() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// A and B, B a replica of A. Both load a replication stream from the socket, never through a
/// dump.rdb in the working directory (A becomes B's replica in these tests).
fn pair() -> (RedisServer, RedisServer) {
    let diskless = ["--repl-diskless-load", "swapdb"];
    let a = RedisServer::start_with(&diskless);
    let port = a.port.to_string();
    let b =
        RedisServer::start_with(&[&diskless[..], &["--replicaof", "127.0.0.1", &port]].concat());
    (a, b)
}

/// `pair()` once B has caught up with A.
fn pair_in_sync() -> (RedisServer, RedisServer) {
    let (a, b) = pair();
    wait_until("B in sync with A", Duration::from_secs(20), || {
        info(&b, "replication").contains("master_link_status:up")
    });
    (a, b)
}

/// `REPLICAOF 127.0.0.1 <port>` on `server`, or `REPLICAOF NO ONE` (promote it) for None.
fn replicaof(server: &RedisServer, port: Option<u16>) {
    let mut cmd = redis::cmd("REPLICAOF");
    match port {
        Some(port) => cmd.arg("127.0.0.1").arg(port),
        None => cmd.arg("NO").arg("ONE"),
    };
    let _: () = cmd.query(&mut server.conn()).unwrap();
}

/// A worker of `p` at `-c <concurrency>` through the proxy's name, started.
fn worker_through(proxy: &Proxy, p: &Project, concurrency: &str) -> Worker {
    let w = Worker::builder_url(&proxy.url())
        .jobs(p.path())
        .args(["-c", concurrency])
        .start();
    w.wait_for_line("playguard starting", Duration::from_secs(10));
    w
}

/// Push a Slow job by the proxy's name and wait until it runs.
fn start_slow(proxy: &Proxy, p: &Project, what: &str) {
    enqueue_url(&proxy.url(), &["Slow"]);
    wait_until(what, Duration::from_secs(10), || {
        ran(p).iter().any(|r| r == "slow")
    });
}

/// The slow job that ran across the move ends, and the worker is still up.
fn slow_job_survived(p: &Project, w: &mut Worker) {
    wait_until(
        "the slow job that ran across the move ends",
        Duration::from_secs(40),
        || ran(p).iter().any(|r| r == "slow-end"),
    );
    assert!(
        w.child.try_wait().unwrap().is_none(),
        "the worker is up:\n{}",
        w.output()
    );
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
    let (a, b) = pair_in_sync();
    let proxy = Proxy::start(a.port);
    let p = project();
    let mut w = worker_through(&proxy, &p, "3");
    start_slow(&proxy, &p, "the slow job runs");
    enqueue_url(&proxy.url(), &["Note", "before"]);
    wait_until(
        "a job runs before the move",
        Duration::from_secs(10),
        || ran(&p).iter().any(|r| r == "before"),
    );

    // The move: B is promoted, the name points at B, A follows B as a replica. The worker's
    // open connections still reach A through the proxy.
    replicaof(&b, None);
    proxy.move_to(b.port);
    let moved = Instant::now();
    replicaof(&a, Some(b.port));
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
    slow_job_survived(&p, &mut w);
    let runs = ran(&p);
    assert_eq!(
        runs.iter().filter(|r| *r == "slow").count(),
        1,
        "the slow job ran once: {runs:?}\n{}",
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
    w.stop(Duration::from_secs(30));
}

/// What the worker did on A after A stopped replicating to B is re-applied on B when the name
/// moves there: a job it finished on A (B still has it queued) does not run again, a job it
/// acknowledged on A leaves its working list on B, and a job it still runs is listed in its
/// working list on B (and not queued there).
#[test]
fn what_the_old_primary_never_passed_on_is_reapplied() {
    let (a, b) = pair_in_sync();
    let proxy = Proxy::start(a.port);
    let p = project();
    p.script("jobs/bin/gate", BLOCK_UNTIL_RELEASE);
    p.write(
        "jobs/gate.toml",
        "[[job]]\nclass = \"Gate\"\nrun = [\"jobs/bin/gate\"]\n",
    );
    let mut w = worker_through(&proxy, &p, "1");
    let identity = w
        .line_with("playguard starting")
        .and_then(|l| {
            l.split_whitespace()
                .find_map(|f| f.strip_prefix("identity=").map(str::to_string))
        })
        .expect("the start line names the identity");
    let working = format!("playguard:working:{identity}:default");
    enqueue_url(&proxy.url(), &["Gate"]);
    wait_until(
        "the gate job holds the one slot",
        Duration::from_secs(10),
        || a.llen(&working) == 1 && a.llen("queue:default") == 0,
    );
    enqueue_url(&proxy.url(), &["Note", "queued-on-both"]);
    let acked: i64 = redis::cmd("WAIT")
        .arg(1)
        .arg(5000)
        .query(&mut a.conn())
        .unwrap();
    assert_eq!(acked, 1, "B has A's writes:\n{}", info(&b, "replication"));
    // B stops following A: from here A's writes never reach B.
    replicaof(&b, None);
    assert_eq!(
        (b.llen("queue:default"), b.llen(&working)),
        (1, 1),
        "B holds the queued job and the gate job:\n{}\n{}",
        info(&b, "replication"),
        info(&b, "keyspace")
    );
    p.write("release", "");
    wait_until("the queued job runs on A", Duration::from_secs(10), || {
        ran(&p).iter().any(|r| r == "queued-on-both")
    });
    start_slow(&proxy, &p, "the slow job runs (on A only)");

    proxy.move_to(b.port);
    replicaof(&a, Some(b.port));
    let moved = now_epoch();
    wait_until("the worker beats on B", Duration::from_secs(30), || {
        redis::cmd("HGET")
            .arg(&identity)
            .arg("beat")
            .query::<Option<f64>>(&mut b.conn())
            .ok()
            .flatten()
            .is_some_and(|beat| beat > moved)
    });
    let listed = b.lrange(&working);
    assert!(
        listed.len() == 1 && listed[0].contains("\"Slow\"") && b.llen("queue:default") == 0,
        "B lists only the running slow job: working {listed:?}, queue {:?}\n{}",
        b.lrange("queue:default"),
        w.output()
    );
    wait_until("the slow job ends", Duration::from_secs(40), || {
        ran(&p).iter().any(|r| r == "slow-end")
    });
    wait_until("its ack lands on B", Duration::from_secs(10), || {
        b.llen(&working) == 0
    });
    let runs = ran(&p);
    assert_eq!(
        runs.iter().filter(|r| *r == "queued-on-both").count(),
        1,
        "the job finished on A did not run again from B's queue: {runs:?}"
    );
    eprintln!(
        "FIGURES (moved name, reconcile): {}",
        w.line_with("failover: re-applied").unwrap_or_default()
    );
    w.stop(Duration::from_secs(30));
}

/// A host that stops answering without closing anything (SIGSTOP: no reset, no reply) while
/// the name moves to B: the worker's requests to A time out, which makes it connect again by
/// name, and it runs a job pushed to B without killing the job it was running.
#[test]
fn a_silent_old_primary_is_left_on_a_response_timeout() {
    let (a, b) = pair_in_sync();
    let proxy = Proxy::start(a.port);
    let p = project();
    let mut w = worker_through(&proxy, &p, "3");
    start_slow(&proxy, &p, "the slow job runs");
    a.pause();
    replicaof(&b, None);
    proxy.move_to(b.port);
    let moved = Instant::now();
    push_to_default(
        &b,
        r#"{"retry":true,"queue":"default","class":"Note","args":["after"],"jid":"0123456789abcdef01234568","created_at":1,"enqueued_at":1}"#,
    );
    wait_until(
        "a job pushed to B after A went silent runs",
        Duration::from_secs(30),
        || ran(&p).iter().any(|r| r == "after"),
    );
    let first_job = moved.elapsed();
    slow_job_survived(&p, &mut w);
    eprintln!("FIGURES (silent old primary): move-to-first-job-on-B {first_job:?}");
    w.stop(Duration::from_secs(30));
}

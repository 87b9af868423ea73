//! Graceful shutdown with the real binary: TERM/INT stop fetching, phased jobs stop at a
//! boundary (or have their phase killed at the deadline), the lock is released, then the
//! original payload goes back to the head of its queue exactly once. Exit is 0.
mod support;

use std::time::{Duration, Instant};
use support::*;

const PHASE: &str = "#!/bin/sh\necho \"start $PLAYGUARD_PHASE $$\" >> ledger.log\n\
    if [ -f slow ]; then sleep \"${SLEEP:-10}\"; fi\n\
    echo \"end $PLAYGUARD_PHASE $$\" >> ledger.log\n";

fn phased_project(ttl: u32, first_phase_secs: u32) -> Project {
    let p = Project::new();
    p.script(
        "jobs/bin/one",
        &PHASE.replace("${SLEEP:-10}", &first_phase_secs.to_string()),
    );
    p.script("jobs/bin/two", PHASE);
    p.write("slow", "");
    p.write(
        "jobs/app.toml",
        &format!(
            "[[job]]\nclass = \"PlayguardJob\"\n\
             lock = {{ key = \"playguard:marquee:{{args.0}}\", ttl_secs = {ttl} }}\n\
             [[job.phase]]\nname = \"one\"\nrun = [\"jobs/bin/one\"]\n\
             [[job.phase]]\nname = \"two\"\nrun = [\"jobs/bin/two\"]\n\
             [[job]]\nclass = \"PlainJob\"\nrun = [\"jobs/bin/plain\"]\n"
        ),
    );
    p.script(
        "jobs/bin/plain",
        "#!/bin/sh\necho \"start plain $$\" >> ledger.log\nsleep \"$(cat plain_secs 2>/dev/null || echo 2)\"\necho \"end plain $$\" >> ledger.log\n",
    );
    p
}

fn pids_of(p: &Project, phase: &str) -> Vec<i32> {
    p.read("ledger.log")
        .lines()
        .filter(|l| l.starts_with(&format!("start {phase} ")))
        .map(|l| l.rsplit(' ').next().unwrap().parse().unwrap())
        .collect()
}

fn term_during_a_long_phase(fetch: &str) {
    let redis = RedisServer::start();
    let p = phased_project(60, 10);
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-t", "3", "--fetch", fetch])
        .start();
    let jid = enqueue(&redis, &["PlayguardJob", "1"]);
    wait_until("phase one running", Duration::from_secs(10), || {
        p.read("ledger.log").contains("start one")
    });
    let t = Instant::now();
    w.stop(Duration::from_secs(15));
    eprintln!("{fetch}: TERM to exit took {:?} with -t 3", t.elapsed());
    let mut c = redis.conn();
    let locked: bool = redis::cmd("EXISTS")
        .arg("playguard:marquee:1")
        .query(&mut c)
        .unwrap();
    assert!(!locked, "lock released");
    let q = redis.lrange("queue:default");
    assert_eq!(q.len(), 1, "exactly one copy requeued: {q:?}");
    assert!(q[0].contains(&jid), "same jid");
    assert!(redis.working_jobs().is_empty());
    for pid in pids_of(&p, "one") {
        assert!(!pid_alive(pid), "the phase's process {pid} is gone");
    }
    assert!(!p.read("ledger.log").contains("start two"));
    // A restarted worker completes the job.
    std::fs::remove_file(p.path().join("slow")).unwrap();
    let mut w2 = Worker::builder(&redis)
        .jobs(p.path())
        .args(["--fetch", fetch])
        .start();
    wait_until(
        "cycle completed after restart",
        Duration::from_secs(20),
        || p.read("ledger.log").contains("end two"),
    );
    w2.signal("INT");
    assert_eq!(w2.wait_exit(Duration::from_secs(15)), Some(0));
    assert!(redis.lrange("queue:default").is_empty());
}

#[test]
fn term_during_a_long_phase_kills_it_at_the_deadline_releases_and_requeues_once() {
    term_during_a_long_phase("reliable");
}

#[test]
fn term_during_a_long_phase_with_basic_fetch() {
    term_during_a_long_phase("basic");
}

#[test]
fn term_between_phases_starts_no_further_phase_and_exits_promptly() {
    let redis = RedisServer::start();
    let p = phased_project(60, 1);
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-t", "20"])
        .start();
    let jid = enqueue(&redis, &["PlayguardJob", "2"]);
    wait_until("phase one running", Duration::from_secs(10), || {
        p.read("ledger.log").contains("start one")
    });
    let t = Instant::now();
    w.stop(Duration::from_secs(15));
    eprintln!(
        "TERM to exit at a boundary took {:?} (deadline 20 s)",
        t.elapsed()
    );
    assert!(w.saw("stopping at the phase boundary"), "{}", w.output());
    assert!(
        p.read("ledger.log").contains("end one") && !p.read("ledger.log").contains("start two")
    );
    let q = redis.lrange("queue:default");
    assert_eq!(q.len(), 1);
    assert!(q[0].contains(&jid));
    let locked: bool = redis::cmd("EXISTS")
        .arg("playguard:marquee:2")
        .query(&mut redis.conn())
        .unwrap();
    assert!(!locked);
}

#[test]
fn a_plain_job_finishes_within_the_timeout_and_is_not_requeued() {
    let redis = RedisServer::start();
    let p = phased_project(60, 1);
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-t", "10"])
        .start();
    enqueue(&redis, &["PlainJob", "x"]);
    wait_until("plain job running", Duration::from_secs(10), || {
        p.read("ledger.log").contains("start plain")
    });
    w.stop(Duration::from_secs(15));
    assert!(p.read("ledger.log").contains("end plain"), "finished");
    assert!(redis.lrange("queue:default").is_empty(), "not requeued");
    assert!(redis.working_jobs().is_empty());
    // Counted once as processed, with no failure.
    let mut c = redis.conn();
    let processed: Option<i64> = redis::cmd("GET")
        .arg("stat:processed")
        .query(&mut c)
        .unwrap();
    assert_eq!(processed, Some(1));
}

#[test]
fn a_plain_job_past_the_deadline_is_killed_and_requeued_and_a_second_term_hurries() {
    let redis = RedisServer::start();
    let p = phased_project(60, 1);
    p.write("plain_secs", "60");
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-t", "30"])
        .start();
    let jid = enqueue(&redis, &["PlainJob", "y"]);
    wait_until("plain job running", Duration::from_secs(10), || {
        p.read("ledger.log").contains("start plain")
    });
    w.signal("TERM");
    w.wait_for_line("shutting down", Duration::from_secs(5));
    w.signal("TERM");
    assert_eq!(
        w.wait_exit(Duration::from_secs(15)),
        Some(0),
        "a second TERM moves the deadline to now"
    );
    assert!(w.saw("deadline moved to now"));
    let q = redis.lrange("queue:default");
    assert_eq!(q.len(), 1);
    assert!(q[0].contains(&jid));
    for pid in pids_of(&p, "plain") {
        assert!(!pid_alive(pid), "the job's process is gone");
    }
}

#[test]
fn ttin_logs_busy_slots_and_tstp_quiets() {
    let redis = RedisServer::start();
    let p = phased_project(60, 10);
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-t", "1"])
        .start();
    enqueue(&redis, &["PlayguardJob", "3"]);
    wait_until("phase one running", Duration::from_secs(10), || {
        p.read("ledger.log").contains("start one")
    });
    w.signal("TTIN");
    w.wait_for_line("phase=one", Duration::from_secs(5));
    w.signal("TSTP");
    w.wait_for_line("quiet", Duration::from_secs(5));
    // Quiet: a new job is not fetched.
    enqueue(&redis, &["PlainJob", "z"]);
    let mut c = redis.conn();
    wait_until("heartbeat reports quiet", Duration::from_secs(10), || {
        let id: Vec<String> = redis::cmd("SMEMBERS")
            .arg("processes")
            .query(&mut c)
            .unwrap();
        id.first().is_some_and(|id| {
            redis::cmd("HGET")
                .arg(id)
                .arg("quiet")
                .query::<String>(&mut c)
                .unwrap()
                == "true"
        })
    });
    assert!(!p.read("ledger.log").contains("start plain"));
    w.signal("USR1");
    w.stop(Duration::from_secs(15));
    assert_eq!(
        redis.lrange("queue:default").len(),
        2,
        "the interrupted cycle and the unfetched job"
    );
}

#[test]
fn idle_worker_stops_fast_and_leaves_the_process_set() {
    let redis = RedisServer::start();
    let p = phased_project(60, 1);
    let mut w = Worker::builder(&redis).jobs(p.path()).start();
    w.wait_for_line("playguard starting", Duration::from_secs(10));
    let mut c = redis.conn();
    wait_until("registered", Duration::from_secs(10), || {
        redis::cmd("SCARD")
            .arg("processes")
            .query::<i64>(&mut c)
            .unwrap()
            == 1
    });
    let t = Instant::now();
    w.stop(Duration::from_secs(10));
    eprintln!("idle TERM to exit: {:?}", t.elapsed());
    assert_eq!(
        redis::cmd("SCARD")
            .arg("processes")
            .query::<i64>(&mut c)
            .unwrap(),
        0
    );
}

#[test]
fn works_under_foreman() {
    if std::process::Command::new("foreman")
        .arg("version")
        .output()
        .is_err()
    {
        assert!(
            std::env::var("PLAYGUARD_REQUIRE_RUBY").as_deref() != Ok("1"),
            "foreman is required (apt-get install ruby-foreman)"
        );
        eprintln!("skipping: foreman is not installed");
        return;
    }
    let redis = RedisServer::start();
    let p = phased_project(60, 10);
    p.write(
        "Procfile",
        &format!("worker: {} run -r {} -t 2\n", bin(), redis.url()),
    );
    let mut foreman = std::process::Command::new("foreman")
        .args(["start", "-t", "10"])
        .current_dir(p.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let jid = enqueue(&redis, &["PlayguardJob", "8"]);
    wait_until("phase one running", Duration::from_secs(20), || {
        p.read("ledger.log").contains("start one")
    });
    signal(foreman.id() as i32, "TERM");
    let deadline = Instant::now() + Duration::from_secs(20);
    while foreman.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "foreman did not stop");
        std::thread::sleep(Duration::from_millis(20));
    }
    let q = redis.lrange("queue:default");
    assert_eq!(q.len(), 1, "requeued once under foreman: {q:?}");
    assert!(q[0].contains(&jid));
}

#[test]
fn a_sigkilled_worker_takes_its_running_command_with_it() {
    // Otherwise the recovered job would run twice at once, or a phase (and the ssh it started)
    // would run on without a lease. The grandchild matters: scripts rarely exec.
    let redis = RedisServer::start();
    let p = phased_project(60, 30);
    p.script(
        "jobs/bin/plain",
        "#!/bin/sh\nsleep 60 &\necho $! > grandchild.pid\necho $$ > plain.pid\nread -r line\necho \"$line\" > stdin.txt\nwait\n",
    );
    let mut w = Worker::builder(&redis).jobs(p.path()).start();
    enqueue(&redis, &["PlainJob", "k"]);
    let pid = |f: &str| {
        std::fs::read_to_string(p.path().join(f))
            .ok()
            .and_then(|s| s.trim().parse::<i32>().ok())
    };
    wait_until("command running", Duration::from_secs(10), || {
        pid("plain.pid").is_some() && pid("grandchild.pid").is_some()
    });
    // The payload still arrives on the command's stdin.
    wait_until("stdin read", Duration::from_secs(10), || {
        std::fs::read_to_string(p.path().join("stdin.txt"))
            .is_ok_and(|s| s.contains("\"class\":\"PlainJob\""))
    });
    let (cmd, grandchild) = (pid("plain.pid").unwrap(), pid("grandchild.pid").unwrap());
    assert!(pid_alive(cmd) && pid_alive(grandchild));
    w.kill9();
    wait_until(
        "the command and its child died with their worker",
        Duration::from_secs(10),
        || !pid_alive(cmd) && !pid_alive(grandchild),
    );
}

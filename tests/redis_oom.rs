//! Redis out of memory (noeviction, maxmemory reached) for 30 s, against a real redis-server
//! this test fills itself: running jobs keep running (the lease is refreshed by EXPIRE, which
//! Redis accepts under OOM), fetching pauses, /health says why, the outcome of a job that
//! failed meanwhile is retried until it lands, and nothing is lost once memory is freed.
//! The figures (jobs killed, jobs lost) are printed. Waits are conditions with deadlines; the
//! 30 s are the length of the fault, not an assertion.

mod support;

use std::time::{Duration, Instant};
use support::*;

/// Stamps `start <pid>`, waits for `finish`, stamps `stop <pid>`, exits with `$1` (default 0).
const UNTIL_FINISH: &str = "#!/bin/sh\n\
    echo \"start $$\" >> stamps\n\
    while [ ! -f finish ]; do sleep 0.1; done\n\
    echo \"stop $$\" >> stamps\n\
    exit \"${1:-0}\"\n";

fn stamped(p: &Project, kind: &str) -> Vec<i32> {
    p.lines("stamps")
        .iter()
        .filter_map(|l| l.strip_prefix(&format!("{kind} ")))
        .filter_map(|pid| pid.trim().parse().ok())
        .collect()
}

fn info_field(redis: &RedisServer, field: &str) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("memory")
        .query(&mut redis.conn())
        .unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// Fill Redis with 2 MB of data, then lower maxmemory below what is used: with noeviction
/// every write that could grow memory is refused from then on (a limit just above what is
/// used would come and go as buffers are freed). Returns how many keys it wrote.
fn fill_until_oom(redis: &RedisServer) -> usize {
    let mut c = redis.conn();
    let value = "x".repeat(16 * 1024);
    let filled = 128;
    for i in 0..filled {
        let _: () = redis::cmd("SET")
            .arg(format!("fill:{i}"))
            .arg(&value)
            .query(&mut c)
            .unwrap();
    }
    let limit = info_field(redis, "used_memory") / 2;
    let _: () = redis::cmd("CONFIG")
        .arg(&["SET", "maxmemory", &limit.to_string()])
        .query(&mut c)
        .unwrap();
    let e = redis::cmd("SET")
        .arg("one-more")
        .arg(&value)
        .query::<()>(&mut c)
        .expect_err("Redis refuses writes now");
    assert!(e.to_string().contains("OOM"), "{e}");
    filled
}

fn free_memory(redis: &RedisServer, filled: usize) {
    let mut c = redis.conn();
    for i in 0..filled {
        let _: () = redis::cmd("DEL")
            .arg(format!("fill:{i}"))
            .query(&mut c)
            .unwrap();
    }
    let _: () = redis::cmd("CONFIG")
        .arg(&["SET", "maxmemory", "0"])
        .query(&mut c)
        .unwrap();
}

/// Before: every beat was one MULTI of denyoom writes; under OOM it was refused, the lease
/// lapsed after about 11 s and every running job was killed.
#[test]
fn thirty_seconds_of_oom_kill_no_running_job_and_lose_none() {
    let redis = RedisServer::start();
    let p = Project::new();
    p.script("jobs/bin/until_finish", UNTIL_FINISH);
    p.script("jobs/bin/ok", RECORD_RAN);
    p.write(
        "jobs/app.toml",
        "[[job]]\nclass = \"LongJob\"\nrun = [\"jobs/bin/until_finish\"]\n\n\
         [[job]]\nclass = \"FailJob\"\nrun = [\"jobs/bin/until_finish\", \"1\"]\n\n\
         [[job]]\nclass = \"OkJob\"\nrun = [\"jobs/bin/ok\"]\n",
    );
    let port = free_port();
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-c", "3", "--metrics-addr", &format!("127.0.0.1:{port}")])
        .start();
    w.wait_for_line("playguard starting", Duration::from_secs(30));
    for class in ["LongJob", "LongJob", "FailJob"] {
        enqueue(&redis, &[class]);
    }
    wait_until("three jobs running", Duration::from_secs(30), || {
        stamped(&p, "start").len() == 3
    });
    // Two more wait in the queue: every slot is taken.
    enqueue(&redis, &["OkJob"]);
    enqueue(&redis, &["OkJob"]);
    let running = stamped(&p, "start");

    let filled = fill_until_oom(&redis);
    let oom_from = Instant::now();
    let mut killed = 0;
    while oom_from.elapsed() < Duration::from_secs(30) {
        killed = running.iter().filter(|pid| !pid_alive(**pid)).count();
        if killed > 0 || w.saw("liveness lease lapsed") {
            break;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    eprintln!(
        "after {:.1} s of OOM: running jobs killed {killed} of {}",
        oom_from.elapsed().as_secs_f64(),
        running.len()
    );
    assert_eq!(killed, 0, "{}", w.output());
    assert!(!w.saw("liveness lease lapsed"), "{}", w.output());
    assert!(p.lines("ran.log").is_empty(), "fetching paused under OOM");
    // /health says why, and the gauge.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !http_get(port, "/health").is_some_and(|(s, b)| s == 200 && b.contains("out of memory")) {
        assert!(
            Instant::now() < deadline,
            "/health never said Redis is out of memory: {:?}\n{}",
            http_get(port, "/health"),
            w.output()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(scrape(port)["playguard_redis_oom"], 1.0);

    // The jobs end while Redis still refuses writes. The failure's outcome either lands now
    // (lua/settle.lua writes the LREM first, and Redis lets a script that has already written
    // go on writing under OOM) or waits, retried, until memory is back.
    std::fs::write(p.path().join("finish"), "").unwrap();
    wait_until("the three jobs ended", Duration::from_secs(30), || {
        stamped(&p, "stop").len() == 3
    });
    wait_until(
        "the failure's outcome landed or was retried",
        Duration::from_secs(20),
        || redis.zcard("retry") == 1 || w.output().contains("could not record the job's outcome"),
    );
    free_memory(&redis, filled);

    wait_until("the queued jobs ran", Duration::from_secs(40), || {
        p.lines("ran.log").len() == 2
    });
    wait_until(
        "the failure landed in retry",
        Duration::from_secs(30),
        || redis.zcard("retry") == 1,
    );
    wait_until(
        "queue and working list empty",
        Duration::from_secs(30),
        || redis.llen("queue:default") == 0 && redis.working_jobs().is_empty(),
    );
    let accounted = 2 + redis.zcard("retry") + p.lines("ran.log").len() as i64;
    let lost = 5 - accounted;
    eprintln!(
        "jobs lost: {lost} of 5 (2 done, 1 retried, {} queued ran)",
        p.lines("ran.log").len()
    );
    assert_eq!(lost, 0);
    wait_until(
        "/health no longer says OOM",
        Duration::from_secs(20),
        || http_get(port, "/health").is_some_and(|(s, b)| s == 200 && !b.contains("out of memory")),
    );
    w.signal("TERM");
    assert_eq!(w.wait_exit(Duration::from_secs(30)), Some(0));
}

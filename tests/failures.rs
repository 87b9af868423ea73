//! Failures reach the team: every path with real processes and a real redis-server, Sentry
//! events received by a loopback HTTP listener the DSN points at (the `sentry` crate's own
//! envelopes, decoded and checked field by field), and the manifest's hooks, each run writing
//! the JSON it got on stdin to a file of its own. A failing job, a dying job, a poison pill
//! and a lock-lost cycle each give exactly their event and exactly one run of each hook they
//! fire; a flood of 1,000 failures of one class gives the rate-limited number of events while
//! every job still goes to retry.
mod support;

use serde_json::Value;
use std::time::{Duration, Instant};
use support::*;

const PATIENCE: Duration = Duration::from_secs(30);

/// Writes its stdin to `hook-runs/<event>.<pid>.json` (renamed once whole), `$1` being the
/// event the manifest names; PLAYGUARD_EVENT must agree.
const HOOK: &str = "#!/bin/sh\nmkdir -p hook-runs\nf=hook-runs/$1.$$.json\n\
    [ \"$PLAYGUARD_EVENT\" = \"$1\" ] || echo \"PLAYGUARD_EVENT=$PLAYGUARD_EVENT\" > hook-runs/wrong.$$\n\
    echo \"$PLAYGUARD_CLASS\" > hook-runs/$1.$$.class\n\
    cat > $f.tmp && mv $f.tmp $f\n";

/// A `[[hook]]` per event, all running jobs/bin/hook with the event's name.
fn hooks_manifest() -> String {
    ["failure", "death", "lock_lost", "poison"]
        .iter()
        .map(|e| {
            format!(
                "[[hook]]\non = \"{e}\"\nrun = [\"jobs/bin/hook\", \"{e}\"]\ntimeout_secs = 10\n"
            )
        })
        .collect()
}

/// What a test of hooks and events starts from: its own redis-server and Sentry listener, and
/// a project whose manifest is `jobs` plus a `[[hook]]` per event, with the recording hook
/// and `scripts` (path, body) installed.
struct Bed {
    redis: RedisServer,
    sentry: SentryListener,
    p: Project,
}

fn bed(jobs: &str, scripts: &[(&str, &str)]) -> Bed {
    let redis = RedisServer::start();
    let sentry = SentryListener::start();
    let p = Project::new();
    p.script("jobs/bin/hook", HOOK);
    for (path, body) in scripts {
        p.script(path, body);
    }
    p.write("jobs/app.toml", &(jobs.to_string() + &hooks_manifest()));
    Bed { redis, sentry, p }
}

/// The stdin JSON of every hook run so far, by event (sorted by event name).
fn hook_runs(p: &Project) -> Vec<(String, Value)> {
    let mut runs: Vec<(String, Value)> = std::fs::read_dir(p.path().join("hook-runs"))
        .map(|d| d.flatten().map(|e| e.path()).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .filter(|f| f.extension().is_some_and(|x| x == "json"))
        .map(|f| {
            let name = f.file_name().unwrap().to_string_lossy().to_string();
            let event = name.split('.').next().unwrap().to_string();
            let text = std::fs::read_to_string(&f).unwrap();
            (
                event,
                serde_json::from_str(&text).expect("hook stdin is JSON"),
            )
        })
        .collect();
    runs.sort_by(|a, b| a.0.cmp(&b.0));
    runs
}

fn events_of(runs: &[(String, Value)]) -> Vec<&str> {
    runs.iter().map(|(e, _)| e.as_str()).collect()
}

/// A worker of `p` reporting to `sentry`, environment and release set as a Rails app sets them.
fn worker(redis: &RedisServer, p: &Project, sentry: &SentryListener) -> Worker {
    let w = Worker::builder(redis)
        .jobs(p.path())
        .env("SENTRY_DSN", sentry.dsn())
        .env("SENTRY_ENVIRONMENT", "staging")
        .env("SENTRY_RELEASE", "app@1.2.3")
        .start();
    w.wait_for_line("playguard starting", PATIENCE);
    w
}

/// The fields every event has, whatever its path.
fn check_common(e: &Value, class: &str, error_class: &str, event: &str) {
    // The crate leaves out the protocol's default level, which is error.
    assert!(e.get("level").is_none_or(|l| l == "error"), "{e}");
    assert_eq!(e["environment"], "staging", "{e}");
    assert_eq!(e["release"], "app@1.2.3", "{e}");
    assert_eq!(e["transaction"], format!("Sidekiq/{class}"), "{e}");
    assert_eq!(
        e["fingerprint"],
        serde_json::json!([class, error_class]),
        "{e}"
    );
    assert_eq!(e["exception"]["values"][0]["type"], error_class, "{e}");
    assert_eq!(e["tags"]["event"], event, "{e}");
    assert_eq!(e["tags"]["class"], class, "{e}");
    assert_eq!(e["tags"]["queue"], "default", "{e}");
    assert_eq!(e["contexts"]["sidekiq"]["class"], class, "{e}");
    assert_eq!(e["contexts"]["sidekiq"]["queue"], "default", "{e}");
    assert_eq!(e["contexts"]["playguard"]["event"], event, "{e}");
}

#[test]
fn a_failing_job_sends_one_failure_event_and_runs_its_failure_hook_once() {
    let Bed { redis, sentry, p } = bed(
        "[[job]]\nclass = \"FailJob\"\nrun = [\"jobs/bin/fail\"]\n\
           [[job]]\nclass = \"OpenJob\"\nrun = [\"jobs/bin/fail\"]\nreport_args = true\n",
        &[(
            "jobs/bin/fail",
            "#!/bin/sh\necho 'checking disk' >&2\necho 'disk full' >&2\nexit 3\n",
        )],
    );
    let mut w = worker(&redis, &p, &sentry);
    let jid = enqueue(
        &redis,
        &["FailJob", "\"secret@example.com\"", "--retry", "3"],
    );
    let open = enqueue(&redis, &["OpenJob", "\"visible\"", "--retry", "3"]);
    wait_until("both jobs in the retry set", PATIENCE, || {
        redis.zcard("retry") == 2
    });
    wait_until("two failure hook runs", PATIENCE, || {
        hook_runs(&p).len() >= 2
    });
    w.stop(PATIENCE);
    // After the clean stop (which flushes): exactly these, nothing more.
    let events = sentry.events();
    assert_eq!(events.len(), 2, "{events:?}");
    let e = events
        .iter()
        .find(|e| e["tags"]["jid"] == jid.as_str())
        .unwrap();
    check_common(e, "FailJob", "Playguard::CommandFailed", "failure");
    assert_eq!(e["exception"]["values"][0]["value"], "disk full");
    assert_eq!(e["exception"]["values"][0]["module"], "Playguard");
    // As sentry-sidekiq: the job as fetched (a first failure has no retry_count yet).
    let ctx = &e["contexts"]["sidekiq"];
    assert_eq!(ctx["jid"], jid.as_str());
    assert_eq!(ctx["context"], "Job raised exception");
    assert!(ctx.get("retry_count").is_none(), "{ctx}");
    assert!(ctx.get("error_class").is_none(), "{ctx}");
    assert!(ctx.get("args").is_none(), "args only when opted in: {ctx}");
    assert!(
        ctx.get("jobstr").is_none(),
        "jobstr only when opted in: {ctx}"
    );
    assert!(!e.to_string().contains("secret@example.com"), "{e}");
    assert_eq!(
        e["contexts"]["playguard"]["stderr"],
        serde_json::json!(["checking disk", "disk full"])
    );
    assert_eq!(e["extra"]["suppressed"], 0);
    let o = events
        .iter()
        .find(|e| e["tags"]["jid"] == open.as_str())
        .unwrap();
    check_common(o, "OpenJob", "Playguard::CommandFailed", "failure");
    assert_eq!(
        o["contexts"]["sidekiq"]["args"],
        serde_json::json!(["visible"])
    );
    let jobstr: Value =
        serde_json::from_str(o["contexts"]["sidekiq"]["jobstr"].as_str().unwrap()).unwrap();
    assert_eq!(
        jobstr["jid"],
        open.as_str(),
        "the payload as fetched: {jobstr}"
    );
    assert!(jobstr.get("retry_count").is_none(), "{jobstr}");
    for (path, auth) in sentry.requests() {
        assert_eq!(path, "/api/1/envelope/");
        assert!(auth.contains("sentry_key=publickey"), "{auth}");
    }
    let runs = hook_runs(&p);
    assert_eq!(events_of(&runs), ["failure", "failure"], "{runs:?}");
    let run = &runs
        .iter()
        .find(|(_, v)| v["job"]["jid"] == jid.as_str())
        .unwrap()
        .1;
    assert_eq!(run["event"], "failure");
    assert_eq!(run["job"]["class"], "FailJob");
    assert_eq!(
        run["job"]["args"],
        serde_json::json!(["secret@example.com"])
    );
    assert_eq!(run["job"]["retry_count"], 0);
    assert_eq!(run["error"]["class"], "Playguard::CommandFailed");
    assert_eq!(run["error"]["message"], "disk full");
    assert_eq!(
        run["error"]["stderr"],
        serde_json::json!(["checking disk", "disk full"])
    );
    assert!(!p
        .path()
        .join("hook-runs")
        .read_dir()
        .unwrap()
        .flatten()
        .any(|f| f.file_name().to_string_lossy().starts_with("wrong")));
}

#[test]
fn a_dying_job_sends_one_death_event_and_runs_failure_and_death_hooks_once_each() {
    let Bed { redis, sentry, p } = bed(
        "[[job]]\nclass = \"DieJob\"\nrun = [\"jobs/bin/fail\"]\n",
        &[(
            "jobs/bin/fail",
            "#!/bin/sh\necho 'no such marquee' >&2\nexit 1\n",
        )],
    );
    let mut w = worker(&redis, &p, &sentry);
    let jid = enqueue(&redis, &["DieJob", "7", "--retry", "0"]);
    wait_until("the job is dead", PATIENCE, || redis.zcard("dead") == 1);
    wait_until("two hook runs", PATIENCE, || hook_runs(&p).len() >= 2);
    w.stop(PATIENCE);
    let events = sentry.events();
    assert_eq!(events.len(), 1, "{events:?}");
    let e = &events[0];
    check_common(e, "DieJob", "Playguard::CommandFailed", "death");
    assert_eq!(e["tags"]["jid"], jid.as_str());
    assert_eq!(e["exception"]["values"][0]["value"], "no such marquee");
    assert_eq!(e["contexts"]["sidekiq"]["jid"], jid.as_str());
    let runs = hook_runs(&p);
    assert_eq!(events_of(&runs), ["death", "failure"], "{runs:?}");
    for (event, run) in &runs {
        assert_eq!(run["event"], event.as_str());
        assert_eq!(run["job"]["jid"], jid.as_str());
        assert_eq!(run["job"]["error_message"], "no such marquee");
        assert_eq!(run["error"]["class"], "Playguard::CommandFailed");
        assert_eq!(run["error"]["message"], "no such marquee");
    }
}

#[test]
fn a_poison_pill_sends_one_poison_event_and_runs_poison_and_death_hooks_once_each() {
    let Bed { redis, sentry, p } = bed(
        "[[job]]\nclass = \"PoisonJob\"\nrun = [\"jobs/bin/ok\"]\n",
        &[("jobs/bin/ok", "#!/bin/sh\nexit 0\n")],
    );
    // A worker that died holding the job for the third time: its fetcher entry without an
    // alive key, the job in its working list, two recoveries already counted.
    let dead = "ghost-host:4242:abcdef";
    let payload = r#"{"class":"PoisonJob","args":[1],"jid":"0123456789abcdef01234567","queue":"default","retry":true,"created_at":1700000000.5,"enqueued_at":1700000000.5}"#;
    let mut c = redis.conn();
    let sha: String = redis::cmd("EVAL")
        .arg("return redis.sha1hex(ARGV[1])")
        .arg(0)
        .arg(payload)
        .query(&mut c)
        .unwrap();
    let _: () = redis::pipe()
        .hset(
            "playguard:fetchers",
            dead,
            r#"{"queues":["default"],"ns":""}"#,
        )
        .ignore()
        .lpush(format!("playguard:working:{dead}:default"), payload)
        .ignore()
        .hset("playguard:recovered", &sha, 2)
        .ignore()
        .zadd("playguard:recovered:at", &sha, 1_900_000_000)
        .ignore()
        .query(&mut c)
        .unwrap();
    let mut w = worker(&redis, &p, &sentry);
    wait_until("the pill is dead", PATIENCE, || redis.zcard("dead") == 1);
    wait_until("two hook runs", PATIENCE, || hook_runs(&p).len() >= 2);
    w.stop(PATIENCE);
    let events = sentry.events();
    assert_eq!(events.len(), 1, "{events:?}");
    let e = &events[0];
    check_common(e, "PoisonJob", "Playguard::PoisonPill", "poison");
    assert_eq!(e["tags"]["jid"], "0123456789abcdef01234567");
    let msg = e["exception"]["values"][0]["value"].as_str().unwrap();
    assert!(msg.contains("recovered 3 times"), "{msg}");
    let runs = hook_runs(&p);
    assert_eq!(events_of(&runs), ["death", "poison"], "{runs:?}");
    for (event, run) in &runs {
        assert_eq!(run["event"], event.as_str());
        assert_eq!(run["job"]["jid"], "0123456789abcdef01234567");
        assert_eq!(run["job"]["error_class"], "Playguard::PoisonPill");
        assert_eq!(run["error"]["class"], "Playguard::PoisonPill");
    }
}

#[test]
fn a_lock_lost_cycle_sends_one_lock_lost_event_and_runs_its_hook_once() {
    let Bed { redis, sentry, p } = bed(
        "[[job]]\nclass = \"MarqueeCycle\"\n\
           lock = { key = \"playguard:marquee:{args.0}\", ttl_secs = 30 }\n\
           [[job.phase]]\nname = \"hold\"\nrun = [\"jobs/bin/hold\"]\n\
           [[job.phase]]\nname = \"after\"\nrun = [\"jobs/bin/after\"]\n",
        &[
            (
                "jobs/bin/hold",
                "#!/bin/sh\ntouch held\ni=0\nwhile [ ! -e go ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done\n",
            ),
            ("jobs/bin/after", "#!/bin/sh\ntouch after-ran\n"),
        ],
    );
    let mut w = worker(&redis, &p, &sentry);
    let jid = enqueue(&redis, &["MarqueeCycle", "9"]);
    wait_until("the first phase runs", PATIENCE, || {
        p.path().join("held").exists()
    });
    // Another holder takes the key while the phase runs: the renewal after it fails.
    let _: () = redis::cmd("SET")
        .arg("playguard:marquee:9")
        .arg("someone-else")
        .query(&mut redis.conn())
        .unwrap();
    p.write("go", "");
    wait_until("the lock_lost hook ran", PATIENCE, || {
        !hook_runs(&p).is_empty()
    });
    w.stop(PATIENCE);
    assert!(w.saw("aborted: lock lost"), "{}", w.output());
    assert!(
        !p.path().join("after-ran").exists(),
        "no phase after the lost lock"
    );
    let events = sentry.events();
    assert_eq!(events.len(), 1, "{events:?}");
    let e = &events[0];
    check_common(e, "MarqueeCycle", "Playguard::LockLost", "lock_lost");
    assert_eq!(e["tags"]["jid"], jid.as_str());
    assert_eq!(e["tags"]["phase"], "hold");
    assert_eq!(e["contexts"]["playguard"]["phase"], "hold");
    let msg = e["exception"]["values"][0]["value"].as_str().unwrap();
    assert!(msg.starts_with("playguard:marquee:9: "), "{msg}");
    assert!(
        e["contexts"]["sidekiq"].get("args").is_none(),
        "{}",
        e["contexts"]["sidekiq"]
    );
    let runs = hook_runs(&p);
    assert_eq!(events_of(&runs), ["lock_lost"], "{runs:?}");
    let run = &runs[0].1;
    assert_eq!(run["event"], "lock_lost");
    assert_eq!(run["job"]["jid"], jid.as_str());
    assert_eq!(run["job"]["args"], serde_json::json!([9]));
    assert_eq!(run["error"]["class"], "Playguard::LockLost");
    assert_eq!(run["error"]["phase"], "hold");
    assert_eq!(redis.zcard("retry"), 0, "a lost lock is not retried");
}

#[test]
fn a_flood_of_one_failure_is_rate_limited_and_every_job_still_goes_to_retry() {
    let redis = RedisServer::start();
    let sentry = SentryListener::start();
    let p = Project::new();
    p.write(
        "jobs/app.toml",
        "[[job]]\nclass = \"FloodJob\"\nrun = [\"false\"]\n",
    );
    let port = free_port();
    let payloads: Vec<String> = (0..1000)
        .map(|i| {
            format!(
                r#"{{"class":"FloodJob","args":[{i}],"jid":"{}","queue":"default","retry":true,"created_at":1700000000.0,"enqueued_at":1700000000.0}}"#,
                playguard::test_support::new_jid()
            )
        })
        .collect();
    push_to_default(&redis, &payloads);
    let started = Instant::now();
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-c", "10", "--metrics-addr", &format!("127.0.0.1:{port}")])
        .env("SENTRY_DSN", sentry.dsn())
        .start();
    wait_until(
        "every job in the retry set",
        Duration::from_secs(300),
        || redis.zcard("retry") == 1000,
    );
    // Each failure is reported just after its retry entry is written: wait for all 1,000.
    let count_in = |samples: &std::collections::BTreeMap<String, f64>, result: &str| {
        samples
            .get(&format!(
                "playguard_sentry_events_total{{event=\"failure\",result=\"{result}\"}}"
            ))
            .copied()
            .unwrap_or(0.0) as u64
    };
    let mut samples = Default::default();
    wait_until("1,000 failures reported", PATIENCE, || {
        samples = scrape(port);
        count_in(&samples, "sent") + count_in(&samples, "suppressed") == 1000
    });
    let count = |result: &str| count_in(&samples, result);
    w.stop(PATIENCE);
    let took = started.elapsed();
    let events = sentry.events();
    // One per class and error per 60 s window: the first, then one per window begun since.
    let allowed = 1 + took.as_secs() / 60;
    eprintln!(
        "1,000 failures in {took:?}: {} events sent, {} counted",
        events.len(),
        count("suppressed")
    );
    assert!(
        !events.is_empty() && events.len() as u64 <= allowed,
        "{} events in {took:?}",
        events.len()
    );
    assert_eq!(count("sent"), events.len() as u64);
    assert_eq!(events[0]["extra"]["suppressed"], 0);
    // One line per window that began holding events back, not one per event.
    let lines = w.count_lines("are counted, not sent");
    assert!(lines >= 1 && lines <= events.len(), "{lines} lines");
    assert_eq!(redis.zcard("retry"), 1000);
    assert_eq!(redis.zcard("dead"), 0);
}

#[test]
fn a_failing_or_hung_hook_is_logged_once_and_never_holds_a_slot_or_changes_the_outcome() {
    let redis = RedisServer::start();
    let p = Project::new();
    p.script("jobs/bin/fail", "#!/bin/sh\necho 'boom' >&2\nexit 1\n");
    p.script("jobs/bin/ok", "#!/bin/sh\ntouch ok-ran\n");
    // Each hook notes its start in runs.txt; `slow` waits for `release`, `hangs` never ends.
    p.script(
        "jobs/bin/pager",
        "#!/bin/sh\necho pager >> runs.txt\necho 'pager down' >&2\nexit 1\n",
    );
    p.script(
        "jobs/bin/slow",
        "#!/bin/sh\necho slow >> runs.txt\ni=0\nwhile [ ! -e release ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done\ntouch slow-done\n",
    );
    p.script(
        "jobs/bin/hangs",
        "#!/bin/sh\necho hangs >> runs.txt\nexec sleep 300\n",
    );
    p.write(
        "jobs/app.toml",
        "[[job]]\nclass = \"FailJob\"\nrun = [\"jobs/bin/fail\"]\n\
         [[job]]\nclass = \"OkJob\"\nrun = [\"jobs/bin/ok\"]\n\
         [[hook]]\non = \"failure\"\nrun = [\"jobs/bin/pager\"]\n\
         [[hook]]\non = \"failure\"\nrun = [\"jobs/bin/slow\"]\ntimeout_secs = 120\n\
         [[hook]]\non = \"failure\"\nrun = [\"jobs/bin/hangs\"]\ntimeout_secs = 1\n",
    );
    let port = free_port();
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-c", "1", "--metrics-addr", &format!("127.0.0.1:{port}")])
        .start();
    w.wait_for_line("playguard starting", PATIENCE);
    let jid = enqueue(&redis, &["FailJob", "--retry", "3"]);
    wait_until("the slow hook started", PATIENCE, || {
        p.lines("runs.txt").contains(&"slow".to_string())
    });
    // The only slot is free again while the slow hook still runs: the next job runs.
    enqueue(&redis, &["OkJob"]);
    wait_until("the next job ran", PATIENCE, || {
        p.path().join("ok-ran").exists()
    });
    assert!(
        !p.path().join("slow-done").exists(),
        "the slow hook is still running"
    );
    w.wait_for_line("hook timed out after 1s", PATIENCE);
    w.wait_for_line("pager down", PATIENCE);
    p.write("release", "");
    wait_until("the slow hook ended", PATIENCE, || {
        p.path().join("slow-done").exists()
    });
    w.wait_for_line("hook ran", PATIENCE);
    let samples = scrape(port);
    let runs = |result: &str| {
        samples.get(&format!(
            "playguard_hook_runs_total{{on=\"failure\",result=\"{result}\"}}"
        ))
    };
    assert_eq!((runs("ok"), runs("failed")), (Some(&1.0), Some(&2.0)));
    w.stop(PATIENCE);
    let mut runs = p.lines("runs.txt");
    runs.sort();
    assert_eq!(
        runs,
        ["hangs", "pager", "slow"],
        "each hook ran once, none retried"
    );
    assert_eq!(
        w.count_lines("hook failed (not retried"),
        2,
        "{}",
        w.output()
    );
    let retry: Vec<String> = redis::cmd("ZRANGE")
        .arg("retry")
        .arg(0)
        .arg(-1)
        .query(&mut redis.conn())
        .unwrap();
    assert_eq!(retry.len(), 1);
    let entry: Value = serde_json::from_str(&retry[0]).unwrap();
    assert_eq!(entry["jid"], jid.as_str());
    assert_eq!(entry["retry_count"], 0);
    assert_eq!(entry["error_message"], "boom");
}

#[test]
fn a_bad_dsn_stops_the_start_and_a_good_one_never_reaches_the_log() {
    let redis = RedisServer::start();
    let p = Project::new();
    p.script("jobs/bin/ok", "#!/bin/sh\nexit 0\n");
    p.write(
        "jobs/app.toml",
        "[[job]]\nclass = \"OkJob\"\nrun = [\"jobs/bin/ok\"]\n",
    );
    let mut bad = Worker::builder(&redis)
        .jobs(p.path())
        .env("SENTRY_DSN", "not a dsn")
        .start();
    assert_eq!(bad.wait_exit(PATIENCE), Some(2), "{}", bad.output());
    assert!(bad.saw("SENTRY_DSN does not parse"), "{}", bad.output());
    let sentry = SentryListener::start();
    let dsn = sentry.dsn().replace("publickey", "k3y0f4s3cr3tpr0j3ct");
    let mut good = Worker::builder(&redis)
        .jobs(p.path())
        .env("SENTRY_DSN", &dsn)
        .start();
    good.wait_for_line("failures are reported to Sentry", PATIENCE);
    good.stop(PATIENCE);
    assert!(!good.output().contains("k3y0f4s3cr3t"), "{}", good.output());
}

#[test]
fn a_sentry_that_never_answers_holds_up_no_job_and_no_exit() {
    let redis = RedisServer::start();
    // Accepts connections and never reads or answers them.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let held: Vec<_> = silent.incoming().flatten().collect();
        drop(held);
    });
    let p = Project::new();
    p.script("jobs/bin/ok", "#!/bin/sh\nexit 0\n");
    p.write(
        "jobs/app.toml",
        "[[job]]\nclass = \"OkJob\"\nrun = [\"jobs/bin/ok\"]\n",
    );
    // 100 classes nobody runs: 100 failures the rate limit lets through, one per class.
    let payloads: Vec<String> = (0..100)
        .map(|i| {
            format!(
                r#"{{"class":"Gone{i}","args":[],"jid":"{}","queue":"default","retry":true,"created_at":1700000000.0,"enqueued_at":1700000000.0}}"#,
                playguard::test_support::new_jid()
            )
        })
        .collect();
    push_to_default(&redis, &payloads);
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .env("SENTRY_DSN", format!("http://publickey@127.0.0.1:{port}/1"))
        .start();
    wait_until("every job in the retry set", PATIENCE, || {
        redis.zcard("retry") == 100
    });
    w.stop(PATIENCE);
    assert!(
        w.saw("some events could not be sent before exit"),
        "{}",
        w.output()
    );
}

#[test]
fn an_activejob_failure_is_named_by_the_class_it_wraps_and_keeps_its_arguments_out() {
    let Bed { redis, sentry, p } = bed(
        "[[job]]\nclass = \"SendReportJob\"\nrun = [\"jobs/bin/fail\"]\n",
        &[(
            "jobs/bin/fail",
            "#!/bin/sh\necho 'smtp refused' >&2\nexit 1\n",
        )],
    );
    let aj = serde_json::json!({"class": "ActiveJob::QueueAdapters::SidekiqAdapter::JobWrapper",
        "wrapped": "SendReportJob", "queue": "default", "jid": "0123456789abcdef01234567",
        "retry": 3, "created_at": 1.0, "enqueued_at": 1.0, "tags": ["reports"],
        "args": [{"job_class": "SendReportJob", "job_id": "x", "arguments": ["ann@example.com"]}]});
    push_to_default(&redis, aj.to_string());
    let mut w = worker(&redis, &p, &sentry);
    wait_until("the job in the retry set", PATIENCE, || {
        redis.zcard("retry") == 1
    });
    wait_until("the failure hook ran", PATIENCE, || {
        !hook_runs(&p).is_empty()
    });
    w.stop(PATIENCE);
    let events = sentry.events();
    assert_eq!(events.len(), 1, "{events:?}");
    let e = &events[0];
    assert_eq!(e["transaction"], "Sidekiq/SendReportJob");
    assert_eq!(e["tags"]["class"], "SendReportJob");
    assert_eq!(e["tags"]["sidekiq.reports"], "true");
    assert_eq!(
        e["fingerprint"],
        serde_json::json!(["SendReportJob", "Playguard::CommandFailed"])
    );
    assert_eq!(e["contexts"]["sidekiq"]["wrapped"], "SendReportJob");
    assert!(!e.to_string().contains("ann@example.com"), "{e}");
    let runs = hook_runs(&p);
    assert_eq!(events_of(&runs), ["failure"], "{runs:?}");
    assert_eq!(runs[0].1["job"]["wrapped"], "SendReportJob");
    let classes: Vec<String> = std::fs::read_dir(p.path().join("hook-runs"))
        .unwrap()
        .flatten()
        .filter(|f| f.path().extension().is_some_and(|x| x == "class"))
        .map(|f| {
            std::fs::read_to_string(f.path())
                .unwrap()
                .trim()
                .to_string()
        })
        .collect();
    assert_eq!(
        classes,
        ["SendReportJob"],
        "PLAYGUARD_CLASS is the wrapped class"
    );
}

#[test]
fn a_failed_phase_is_named_in_the_event_and_the_hook() {
    let Bed { redis, sentry, p } = bed(
        "[[job]]\nclass = \"MarqueeCycle\"\n\
           lock = { key = \"playguard:marquee:{args.0}\", ttl_secs = 30 }\n\
           [[job.phase]]\nname = \"prepare\"\nrun = [\"jobs/bin/ok\"]\n\
           [[job.phase]]\nname = \"sync_git\"\nrun = [\"jobs/bin/fail\"]\n",
        &[
            ("jobs/bin/ok", "#!/bin/sh\nexit 0\n"),
            (
                "jobs/bin/fail",
                "#!/bin/sh\necho 'git fetch: timeout' >&2\nexit 128\n",
            ),
        ],
    );
    let mut w = worker(&redis, &p, &sentry);
    enqueue(&redis, &["MarqueeCycle", "4", "--retry", "2"]);
    wait_until("the cycle in the retry set", PATIENCE, || {
        redis.zcard("retry") == 1
    });
    wait_until("the failure hook ran", PATIENCE, || {
        !hook_runs(&p).is_empty()
    });
    w.stop(PATIENCE);
    let events = sentry.events();
    assert_eq!(events.len(), 1, "{events:?}");
    let e = &events[0];
    check_common(e, "MarqueeCycle", "Playguard::CommandFailed", "failure");
    assert_eq!(e["tags"]["phase"], "sync_git");
    assert_eq!(e["contexts"]["playguard"]["phase"], "sync_git");
    assert_eq!(e["exception"]["values"][0]["value"], "git fetch: timeout");
    let runs = hook_runs(&p);
    assert_eq!(events_of(&runs), ["failure"], "{runs:?}");
    assert_eq!(runs[0].1["error"]["phase"], "sync_git");
    assert_eq!(
        runs[0].1["error"]["stderr"],
        serde_json::json!(["git fetch: timeout"])
    );
}

#[test]
fn a_hook_whose_program_is_missing_stops_the_start_naming_it() {
    let redis = RedisServer::start();
    let p = Project::new();
    p.script("jobs/bin/ok", "#!/bin/sh\nexit 0\n");
    p.write(
        "jobs/app.toml",
        "[[job]]\nclass = \"OkJob\"\nrun = [\"jobs/bin/ok\"]\n\
         [[hook]]\non = \"death\"\nrun = [\"jobs/bin/page-oncall\"]\n",
    );
    let mut w = Worker::builder(&redis).jobs(p.path()).start();
    assert_eq!(w.wait_exit(PATIENCE), Some(2), "{}", w.output());
    let line = w.line_with("page-oncall").unwrap_or_default();
    assert!(
        line.contains("app.toml")
            && line.contains("[[hook]] (on \"death\")")
            && line.contains("does not exist"),
        "{}",
        w.output()
    );
}

#[test]
fn the_scheduled_pollers_burials_are_deaths_too() {
    let Bed { redis, sentry, p } = bed(
        "[[job]]\nclass = \"OkJob\"\nrun = [\"jobs/bin/ok\"]\n",
        &[("jobs/bin/ok", "#!/bin/sh\nexit 0\n")],
    );
    // A due retry that is not JSON, and a due scheduled job whose queue key is a string.
    let job = r#"{"class":"OkJob","args":[],"jid":"00112233445566778899aabb","queue":"broken","retry":true,"created_at":1700000000.0}"#;
    let _: () = redis::pipe()
        .zadd("retry", "{not json", 1)
        .ignore()
        .zadd("schedule", job, 1)
        .ignore()
        .set("queue:broken", "not a list")
        .ignore()
        .query(&mut redis.conn())
        .unwrap();
    let mut w = worker(&redis, &p, &sentry);
    wait_until("both in the dead set", PATIENCE, || {
        redis.zcard("dead") == 2
    });
    wait_until("four hook runs", PATIENCE, || hook_runs(&p).len() >= 4);
    w.stop(PATIENCE);
    let events = sentry.events();
    assert_eq!(events.len(), 2, "{events:?}");
    let bad_key = events
        .iter()
        .find(|e| e["tags"]["jid"] == "00112233445566778899aabb")
        .unwrap();
    assert_eq!(bad_key["tags"]["event"], "death");
    assert_eq!(
        bad_key["exception"]["values"][0]["type"],
        "Playguard::BadQueueKey"
    );
    assert_eq!(bad_key["tags"]["queue"], "broken");
    let garbage = events
        .iter()
        .find(|e| e["tags"].get("jid").is_none())
        .unwrap();
    assert_eq!(garbage["tags"]["event"], "death");
    assert_eq!(
        garbage["exception"]["values"][0]["type"],
        "Playguard::InvalidPayload"
    );
    assert_eq!(garbage["contexts"]["sidekiq"]["payload"], "{not json");
    // As sentry-sidekiq names an error with no job class to name: the bare transaction.
    assert_eq!(garbage["transaction"], "Sidekiq", "{garbage}");
    let runs = hook_runs(&p);
    assert_eq!(
        events_of(&runs),
        ["death", "death", "failure", "failure"],
        "{runs:?}"
    );
    assert!(
        runs.iter().any(|(_, r)| r["job"] == "{not json"),
        "{runs:?}"
    );
    assert!(
        runs.iter()
            .any(|(_, r)| r["job"]["error_class"] == "Playguard::BadQueueKey"),
        "{runs:?}"
    );
}

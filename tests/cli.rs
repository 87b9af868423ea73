//! The command line: `check` on the shipped manifests, `-C` YAML with env sections (flags win),
//! `enqueue --in`, database numbers in REDIS_URL, and clear one-line configuration errors.
mod support;

use std::process::Command;
use std::time::Duration;
use support::*;

#[test]
fn check_accepts_the_shipped_manifests() {
    let redis = RedisServer::start();
    // The shipped cycle takes its fences from PostgreSQL (fence = "database").
    let pg = PostgresServer::start();
    let out = Command::new(bin())
        .args(["check", "-r", &redis.url(), "--database-url", &pg.url()])
        .current_dir(project_dir())
        .output()
        .unwrap();
    assert_success(&out);
    assert!(String::from_utf8_lossy(&out.stdout).contains("ok: 1 job class"));
}

#[test]
fn yaml_config_with_env_section_and_flags_that_win() {
    let redis = RedisServer::start();
    let p = Project::with_jobs(&[("OkJob", "ok", "#!/bin/sh\n")]);
    p.write(
        "config/sidekiq.yml",
        ":concurrency: 3\n:queues:\n  - [critical, 3]\n  - low\ntag: from-yaml\nproduction:\n  concurrency: 7\n",
    );
    let url = format!("redis://127.0.0.1:{}/3", redis.port);
    let mut w = Worker::builder_url(&url)
        .jobs(p.path())
        .args(["-e", "production", "-g", "from-flag"])
        .start();
    let mut c = redis::Client::open(url.as_str())
        .unwrap()
        .get_connection()
        .unwrap();
    let mut info = String::new();
    wait_until(
        "process registered in db 3",
        Duration::from_secs(10),
        || {
            let ids: Vec<String> = redis::cmd("SMEMBERS")
                .arg("processes")
                .query(&mut c)
                .unwrap();
            ids.first()
                .map(|id| {
                    info = redis::cmd("HGET")
                        .arg(id)
                        .arg("info")
                        .query(&mut c)
                        .unwrap()
                })
                .is_some()
        },
    );
    let v: serde_json::Value = serde_json::from_str(&info).unwrap();
    assert_eq!(
        v["concurrency"], 7,
        "production section wins over the top level"
    );
    assert_eq!(v["queues"], serde_json::json!(["critical", "low"]));
    assert_eq!(v["tag"], "from-flag", "flags win over the file");
    w.signal("TERM");
    assert_eq!(w.wait(), Some(0));
}

#[test]
fn enqueue_in_goes_to_the_schedule_set() {
    let redis = RedisServer::start();
    let out = Command::new(bin())
        .args([
            "enqueue",
            "-r",
            &redis.url(),
            "Later",
            "1",
            "--in",
            "3600",
            "--queue",
            "low",
            "--retry",
            "false",
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    let jid = String::from_utf8(out.stdout).unwrap().trim().to_string();
    let mut c = redis.conn();
    let members: Vec<(String, f64)> = redis::cmd("ZRANGE")
        .arg("schedule")
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query(&mut c)
        .unwrap();
    assert_eq!(members.len(), 1);
    let job: serde_json::Value = serde_json::from_str(&members[0].0).unwrap();
    assert_eq!(job["jid"], jid.as_str());
    assert_eq!(job["queue"], "low");
    assert_eq!(job["retry"], false);
    assert!(
        job.get("enqueued_at").is_none(),
        "scheduled members carry no enqueued_at"
    );
    let now = playguard::test_support::now_f64();
    assert!(members[0].1 > now + 3500.0);
}

#[test]
fn configuration_errors_are_one_clear_line() {
    let bad_q = Command::new(bin())
        .args(["run", "-q", "low,x"])
        .output()
        .unwrap();
    assert_eq!(bad_q.status.code(), Some(2));
    let err = String::from_utf8_lossy(&bad_q.stderr);
    assert!(err.contains("weight must be a whole number"), "{err}");
    // (Not in the repository root: its shipped cycle needs a database URL, checked first.)
    let p = Project::with_jobs(&[("OkJob", "ok", "#!/bin/sh\n")]);
    let unreachable = Command::new(bin())
        .args(["run", "-r", "redis://127.0.0.1:1/0"])
        .current_dir(p.path())
        .output()
        .unwrap();
    assert_ne!(unreachable.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&unreachable.stderr)
        .contains("cannot reach Redis at redis://127.0.0.1:1/0"));
}

#[test]
fn the_shipped_reconcile_cycle_runs_all_six_phases() {
    let redis = RedisServer::start();
    let pg = PostgresServer::start();
    pg.psql(&std::fs::read_to_string(project_dir().join("examples/demo.sql")).unwrap());
    pg.psql("INSERT INTO marquees (id) VALUES (42)");
    let demo = tempfile::tempdir().unwrap();
    let mut w = Worker::builder(&redis)
        .jobs(project_dir())
        .args(["-q", "playguard"])
        .env("PLAYGUARD_DEMO_DIR", demo.path())
        .env("DATABASE_URL", pg.url())
        .start();
    let out = Command::new(bin())
        .args([
            "enqueue",
            "-r",
            &redis.url(),
            "--queue",
            "playguard",
            "PlayguardJob",
            "42",
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    let mut c = redis.conn();
    wait_until("cycle done and released", Duration::from_secs(60), || {
        redis::cmd("GET")
            .arg("stat:processed")
            .query::<Option<i64>>(&mut c)
            .unwrap()
            == Some(1)
    });
    w.signal("TERM");
    w.wait();
    let log = w.stdout();
    for phase in [
        "sync_git",
        "fetch_branches",
        "pull_images",
        "reconcile_playgrounds",
        "process_agent_chats",
        "sweep_orphans",
    ] {
        assert!(
            log.contains(&format!("phase end phase={phase} ")),
            "phase {phase} ran:\n{log}"
        );
    }
    assert!(log.contains("cycle of Marquee 42 complete"), "{log}");
    assert!(!log.contains("result=Failed"), "{log}");
    // The observed state was saved with the cycle's database fence, and the ledger says so.
    let fence =
        pg.psql("SELECT fence FROM playguard_fences WHERE lock_key = 'playguard:marquee:42'");
    assert_eq!(
        pg.psql("SELECT observed_playgrounds LIKE '%main%', fence FROM marquees WHERE id = 42"),
        format!("t|{fence}")
    );
    assert_eq!(
        pg.psql(
            "SELECT outcome, phase FROM playguard_cycles WHERE lock_key = 'playguard:marquee:42'"
        ),
        "complete|sweep_orphans"
    );
    assert!(
        demo.path().join("marquee-42/repo/.git").exists(),
        "git work was done"
    );
}

#[test]
fn json_logs_carry_pid_jid_class_and_numeric_elapsed_ms() {
    let redis = RedisServer::start();
    let p = Project::with_jobs(&[("LogJob", "ok", "#!/bin/sh\necho working\n")]);
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["--log-format", "json"])
        .start();
    let out = Command::new(bin())
        .args(["enqueue", "-r", &redis.url(), "LogJob"])
        .output()
        .unwrap();
    let jid = String::from_utf8(out.stdout).unwrap().trim().to_string();
    w.wait_for_line("\"message\":\"done\"", Duration::from_secs(20));
    w.stop(Duration::from_secs(10));
    let lines = w.lines();
    let parsed: Vec<serde_json::Value> = lines
        .iter()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let done = parsed.iter().find(|v| v["message"] == "done").unwrap();
    assert!(done["elapsed_ms"].is_number(), "{done}");
    assert!(
        done["timestamp"].as_str().unwrap().ends_with('Z'),
        "UTC timestamps"
    );
    // One flat object: the span fields sit beside the event's own.
    assert_eq!(done["pid"], w.pid());
    assert_eq!(done["jid"], jid.as_str());
    assert_eq!(done["class"], "LogJob");
    assert_eq!(done["queue"], "default");
    let start = parsed
        .iter()
        .find(|v| v["message"] == "playguard starting")
        .unwrap();
    assert_eq!(start["queues"], "default");
    assert!(parsed
        .iter()
        .any(|v| v["message"] == "working" && v["stream"] == "stdout"));
}

#[test]
fn a_user_denied_info_still_runs() {
    // Managed Redis often denies INFO (@dangerous); like Sidekiq, carry on without the version.
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let _: () = redis::cmd("ACL")
        .arg(&[
            "SETUSER",
            "app",
            "on",
            ">pw",
            "~*",
            "&*",
            "+@all",
            "-@dangerous",
        ])
        .query(&mut c)
        .unwrap();
    let url = format!("redis://app:pw@127.0.0.1:{}/0", redis.port);
    let p = Project::with_jobs(&[("OkJob", "ok", RECORD_RAN)]);
    let out = Command::new(bin())
        .args(["check", "-r", &url])
        .current_dir(p.path())
        .output()
        .unwrap();
    assert_success(&out);
    assert!(String::from_utf8_lossy(&out.stdout).contains("Redis unknown"));
    // And the worker runs jobs and stops cleanly (CLIENT UNBLOCK is denied too: the blocked
    // pops then end by their own 2 s timeout).
    let mut w = Worker::builder_url(&url).jobs(p.path()).start();
    let enq = Command::new(bin())
        .args(["enqueue", "-r", &url, "OkJob"])
        .output()
        .unwrap();
    assert!(enq.status.success());
    wait_until("job ran", Duration::from_secs(20), || {
        p.path().join("ran.log").exists()
    });
    w.signal("TERM");
    assert_eq!(w.wait(), Some(0));
}

#[test]
fn enqueue_arguments_are_json_or_bare_words() {
    let redis = RedisServer::start();
    let ok = Command::new(bin())
        .args([
            "enqueue",
            "-r",
            &redis.url(),
            "ArgJob",
            "hello",
            "-5",
            "[1,{\"a\":null}]",
            "2.50",
        ])
        .output()
        .unwrap();
    assert_success(&ok);
    let job: String = redis::cmd("LINDEX")
        .arg("queue:default")
        .arg(0)
        .query(&mut redis.conn())
        .unwrap();
    assert!(
        job.contains(r#""args":["hello",-5,[1,{"a":null}],2.50]"#),
        "{job}"
    );
    for bad in ["[1,", "{bad json"] {
        let out = Command::new(bin())
            .args(["enqueue", "-r", &redis.url(), "ArgJob", bad])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{bad}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("not valid JSON"));
    }
    let empty = Command::new(bin())
        .args(["enqueue", "-r", &redis.url(), "X", "--queue", ""])
        .output()
        .unwrap();
    assert_eq!(empty.status.code(), Some(2));
}

/// Quiet (RUST_LOG=warn), a failing job's warning still names the process and the job, in
/// both formats: the job's context does not depend on INFO being on.
#[test]
fn quiet_warnings_carry_the_job_context() {
    let redis = RedisServer::start();
    let p = Project::with_jobs(&[("OkJob", "ok", "#!/bin/sh\n")]);
    for json in [false, true] {
        let fmt: &[&str] = if json { &["--log-format", "json"] } else { &[] };
        let mut w = Worker::builder(&redis)
            .jobs(p.path())
            .args(fmt)
            .env("RUST_LOG", "warn")
            .start();
        // A class no manifest names: the job fails at its first poll.
        let out = Command::new(bin())
            .args(["enqueue", "-r", &redis.url(), "NoSuchJob"])
            .output()
            .unwrap();
        let jid = String::from_utf8(out.stdout).unwrap().trim().to_string();
        w.wait_for_line("fail: retry scheduled", Duration::from_secs(20));
        let line = w.line_with("fail: retry scheduled").unwrap();
        if json {
            let v: serde_json::Value = serde_json::from_str(&line).unwrap();
            assert_eq!(v["pid"], w.pid(), "{line}");
            assert_eq!(v["jid"], jid.as_str(), "{line}");
            assert_eq!(v["class"], "NoSuchJob", "{line}");
            assert_eq!(v["queue"], "default", "{line}");
        } else {
            let want = format!(
                "playguard{{pid={}}}:job{{jid={jid} class=NoSuchJob queue=default}}: fail",
                w.pid()
            );
            assert!(line.contains(&want), "{line}");
        }
        w.stop(Duration::from_secs(10));
    }
}

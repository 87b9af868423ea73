//! Bad input never breaks the worker or loses a job: each kind of broken payload gets one clear
//! log line and is kept (in `dead` or `retry`), and the process keeps running. Also: the shipped
//! demo phases refuse Marquee ids that are not plain identifiers.
//! Each test owns its redis-server; waits are conditions with deadlines, never timings.

mod support;

use std::process::Command;
use std::time::Duration;
use support::*;

/// Every shipped demo phase refuses a Marquee id with a path in it, before touching any file.
#[test]
fn demo_phases_refuse_marquee_ids_that_are_not_plain_identifiers() {
    let t = tempfile::tempdir().unwrap();
    let demo = t.path().join("a/demo");
    // A checkout left by an earlier run of Marquee "x": the path below climbs out of it.
    std::fs::create_dir_all(demo.join("seed-x")).unwrap();
    std::fs::create_dir_all(demo.join("marquee-x")).unwrap();
    let victim = t.path().join("victim");
    std::fs::create_dir_all(&victim).unwrap();
    std::fs::write(victim.join("keep"), "precious").unwrap();
    let bin = project_dir().join("jobs/bin");
    let mut phases: Vec<_> = std::fs::read_dir(&bin)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap() != "lib.sh")
        .collect();
    phases.sort();
    assert!(phases.len() >= 6, "{phases:?}");
    for bad in [
        r#"["x/../../../victim"]"#,
        r#"["a b"]"#,
        r#"["1","2"]"#,
        r#"[""]"#,
        r#"["$(id)"]"#,
        "[]",
    ] {
        for phase in &phases {
            let out = Command::new(phase)
                .env("PLAYGUARD_ARGS", bad)
                .env("PLAYGUARD_DEMO_DIR", &demo)
                .current_dir(t.path())
                .output()
                .unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(
                !out.status.success(),
                "{} accepted {bad}: {stderr}",
                phase.display()
            );
            assert!(
                stderr.contains("Marquee id"),
                "{} gave no clear reason for {bad}: {stderr}",
                phase.display()
            );
            assert_eq!(
                std::fs::read_to_string(victim.join("keep")).ok().as_deref(),
                Some("precious"),
                "{} touched a folder outside the demo dir for {bad}",
                phase.display()
            );
        }
    }
    assert!(!t.path().join("a/victim").exists() && !t.path().join("victim/repo").exists());
    // A plain id still works.
    let out = Command::new(bin.join("pull-images"))
        .env("PLAYGUARD_ARGS", r#"["m-7_x"]"#)
        .env("PLAYGUARD_DEMO_DIR", &demo)
        .output()
        .unwrap();
    assert_success(&out);
    let out = Command::new(bin.join("pull-images"))
        .env("PLAYGUARD_ARGS", "[7]")
        .env("PLAYGUARD_DEMO_DIR", &demo)
        .output()
        .unwrap();
    assert_success(&out);
}

fn dead_raw(redis: &RedisServer) -> Vec<Vec<u8>> {
    redis::cmd("ZRANGE")
        .arg(&["dead", "0", "-1"])
        .query(&mut redis.conn())
        .unwrap()
}

fn push_raw(redis: &RedisServer, payload: &[u8]) {
    let _: () = redis::cmd("LPUSH")
        .arg("queue:default")
        .arg(payload)
        .query(&mut redis.conn())
        .unwrap();
}

fn ok_job(jid: &str, args: &str) -> String {
    format!(
        r#"{{"retry":true,"queue":"default","class":"OkJob","args":{args},"jid":"{jid}","created_at":1.5,"enqueued_at":1.5}}"#
    )
}

/// Every kind of broken payload lands in `dead` (unparseable ones byte for byte, the others
/// with the reason), each with one clear log line, while the worker keeps running jobs.
#[test]
fn every_bad_payload_is_kept_in_dead_and_the_worker_runs_on() {
    let redis = RedisServer::start();
    let p = Project::with_jobs(&[(
        "OkJob",
        "ok",
        "#!/bin/sh\nprintf '%s\\n' \"$PLAYGUARD_JID $PLAYGUARD_ARGS\" >> ran.log\n",
    )]);
    let limit = 4096;
    let deep = format!(
        r#"{{"class":"OkJob","args":[{}1{}],"jid":"deep"}}"#,
        "[".repeat(200),
        "]".repeat(200)
    );
    // Kept byte for byte: (payload, what the log line says).
    let unparseable: Vec<(Vec<u8>, &str)> = vec![
        (b"not json {".to_vec(), "invalid JSON"),
        (b"[1,2,3]".to_vec(), "not an object"),
        (
            b"{\"class\":\"OkJob\",\"args\":[\"caf\xe9\"]}".to_vec(),
            "not valid UTF-8",
        ),
        (deep.into_bytes(), "recursion limit"),
        (
            ok_job("huge", &format!("[\"{}\"]", "x".repeat(limit))).into_bytes(),
            "over the limit",
        ),
    ];
    // Parseable but not a job we can run: dead with error_class and error_message.
    let invalid: Vec<(String, &str, &str)> = vec![
        (
            r#"{"args":[1],"jid":"noclass","retry":true}"#.into(),
            "Playguard::InvalidPayload",
            "class",
        ),
        (
            r#"{"class":7,"args":[1],"jid":"intclass"}"#.into(),
            "Playguard::InvalidPayload",
            "class",
        ),
        (
            ok_job("strargs", r#""x""#),
            "Playguard::InvalidPayload",
            "args",
        ),
        (
            ok_job("objargs", r#"{"a":1}"#),
            "Playguard::InvalidPayload",
            "args",
        ),
        (
            r#"{"retry":true,"queue":"default","class":"OkJob","args":[1],"jid":"nul\u0000jid"}"#
                .into(),
            "Playguard::BadArguments",
            "NUL",
        ),
    ];
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["--max-payload-bytes", &limit.to_string()])
        .start();
    for (raw, _) in &unparseable {
        push_raw(&redis, raw);
    }
    for (raw, _, _) in &invalid {
        push_raw(&redis, raw.as_bytes());
    }
    // A NUL inside an argument is fine: PLAYGUARD_ARGS carries it JSON-escaped.
    push_raw(&redis, ok_job("nularg", r#"["a\u0000b"]"#).as_bytes());
    push_raw(&redis, ok_job("fine", "[1]").as_bytes());
    wait_until("every bad payload is dead", Duration::from_secs(30), || {
        dead_raw(&redis).len() == unparseable.len() + 5
    });
    wait_until("the good jobs ran", Duration::from_secs(20), || {
        std::fs::read_to_string(p.path().join("ran.log"))
            .is_ok_and(|s| s.contains("fine [1]") && s.contains("nularg"))
    });
    let ran = std::fs::read_to_string(p.path().join("ran.log")).unwrap();
    assert!(ran.contains(r#"nularg ["a\u0000b"]"#), "{ran}");
    assert!(
        !ran.contains("strargs") && !ran.contains("objargs"),
        "{ran}"
    );
    assert!(
        w.child.try_wait().unwrap().is_none(),
        "the worker is still running"
    );
    let dead = dead_raw(&redis);
    for (raw, says) in &unparseable {
        assert!(
            dead.contains(raw),
            "not kept as is: {}",
            String::from_utf8_lossy(raw)
        );
        w.wait_for_line(says, Duration::from_secs(10));
    }
    let parsed: Vec<serde_json::Value> = dead
        .iter()
        .filter_map(|d| serde_json::from_slice(d).ok())
        .collect();
    for (raw, class, says) in &invalid {
        let orig: serde_json::Value = serde_json::from_str(raw).unwrap();
        let d = parsed
            .iter()
            .find(|d| d["jid"] == orig["jid"] && d.get("error_class").is_some())
            .unwrap_or_else(|| panic!("{raw} not in dead: {parsed:?}"));
        assert_eq!(d["error_class"], *class, "{d}");
        assert!(d["error_message"].as_str().unwrap().contains(says), "{d}");
        assert_eq!(d["args"], orig["args"], "{d}");
        w.wait_for_line(class, Duration::from_secs(10));
    }
    let retry: i64 = redis::cmd("ZCARD")
        .arg("retry")
        .query(&mut redis.conn())
        .unwrap();
    assert_eq!(retry, 0);
    w.stop(Duration::from_secs(30));

    // Arguments too large for exec (E2BIG): the spawn fails and the job is dead with the reason.
    let big = ok_job("e2big", &format!("[\"{}\"]", "y".repeat(300 * 1024)));
    let w = Worker::builder(&redis).jobs(p.path()).start();
    push_raw(&redis, big.as_bytes());
    wait_until("the e2big job is dead", Duration::from_secs(30), || {
        dead_raw(&redis).len() == unparseable.len() + 6
    });
    let d: serde_json::Value = dead_raw(&redis)
        .iter()
        .filter_map(|d| serde_json::from_slice::<serde_json::Value>(d).ok())
        .find(|d| d["jid"] == "e2big")
        .unwrap();
    assert_eq!(
        d["error_class"], "Playguard::BadArguments",
        "{}",
        d["error_message"]
    );
    assert!(
        d["error_message"].as_str().unwrap().contains("too large"),
        "{}",
        d["error_message"]
    );
    w.wait_for_line("Playguard::BadArguments", Duration::from_secs(10));
}

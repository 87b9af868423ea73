//! Under systemd, stdout is journald's stream (JOURNAL_STREAM names its device and inode) and
//! each line's `<N>` prefix becomes its PRIORITY: an error is `<3>`, a job's start and done
//! lines `<6>`. When stdout is anything else (here a file JOURNAL_STREAM does not name, as
//! when a unit redirects stdout to a shipper's pipe) the lines are left as they were.
//! packaging/deb/nspawn_check.sh checks the same in a real journal.

mod support;

use std::os::unix::fs::MetadataExt;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};
use support::*;

/// Run a worker with stdout on a file and JOURNAL_STREAM set to `stream(file)`, give it one
/// job it cannot parse (an ERROR line) and one it runs, stop it, and return its lines.
fn lines_with(stream: impl Fn(&std::fs::Metadata) -> String) -> Vec<String> {
    let redis = RedisServer::start();
    let t = tempfile::tempdir().unwrap();
    let out_path = t.path().join("stdout");
    let out = std::fs::File::create(&out_path).unwrap();
    let value = stream(&out.metadata().unwrap());
    let p = Project::with_jobs(&[("OkJob", "ok", "#!/bin/sh\nexit 0\n")]);
    let mut child = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-q", "default"])
        .env("JOURNAL_STREAM", value)
        .command()
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut c = redis.conn();
    let _: () = redis::cmd("LPUSH")
        .arg("queue:default")
        .arg("{not json")
        .query(&mut c)
        .unwrap();
    wait_until("the bad payload in dead", Duration::from_secs(20), || {
        redis.zcard("dead") == 1
    });
    let read = || std::fs::read_to_string(&out_path).unwrap_or_default();
    wait_until("its ERROR line", Duration::from_secs(20), || {
        read().contains("ERROR")
    });
    stop(&mut child);
    read().lines().map(str::to_string).collect()
}

fn stop(child: &mut Child) {
    signal(child.id() as i32, "TERM");
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "worker did not stop on TERM");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn lines_carry_the_journal_level_prefix_when_stdout_is_the_named_stream() {
    let lines = lines_with(|m| format!("{}:{}", m.dev(), m.ino()));
    assert!(!lines.is_empty());
    for l in &lines {
        let want = if l.contains(" ERROR ") {
            "<3>"
        } else if l.contains("  WARN ") {
            "<4>"
        } else {
            "<6>"
        };
        assert!(l.starts_with(want), "line without {want}: {l}");
    }
    assert!(lines.iter().any(|l| l.starts_with("<3>")), "{lines:#?}");
}

#[test]
fn lines_are_unchanged_when_journal_stream_names_another_file() {
    let lines = lines_with(|m| format!("{}:{}", m.dev(), m.ino() + 1));
    assert!(lines.iter().any(|l| l.contains(" ERROR ")), "{lines:#?}");
    for l in &lines {
        assert!(!l.starts_with('<'), "prefix on a plain stdout: {l}");
    }
}

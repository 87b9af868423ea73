//! A stdout nobody reads (a stuck log pipe, a paused log shipper) must not stop the work:
//! past the log buffer lines are dropped and counted, jobs go on running, and once stdout is
//! read again one line says how many were dropped. The worker's stdout here is a pipe the test
//! does not read while a job prints megabytes (each of its lines is logged) and others queue.
//! Real binary, real redis-server; waits are conditions with deadlines.
mod support;

use serde_json::json;
use std::io::BufRead;
use std::process::{Child, Stdio};
use std::time::Duration;
use support::*;

/// Kills the worker when the test ends, however it ends.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn job(class: &str, i: usize) -> String {
    json!({"retry": true, "queue": "default", "class": class, "args": [i],
        "jid": format!("{class}-{i:04}"), "created_at": 1.0, "enqueued_at": 1.0})
    .to_string()
}

#[test]
fn jobs_run_on_while_stdout_is_not_read_and_the_drop_is_reported() {
    let redis = RedisServer::start();
    let p = Project::new();
    // 60,000 lines of 200 bytes: each is a log line of the worker's, far past its buffer.
    p.script(
        "jobs/bin/noisy",
        "#!/bin/sh\nyes 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx' | head -n 60000\necho \"$PLAYGUARD_JID\" > noisy.done\n",
    );
    p.script("jobs/bin/quiet", RECORD_JID);
    p.write(
        "jobs/app.toml",
        "[[job]]\nclass = \"NoisyJob\"\nrun = [\"jobs/bin/noisy\"]\n\n\
         [[job]]\nclass = \"QuietJob\"\nrun = [\"jobs/bin/quiet\"]\n",
    );
    let mut jobs = vec![job("NoisyJob", 0)];
    jobs.extend((0..40).map(|i| job("QuietJob", i)));
    // LPUSH: the noisy job, pushed first, runs first.
    push_to_default(&redis, &jobs);
    let mut w = Killed(
        Worker::builder(&redis)
            .jobs(p.path())
            .args(["-c", "2"])
            .command()
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_until(
        "every quiet job ran while stdout was not read",
        Duration::from_secs(120),
        || p.lines("ledger.txt").len() == 40,
    );
    wait_until("the queue drained", Duration::from_secs(60), || {
        redis.llen("queue:default") == 0
    });
    // The noisy job has printed its last line only once the worker read (and logged, or
    // dropped) all but a pipe's worth of the rest. Without this wait a noisy job that started
    // late (a loaded machine) printed into a stdout already being read: nothing dropped.
    wait_until(
        "the noisy job printed all its lines",
        Duration::from_secs(120),
        || p.path().join("noisy.done").exists(),
    );
    // Read stdout again: the writer catches up and reports the drop.
    let (tx, rx) = std::sync::mpsc::channel();
    let out = w.0.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if line.contains("log lines dropped") && tx.send(line).is_err() {
                break;
            }
        }
    });
    let line = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("one line reports the dropped lines");
    let n: u64 = line
        .split_whitespace()
        .find_map(|f| f.strip_prefix("dropped="))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no dropped= count in: {line}"));
    assert!(n > 0, "{line}");
}

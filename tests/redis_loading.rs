//! A worker started while its Redis is still loading the dataset back (a restart with
//! persistence answers `LOADING` for a while) waits for it and then works, instead of exiting
//! as if Redis were unreachable: under foreman one exiting process stops the whole Procfile.
mod support;

use std::process::{Child, Command, Stdio};
use std::time::Duration;
use support::*;

/// A redis-server this test starts on `port` over the dump in `dir`, loading it slowly.
struct LoadingRedis(Child);

impl Drop for LoadingRedis {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_worker_started_while_redis_loads_waits_and_then_runs_jobs() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let mut first = RedisServer::start_with(&["--dir", d, "--enable-debug-command", "yes"]);
    let port = first.port;
    redis::cmd("DEBUG")
        .arg("POPULATE")
        .arg(20_000)
        .query::<()>(&mut first.conn())
        .unwrap();
    redis::cmd("SAVE").query::<()>(&mut first.conn()).unwrap();
    first.stop();

    // The same port and dump, each key's load slowed down: seconds of LOADING replies.
    let loading = LoadingRedis(
        Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--dir", d, "--save", "", "--appendonly", "no"])
            .args([
                "--key-load-delay",
                "500",
                "--loading-process-events-interval-bytes",
                "1024",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server"),
    );
    let url = format!("redis://127.0.0.1:{port}/0");
    let client = redis::Client::open(url.as_str()).unwrap();
    let answer = || -> Result<String, String> {
        let mut c = client.get_connection().map_err(|e| e.to_string())?;
        redis::cmd("PING")
            .query::<String>(&mut c)
            .map_err(|e| e.code().unwrap_or("other").to_string())
    };
    wait_until("redis answers LOADING", Duration::from_secs(10), || {
        answer().err().as_deref() == Some("LOADING")
    });

    let p = Project::with_jobs(&[(
        "LoadedJob",
        "loaded",
        "#!/bin/sh\necho ran > \"$PLAYGUARD_JID.ran\"\n",
    )]);
    let mut w = Worker::builder_url(&url).jobs(p.path()).start();
    wait_until("the worker says it waits", Duration::from_secs(10), || {
        w.saw("loading its dataset; waiting")
    });
    assert!(
        w.child.try_wait().unwrap().is_none(),
        "the worker exited while Redis was loading:\n{}",
        w.output()
    );
    wait_until("redis has loaded", Duration::from_secs(120), || {
        answer().is_ok()
    });
    let mut c = client.get_connection().unwrap();
    redis::cmd("LPUSH")
        .arg("queue:default")
        .arg(r#"{"class":"LoadedJob","args":[],"jid":"0123456789abcdef01234567","queue":"default","retry":true,"created_at":1.0,"enqueued_at":1.0}"#)
        .query::<()>(&mut c)
        .unwrap();
    wait_until("the job ran", Duration::from_secs(30), || {
        p.path().join("0123456789abcdef01234567.ran").exists()
    });
    w.signal("TERM");
    let status = w.child.wait().unwrap();
    assert!(status.success(), "{}", w.output());
    drop(loading);
}

//! Starting the real `playguard` binary: a running worker whose output lines are collected, and
//! `playguard enqueue`.

use super::{bin, signal, RedisServer};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A running `playguard` child process whose output lines are collected.
pub struct Worker {
    pub child: Child,
    pub lines: Arc<Mutex<Vec<String>>>,
    /// The threads reading stdout and stderr: an exit is only fully seen once they reach
    /// end of file, else the last lines can still be in the pipe when a test reads them.
    readers: Vec<std::thread::JoinHandle<()>>,
}

impl Worker {
    /// Start `playguard run` in `dir` against `redis` with extra args.
    pub fn start(redis: &RedisServer, dir: &Path, args: &[&str]) -> Worker {
        Self::start_cmd(redis, dir, "run", args)
    }

    pub fn start_cmd(redis: &RedisServer, dir: &Path, sub: &str, args: &[&str]) -> Worker {
        Self::start_at(&redis.url(), dir, sub, args, &[])
    }

    /// Start `playguard <sub> -r <url>` (any URL form, e.g. redis-sentinel://).
    pub fn start_url(url: &str, dir: &Path, sub: &str, args: &[&str]) -> Worker {
        Self::start_at(url, dir, sub, args, &[])
    }

    /// Start `playguard <sub> -r <url>` with extra environment variables.
    pub fn start_at(
        url: &str,
        dir: &Path,
        sub: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Worker {
        let mut cmd = Command::new(bin());
        cmd.arg(sub)
            .args(["-r", url])
            .args(args)
            .current_dir(dir)
            .env("RUST_LOG", "info")
            .envs(env.iter().copied());
        Worker::spawn(&mut cmd)
    }

    /// Spawn `cmd` with its stdout and stderr lines collected.
    fn spawn_collecting(mut cmd: Command) -> Worker {
        Self::spawn(&mut cmd)
    }

    /// Run `cmd` (a playguard command line, possibly wrapped, e.g. by `ip netns exec`), its
    /// stdout and stderr lines collected.
    pub fn spawn(cmd: &mut Command) -> Worker {
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn playguard");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let mut readers = Vec::new();
        for stream in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let lines = lines.clone();
            readers.push(std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    if std::env::var("PLAYGUARD_TEST_ECHO").is_ok() {
                        eprintln!("[worker] {line}");
                    }
                    lines.lock().unwrap().push(line);
                }
            }));
        }
        Worker {
            child,
            lines,
            readers,
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn signal(&self, sig: &str) {
        signal(self.pid(), sig);
    }

    pub fn output(&self) -> String {
        self.lines.lock().unwrap().join("\n")
    }

    pub fn saw(&self, needle: &str) -> bool {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .any(|l| l.contains(needle))
    }

    pub fn wait_for_line(&self, needle: &str, timeout: Duration) {
        let what = format!("worker output line containing {needle:?}");
        let deadline = Instant::now() + timeout;
        while !self.saw(needle) {
            if Instant::now() > deadline {
                panic!("timed out waiting for {what}; output:\n{}", self.output());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Wait for exit; returns the exit code (None when killed by a signal).
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<i32> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                self.drain_output();
                return st.code();
            }
            if Instant::now() > deadline {
                panic!(
                    "worker did not exit within {timeout:?}; output:\n{}",
                    self.output()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// After the exit: wait (up to two seconds) for the readers to reach end of file, so every
    /// line the process wrote is in `lines`. A child of the worker that still holds the pipes
    /// open only makes this wait end at that bound.
    fn drain_output(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(2);
        while self.readers.iter().any(|r| !r.is_finished()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        for r in std::mem::take(&mut self.readers) {
            if r.is_finished() {
                let _ = r.join();
            }
        }
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

impl Worker {
    /// `playguard run` with extra environment variables (say DATABASE_URL).
    pub fn start_with_env(
        redis: &RedisServer,
        dir: &Path,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Worker {
        let mut cmd = Command::new(bin());
        cmd.arg("run")
            .args(["-r", &redis.url()])
            .args(args)
            .current_dir(dir)
            .env("RUST_LOG", "info");
        for (k, v) in env {
            cmd.env(k, v);
        }
        Worker::spawn_collecting(cmd)
    }
}

/// `playguard enqueue -r <redis> <args>...` with the real binary; returns the jid.
pub fn enqueue(redis: &RedisServer, args: &[&str]) -> String {
    enqueue_url(&redis.url(), args)
}

/// `playguard enqueue -r <url> <args>...` (any URL form); returns the jid.
pub fn enqueue_url(url: &str, args: &[&str]) -> String {
    let out = Command::new(bin())
        .args(["enqueue", "-r", url])
        .args(args)
        .output()
        .expect("run playguard enqueue");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

//! Starting the real `playguard` binary: [`Worker::builder`] is the one way a test starts a
//! worker (`playguard run`: URL, project directory, arguments, environment, wrapper), the
//! running [`Worker`] with its output lines collected, and `playguard enqueue`.

use super::lines::Lines;
use super::{bin, signal, wait_until, RedisServer};
use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How to start one `playguard` process: `[WRAPPER...] playguard run -r URL ARGS...` in the
/// project directory, with RUST_LOG=info unless the test sets it. Start it with
/// [`WorkerBuilder::start`].
#[must_use]
#[derive(Clone)]
pub struct WorkerBuilder {
    url: String,
    dir: Option<PathBuf>,
    args: Vec<OsString>,
    env: Vec<(OsString, OsString)>,
    wrapper: Vec<OsString>,
}

impl WorkerBuilder {
    /// The project directory the worker runs in (its `jobs/` manifests), its current directory.
    pub fn jobs(mut self, dir: impl AsRef<Path>) -> Self {
        self.dir = Some(dir.as_ref().to_path_buf());
        self
    }

    /// One more command-line argument, after `-r URL`.
    pub fn arg(mut self, arg: impl AsRef<OsStr>) -> Self {
        self.args.push(arg.as_ref().to_os_string());
        self
    }

    pub fn args<I: IntoIterator<Item = S>, S: AsRef<OsStr>>(mut self, args: I) -> Self {
        self.args
            .extend(args.into_iter().map(|a| a.as_ref().to_os_string()));
        self
    }

    /// An environment variable (RUST_LOG here wins over the default `info`).
    pub fn env(mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> Self {
        self.env
            .push((key.as_ref().to_os_string(), value.as_ref().to_os_string()));
        self
    }

    /// Run the worker through a wrapper command line, e.g. `ip netns exec NS`.
    pub fn wrapped_in<I: IntoIterator<Item = S>, S: AsRef<OsStr>>(mut self, wrapper: I) -> Self {
        self.wrapper = wrapper
            .into_iter()
            .map(|a| a.as_ref().to_os_string())
            .collect();
        self
    }

    /// The command line, not started.
    pub fn command(&self) -> Command {
        let mut cmd = match self.wrapper.split_first() {
            Some((program, rest)) => {
                let mut c = Command::new(program);
                c.args(rest).arg(bin());
                c
            }
            None => Command::new(bin()),
        };
        cmd.arg("run")
            .args(["-r", &self.url])
            .args(&self.args)
            .env("RUST_LOG", "info")
            .envs(self.env.iter().map(|(k, v)| (k, v)));
        if let Some(dir) = &self.dir {
            cmd.current_dir(dir);
        }
        cmd
    }

    /// Start it, its stdout and stderr lines collected.
    pub fn start(self) -> Worker {
        Worker::spawn(&mut self.command())
    }

    /// Start `n` workers alike (a fleet sharing one Redis and project).
    pub fn start_many(self, n: usize) -> Vec<Worker> {
        (0..n).map(|_| self.clone().start()).collect()
    }
}

/// A running `playguard` child process whose output lines are collected.
pub struct Worker {
    pub child: Child,
    lines: Lines,
}

impl Worker {
    /// `playguard run -r <redis's URL>`; see [`WorkerBuilder`] for the rest.
    pub fn builder(redis: &RedisServer) -> WorkerBuilder {
        Self::builder_url(&redis.url())
    }

    /// `playguard run -r <url>` (any URL form, e.g. redis-sentinel://, rediss://, a database
    /// number, a password).
    pub fn builder_url(url: &str) -> WorkerBuilder {
        WorkerBuilder {
            url: url.to_string(),
            dir: None,
            args: Vec::new(),
            env: Vec::new(),
            wrapper: Vec::new(),
        }
    }

    /// Run any command line with its stdout and stderr lines collected (the builder's own
    /// spawn; the harness test runs a shell with it).
    pub fn spawn(cmd: &mut Command) -> Worker {
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn playguard");
        let lines = Lines::collect(&mut child);
        Worker { child, lines }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn signal(&self, sig: &str) {
        signal(self.pid(), sig);
    }

    /// Every output line so far (stdout and stderr), joined with newlines.
    pub fn output(&self) -> String {
        self.lines.text()
    }

    /// Stdout's lines so far, joined with newlines.
    pub fn stdout(&self) -> String {
        self.lines.stdout_text()
    }

    /// Every output line so far (stdout and stderr).
    pub fn lines(&self) -> Vec<String> {
        self.lines.all()
    }

    /// The identity this worker registered in `redis`'s `processes` (hostname:pid:nonce),
    /// waited for.
    pub fn identity(&self, redis: &RedisServer) -> String {
        let mut found = None;
        wait_until("the worker registered", Duration::from_secs(20), || {
            let ids: Vec<String> = redis::cmd("SMEMBERS")
                .arg("processes")
                .query(&mut redis.conn())
                .unwrap();
            found = ids
                .into_iter()
                .find(|i| i.split(':').nth_back(1) == Some(&self.pid().to_string()));
            found.is_some()
        });
        found.unwrap()
    }

    /// The (tick, enqueued) pairs of the "periodic tick" lines this worker wrote for the
    /// `[[periodic]]` entry `name` (one per tick it finished).
    pub fn periodic_ticks(&self, name: &str) -> Vec<(u64, usize)> {
        let entry = format!("periodic={name}");
        let field = |l: &str, key: &str| -> Option<String> {
            l.split_whitespace()
                .find_map(|t| t.strip_prefix(key).map(str::to_string))
        };
        self.lines()
            .iter()
            .filter(|l| l.contains("periodic tick") && l.contains(&entry))
            .filter_map(|l| {
                let n = field(l, "enqueued=")?.parse().ok()?;
                Some((field(l, "tick=")?.parse().ok()?, n))
            })
            .collect()
    }

    /// The first output line so far that contains `needle`.
    pub fn line_with(&self, needle: &str) -> Option<String> {
        self.lines.find(needle)
    }

    /// How many output lines so far contain `needle`.
    pub fn count_lines(&self, needle: &str) -> usize {
        self.lines.count(needle)
    }

    /// Whether a line so far contains `needle`. The worker writes its log through a writer
    /// thread, so a line can trail the Redis state it reports: to check that a line was
    /// written, wait for it (`wait_for_line`); `saw` suits a line that must not appear.
    pub fn saw(&self, needle: &str) -> bool {
        self.lines.saw(needle)
    }

    pub fn wait_for_line(&self, needle: &str, timeout: Duration) {
        self.lines.wait_for(needle, timeout)
    }

    /// Wait for exit; returns the exit code (None when killed by a signal).
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<i32> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                self.lines.drain(Duration::from_secs(2));
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

    /// Wait for exit, for as long as it takes (as `Child::wait`); the exit code (None when
    /// killed by a signal), every line read.
    pub fn wait(&mut self) -> Option<i32> {
        let st = self.child.wait().unwrap();
        self.lines.drain(Duration::from_secs(2));
        st.code()
    }

    /// SIGTERM, then exit 0 within `timeout` (the output is the failure message).
    pub fn stop(&mut self, timeout: Duration) {
        self.signal("TERM");
        assert_eq!(self.wait_exit(timeout), Some(0), "{}", self.output());
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

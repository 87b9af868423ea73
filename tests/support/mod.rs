//! Test support: every test owns its redis-server (free loopback port, no persistence) and,
//! when it needs one, its PostgreSQL cluster (initdb in a temp dir), each stopped by PID on
//! drop, plus helpers to run the real binary and the real Ruby Sidekiq. Touches only the
//! servers it started.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A redis-server this test started and will stop.
pub struct RedisServer {
    pub port: u16,
    child: Option<Child>,
    extra: Vec<String>,
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind a free port")
        .local_addr()
        .unwrap()
        .port()
}

impl RedisServer {
    pub fn start() -> RedisServer {
        Self::start_with(&[])
    }

    /// A server with extra arguments (e.g. `--replicaof 127.0.0.1 PORT`).
    pub fn start_with(extra: &[&str]) -> RedisServer {
        let mut s = RedisServer {
            port: free_port(),
            child: None,
            extra: extra.iter().map(|a| a.to_string()).collect(),
        };
        s.spawn();
        s
    }

    fn spawn(&mut self) {
        let child = Command::new("redis-server")
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
            ])
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server must be installed (apt-get install redis-server)");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(mut c) = self.client().get_connection() {
                match redis::cmd("PING").query::<String>(&mut c) {
                    // NOAUTH: up, and started with --requirepass.
                    Ok(_) => return,
                    Err(e) if e.code() == Some("NOAUTH") => return,
                    Err(_) => {}
                }
            }
            assert!(
                Instant::now() < deadline,
                "redis-server on {} did not start",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    pub fn client(&self) -> redis::Client {
        redis::Client::open(self.url()).unwrap()
    }

    pub fn conn(&self) -> redis::Connection {
        let c = self
            .client()
            .get_connection()
            .expect("connect to test redis");
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        c
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().expect("running").id() as i32
    }

    /// SIGSTOP: the server holds connections open but answers nothing.
    pub fn pause(&self) {
        signal(self.pid(), "STOP");
    }

    pub fn resume(&self) {
        signal(self.pid(), "CONT");
    }

    /// Kill the server (data is gone: it persists nothing).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Start again on the same port.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if let Some(c) = self.child.as_ref() {
            // A paused server would ignore SIGKILL only until CONT; KILL works either way.
            signal(c.id() as i32, "CONT");
        }
        self.stop();
    }
}

/// A finished command exited 0; its stderr is the failure message otherwise.
pub fn assert_success(out: &std::process::Output) {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

pub fn signal(pid: i32, sig: &str) {
    let _ = Command::new("kill")
        .args([format!("-{sig}"), pid.to_string()])
        .status();
}

/// Poll `cond` until it is true or the deadline passes; panics with `what` on timeout.
pub fn wait_until<F: FnMut() -> bool>(what: &str, timeout: Duration, mut cond: F) {
    let deadline = Instant::now() + timeout;
    loop {
        if cond() {
            return;
        }
        if Instant::now() > deadline {
            panic!("timed out after {timeout:?} waiting for: {what}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_playguard")
}

pub fn project_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

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

/// Whether the real Ruby Sidekiq is here. With PLAYGUARD_REQUIRE_RUBY=1 (as .ci/run sets) its
/// absence fails the test instead of skipping it.
pub fn ruby_available() -> bool {
    ruby_can("require 'sidekiq'; require 'sidekiq/api'", "ruby-sidekiq")
}

/// Whether Ruby can run `requires`; skips (or fails under PLAYGUARD_REQUIRE_RUBY=1) naming the
/// Debian `packages` that provide it.
pub fn ruby_can(requires: &str, packages: &str) -> bool {
    let ok = Command::new("ruby")
        .args(["-e", requires])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !ok && std::env::var("PLAYGUARD_REQUIRE_RUBY").as_deref() == Ok("1") {
        panic!("{packages} required (PLAYGUARD_REQUIRE_RUBY=1) but `ruby -e \"{requires}\"` fails");
    }
    if !ok {
        eprintln!("skipping: `ruby -e \"{requires}\"` fails (apt-get install {packages})");
    }
    ok
}

/// Run a Ruby snippet with Sidekiq loaded and pointed at `redis`; returns stdout, panics on failure.
pub fn ruby(redis: &RedisServer, script: &str) -> String {
    let prelude = "require 'sidekiq'\nrequire 'sidekiq/api'\nrequire 'json'\n\
        Sidekiq.configure_client { |c| c.redis = { url: ENV['REDIS_URL'] } }\n\
        Sidekiq.logger.level = Logger::WARN\n";
    let out = Command::new("ruby")
        .args(["-e", &format!("{prelude}{script}")])
        .env("REDIS_URL", redis.url())
        .output()
        .expect("run ruby");
    assert!(
        out.status.success(),
        "ruby failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// A scratch project directory with `jobs/` manifests and scripts.
pub struct Project {
    pub dir: tempfile::TempDir,
}

impl Project {
    pub fn new() -> Project {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("jobs/bin")).unwrap();
        Project { dir }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn write(&self, rel: &str, content: &str) -> PathBuf {
        let p = self.dir.path().join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, content).unwrap();
        p
    }

    /// A project whose `jobs/app.toml` maps each class to a script: (class, script name under
    /// jobs/bin, script body). Several classes may share one script (same name and body).
    pub fn with_jobs(jobs: &[(&str, &str, &str)]) -> Project {
        let p = Project::new();
        let mut manifest = String::new();
        for (class, script, body) in jobs {
            p.script(&format!("jobs/bin/{script}"), body);
            manifest += &format!("[[job]]\nclass = \"{class}\"\nrun = [\"jobs/bin/{script}\"]\n");
        }
        p.write("jobs/app.toml", &manifest);
        p
    }

    /// Write an executable script.
    pub fn script(&self, rel: &str, content: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let p = self.write(rel, content);
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    }
}

/// A plain HTTP GET on loopback: (status, body).
pub fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    let status = buf.split_whitespace().nth(1)?.parse().ok()?;
    let body = buf.split_once("\r\n\r\n")?.1.to_string();
    Some((status, body))
}

/// Samples of a Prometheus scrape, keyed by `name{labels}` exactly as written.
pub fn scrape(port: u16) -> std::collections::BTreeMap<String, f64> {
    let (status, body) = http_get(port, "/metrics").expect("scrape /metrics");
    assert_eq!(status, 200);
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (k, v) = l.rsplit_once(' ').unwrap();
            (k.to_string(), v.parse().unwrap())
        })
        .collect()
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

/// Whether foreman is here; with PLAYGUARD_REQUIRE_RUBY=1 its absence fails the test.
pub fn foreman_available() -> bool {
    let ok = Command::new("foreman")
        .arg("version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok && std::env::var("PLAYGUARD_REQUIRE_RUBY").as_deref() == Ok("1") {
        panic!("foreman required (PLAYGUARD_REQUIRE_RUBY=1): apt-get install ruby-foreman");
    }
    if !ok {
        eprintln!("skipping: foreman is not installed (apt-get install ruby-foreman)");
    }
    ok
}

/// A PostgreSQL cluster this test created (initdb in a temp dir, run as an unprivileged user
/// when the test runs as root), listening on 127.0.0.1 on a free port with its unix socket in
/// the temp dir, stopped by PID on drop. Never a server the test did not start.
pub struct PostgresServer {
    pub port: u16,
    dir: tempfile::TempDir,
    bindir: PathBuf,
    child: Option<Child>,
    /// Started by [`PostgresServer::start_tls`]: plain TCP is refused.
    tls: bool,
}

/// Where initdb and postgres live: on PATH, else `pg_config --bindir`, else the newest
/// `/usr/lib/postgresql/*/bin` (Debian's `postgresql` package puts them there).
fn pg_bindir() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    if let Some(d) = std::env::split_paths(&path).find(|d| d.join("initdb").is_file()) {
        return d;
    }
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output() {
        let d = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if d.join("initdb").is_file() {
            return d;
        }
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|rd| {
            rd.filter_map(|e| e.ok().map(|e| e.path().join("bin")))
                .filter(|d| d.join("initdb").is_file())
                .collect()
        })
        .unwrap_or_default();
    found.sort_by_key(|d| {
        d.parent()
            .and_then(|v| v.file_name())
            .and_then(|v| v.to_str())
            .and_then(|v| v.parse::<u32>().ok())
            .unwrap_or(0)
    });
    found
        .pop()
        .expect("PostgreSQL server binaries (initdb, postgres) must be installed (apt-get install postgresql)")
}

fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// `bin args...`, as `nobody` when we are root (PostgreSQL refuses to run as root). setpriv
/// execs in place, so the child's PID is the program's own.
fn pg_command(bin: &Path, args: &[&str]) -> Command {
    if running_as_root() {
        let mut c = Command::new("setpriv");
        c.args(["--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"])
            .arg(bin)
            .args(args);
        c
    } else {
        let mut c = Command::new(bin);
        c.args(args);
        c
    }
}

impl PostgresServer {
    pub fn start() -> PostgresServer {
        let mut s = Self::init();
        s.spawn();
        s
    }

    /// A server that speaks TLS with a certificate from a throwaway CA ([`Self::ca_path`])
    /// whose subjectAltName is `sans` (say `"IP:127.0.0.1,DNS:localhost"`), and whose
    /// pg_hba.conf accepts TCP only over TLS (`hostssl`): a plain connection is refused, so a
    /// client that gets in used TLS. psql reaches it over the Unix socket.
    pub fn start_tls(sans: &str) -> PostgresServer {
        use std::io::Write as _;
        let mut s = Self::init();
        let dir = s.dir.path();
        make_ca(dir, "ca");
        make_server_cert(dir, "ca", "server", sans);
        let key = dir.join("server.key");
        if running_as_root() {
            let st = Command::new("chown")
                .arg("nobody:nogroup")
                .arg(&key)
                .status()
                .unwrap();
            assert!(st.success(), "chown the server key");
        }
        // PostgreSQL refuses a key file others can read.
        std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .unwrap();
        let data = dir.join("data");
        let mut conf = std::fs::OpenOptions::new()
            .append(true)
            .open(data.join("postgresql.conf"))
            .unwrap();
        writeln!(
            conf,
            "ssl = on\nssl_cert_file = '{}'\nssl_key_file = '{}'",
            dir.join("server.crt").display(),
            key.display()
        )
        .unwrap();
        std::fs::write(
            data.join("pg_hba.conf"),
            "local all all trust\nhostssl all all 127.0.0.1/32 trust\n",
        )
        .unwrap();
        s.tls = true;
        s.spawn();
        s
    }

    /// Replace pg_hba.conf and restart, so the next connection meets the new rules.
    pub fn set_hba_and_restart(&mut self, content: &str) {
        std::fs::write(self.dir.path().join("data/pg_hba.conf"), content).unwrap();
        self.restart();
    }

    /// The PEM file of the CA that signed a [`Self::start_tls`] server's certificate.
    pub fn ca_path(&self) -> PathBuf {
        self.dir.path().join("ca.crt")
    }

    /// initdb in a fresh temp dir (owned by the server's user), not started.
    fn init() -> PostgresServer {
        let bindir = pg_bindir();
        let dir = tempfile::tempdir().unwrap();
        if running_as_root() {
            let st = Command::new("chown")
                .args(["nobody:nogroup"])
                .arg(dir.path())
                .status()
                .unwrap();
            assert!(st.success(), "chown the PostgreSQL temp dir");
        }
        let data = dir.path().join("data");
        let out = pg_command(
            &bindir.join("initdb"),
            &[
                "-D",
                data.to_str().unwrap(),
                "-U",
                "postgres",
                "-A",
                "trust",
                "--no-sync",
                "-E",
                "UTF8",
            ],
        )
        .env("LC_ALL", "C")
        .output()
        .expect("run initdb");
        assert!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        PostgresServer {
            port: free_port(),
            dir,
            bindir,
            child: None,
            tls: false,
        }
    }

    fn spawn(&mut self) {
        let data = self.dir.path().join("data");
        let child = pg_command(
            &self.bindir.join("postgres"),
            &[
                "-D",
                data.to_str().unwrap(),
                "-p",
                &self.port.to_string(),
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                &format!("unix_socket_directories={}", self.dir.path().display()),
                "-c",
                "fsync=off",
                "-c",
                "synchronous_commit=off",
                "-c",
                "full_page_writes=off",
            ],
        )
        .env("LC_ALL", "C")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start postgres");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.try_psql("SELECT 1").is_err() {
            assert!(
                Instant::now() < deadline,
                "postgres on {} did not start",
                self.port
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn url(&self) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/postgres?sslmode=disable",
            self.port
        )
    }

    /// `postgres://postgres@HOST:PORT/postgres?PARAMS` (for TLS tests: the host name decides
    /// what the certificate must name).
    pub fn url_with(&self, host: &str, params: &str) -> String {
        format!("postgres://postgres@{host}:{}/postgres?{params}", self.port)
    }

    /// Run SQL through psql (over TCP, or the Unix socket for a TLS server, whose TCP port
    /// wants TLS); stdout (unaligned, tuples only) or the error text.
    pub fn try_psql(&self, sql: &str) -> Result<String, String> {
        let target = if self.tls {
            format!(
                "host={} port={} user=postgres dbname=postgres",
                self.dir.path().display(),
                self.port
            )
        } else {
            self.url()
        };
        let out = Command::new("psql")
            .args(["-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-d"])
            .arg(target)
            .args(["-c", sql])
            .output()
            .map_err(|e| format!("psql: {e}"))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }

    pub fn psql(&self, sql: &str) -> String {
        self.try_psql(sql)
            .unwrap_or_else(|e| panic!("psql {sql:?} failed: {e}"))
    }

    /// Fast shutdown (SIGINT to the postmaster, by PID): clients are disconnected.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            signal(c.id() as i32, "INT");
            let deadline = Instant::now() + Duration::from_secs(20);
            while c.try_wait().unwrap().is_none() {
                if Instant::now() > deadline {
                    let _ = c.kill();
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.wait();
        }
    }

    /// Start again on the same port with the same data.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }
}

/// `openssl` in `dir`; panics with its error output.
fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run openssl (apt-get install openssl)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A throwaway CA in `dir`: `NAME.key` and `NAME.crt` (P-256, valid two days).
pub fn make_ca(dir: &Path, name: &str) -> PathBuf {
    let (key, crt) = (format!("{name}.key"), format!("{name}.crt"));
    let subject = format!("/CN=playguard-test-{name}");
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &crt,
            "-days",
            "2",
            "-subj",
            &subject,
        ],
    );
    dir.join(crt)
}

/// `NAME.key` and `NAME.crt` in `dir`, signed by the CA `ca` (see [`make_ca`]), for the names
/// in `sans` (`"IP:127.0.0.1,DNS:localhost"`).
pub fn make_server_cert(dir: &Path, ca: &str, name: &str, sans: &str) -> PathBuf {
    let (key, csr, crt, ext) = (
        format!("{name}.key"),
        format!("{name}.csr"),
        format!("{name}.crt"),
        format!("{name}.ext"),
    );
    let (ca_crt, ca_key) = (format!("{ca}.crt"), format!("{ca}.key"));
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            "/CN=playguard-test-server",
        ],
    );
    std::fs::write(dir.join(&ext), format!("subjectAltName={sans}\n")).unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &ca_crt,
            "-CAkey",
            &ca_key,
            "-CAcreateserial",
            "-out",
            &crt,
            "-days",
            "2",
            "-extfile",
            &ext,
        ],
    );
    dir.join(crt)
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        self.stop();
    }
}

impl RedisServer {
    /// `SHUTDOWN NOSAVE` (as an operator would), then start again on the same port: empty.
    pub fn shutdown_nosave_and_restart(&mut self) {
        let _ = redis::cmd("SHUTDOWN")
            .arg("NOSAVE")
            .query::<()>(&mut self.conn());
        if let Some(mut c) = self.child.take() {
            let deadline = Instant::now() + Duration::from_secs(10);
            while c.try_wait().unwrap().is_none() {
                if Instant::now() > deadline {
                    let _ = c.kill();
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.wait();
        }
        self.spawn();
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

/// A redis-sentinel this test started (config file in its own temp dir), stopped by PID.
pub struct SentinelServer {
    pub port: u16,
    child: Child,
    password: Option<String>,
    _dir: tempfile::TempDir,
}

impl SentinelServer {
    /// Monitor `primary_port` on loopback as master `name` (quorum 2, down after 1 s).
    pub fn start(name: &str, primary_port: u16) -> SentinelServer {
        Self::start_with(name, primary_port, 2, "", None)
    }

    /// As `start`, with a quorum, extra config lines, and the sentinel's own password.
    pub fn start_with(
        name: &str,
        primary_port: u16,
        quorum: u32,
        extra: &str,
        password: Option<&str>,
    ) -> SentinelServer {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let conf = dir.path().join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\ndaemonize no\ndir {}\n\
                 sentinel resolve-hostnames no\n\
                 sentinel monitor {name} 127.0.0.1 {primary_port} {quorum}\n\
                 sentinel down-after-milliseconds {name} 1000\n\
                 sentinel failover-timeout {name} 5000\n\
                 sentinel parallel-syncs {name} 1\n{}{extra}",
                dir.path().display(),
                password
                    .map(|p| format!("requirepass {p}\n"))
                    .unwrap_or_default()
            ),
        )
        .unwrap();
        let child = Command::new("redis-sentinel")
            .arg(&conf)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-sentinel must be installed (apt-get install redis-sentinel)");
        let s = SentinelServer {
            port,
            child,
            password: password.map(str::to_string),
            _dir: dir,
        };
        wait_until("redis-sentinel answers", Duration::from_secs(10), || {
            s.conn()
                .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c).ok())
                .is_some()
        });
        s
    }

    pub fn conn(&self) -> Option<redis::Connection> {
        let auth = self
            .password
            .as_ref()
            .map(|p| format!(":{p}@"))
            .unwrap_or_default();
        let c = redis::Client::open(format!("redis://{auth}127.0.0.1:{}", self.port))
            .ok()?
            .get_connection()
            .ok()?;
        c.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
        Some(c)
    }
}

impl Drop for SentinelServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

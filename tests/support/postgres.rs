//! The PostgreSQL cluster a test creates: initdb in a temp dir, run as `nobody` when the test
//! runs as root, on a free loopback port (optionally TLS-only with a throwaway CA), psql to it,
//! stopped by PID on drop.

use super::tls::{make_ca, make_server_cert};
use super::{free_port, reap_within, signal};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

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
            reap_within(&mut c, Duration::from_secs(20));
        }
    }

    /// Start again on the same port with the same data.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        self.stop();
    }
}

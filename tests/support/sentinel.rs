//! The redis-sentinel (or valkey-sentinel, see `server_binary` in `redis.rs`) a test starts
//! (its config file in its own temp dir) to watch a primary it also started, stopped by PID on
//! drop.

use super::{free_port, wait_until};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

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
        let child = Command::new(super::server_binary("sentinel"))
            .arg(&conf)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "{} must be installed: {e}",
                    super::server_binary("sentinel")
                )
            });
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

//! The redis-server (or valkey-server, see `server_binary`) a test starts and stops: a free
//! loopback port, no persistence, stopped by PID on drop (also paused, resumed, restarted on its
//! port, or shut down NOSAVE and restarted), and the few reads many tests make of it (LLEN,
//! ZCARD, LRANGE).

use super::{free_port, reap_within, signal};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The server a test starts: `redis-<kind>` (kind "server" or "sentinel"), or `valkey-<kind>`
/// when `PLAYGUARD_TEST_SERVER=valkey` (as `.ci/run`'s Valkey leg sets).
pub fn server_binary(kind: &str) -> String {
    match std::env::var("PLAYGUARD_TEST_SERVER").as_deref() {
        Ok("valkey") => format!("valkey-{kind}"),
        Ok("redis") | Err(_) => format!("redis-{kind}"),
        Ok(other) => panic!("PLAYGUARD_TEST_SERVER={other}: expected redis or valkey"),
    }
}

/// A redis-server this test started and will stop.
pub struct RedisServer {
    pub port: u16,
    child: Option<Child>,
    extra: Vec<String>,
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
        let child = Command::new(server_binary("server"))
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
            .unwrap_or_else(|e| panic!("{} must be installed: {e}", server_binary("server")));
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

    /// `LLEN key` on a fresh connection.
    pub fn llen(&self, key: &str) -> usize {
        redis::cmd("LLEN").arg(key).query(&mut self.conn()).unwrap()
    }

    /// `ZCARD key` on a fresh connection.
    pub fn zcard(&self, key: &str) -> i64 {
        redis::cmd("ZCARD")
            .arg(key)
            .query(&mut self.conn())
            .unwrap()
    }

    /// Every payload in every playguard working list (`playguard:working:*`), the lists in
    /// name order. Redis drops an emptied list, so none left means no key left either.
    pub fn working_jobs(&self) -> Vec<String> {
        let mut keys: Vec<String> = redis::cmd("KEYS")
            .arg("playguard:working:*")
            .query(&mut self.conn())
            .unwrap();
        keys.sort();
        keys.iter().flat_map(|k| self.lrange(k)).collect()
    }

    /// The whole list `key` (`LRANGE key 0 -1`) on a fresh connection.
    pub fn lrange(&self, key: &str) -> Vec<String> {
        redis::cmd("LRANGE")
            .arg(key)
            .arg(0)
            .arg(-1)
            .query(&mut self.conn())
            .unwrap()
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

impl RedisServer {
    /// `SHUTDOWN NOSAVE` (as an operator would), then start again on the same port: empty.
    pub fn shutdown_nosave_and_restart(&mut self) {
        let _ = redis::cmd("SHUTDOWN")
            .arg("NOSAVE")
            .query::<()>(&mut self.conn());
        if let Some(mut c) = self.child.take() {
            reap_within(&mut c, Duration::from_secs(10));
        }
        self.spawn();
    }
}

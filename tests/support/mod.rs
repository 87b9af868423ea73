//! Test support: every test owns its redis-server (free loopback port, no persistence) and,
//! when it needs one, its PostgreSQL cluster (initdb in a temp dir), each stopped by PID on
//! drop, plus helpers to run the real binary and the real Ruby Sidekiq. Touches only the
//! servers it started (and a TCP proxy of its own, `proxy.rs`). One file per server or
//! concern, all re-exported here so a test file's `use support::*` sees them all; this file keeps the process basics they share (free ports,
//! signals by PID, waiting on a condition with a deadline, a finished command's output, where
//! the binary and the repository are).
// Each test file uses some of it: the rest is unused there, and its re-export too.
#![allow(dead_code, unused_imports)]

mod http;
mod jobs;
mod lines;
mod postgres;
mod proxy;
mod redis;
mod ruby;
mod sentinel;
mod sentry_listener;
mod tls;
mod worker;

pub use self::http::*;
pub use self::jobs::*;
pub use self::lines::*;
pub use self::postgres::*;
pub use self::proxy::*;
pub use self::redis::*;
pub use self::ruby::*;
pub use self::sentinel::*;
pub use self::sentry_listener::*;
pub use self::tls::*;
pub use self::worker::*;

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind a free port")
        .local_addr()
        .unwrap()
        .port()
}

/// A finished command exited 0; its stderr is the failure message otherwise.
pub fn assert_success(out: &std::process::Output) {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A finished command's stdout followed by its stderr, as text.
pub fn output_text(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

pub fn signal(pid: i32, sig: &str) {
    let _ = Command::new("kill")
        .args([format!("-{sig}"), pid.to_string()])
        .status();
}

/// Wait up to `timeout` for a child that was asked to stop to exit, SIGKILL it after that,
/// and reap it.
pub fn reap_within(c: &mut std::process::Child, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while c.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = c.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = c.wait();
}

/// Whether `pid` is a live process: its /proc entry is there and its state is not Z (a zombie
/// has exited, only its parent has not reaped it yet).
pub fn pid_alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            !s.rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        })
        .unwrap_or(false)
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

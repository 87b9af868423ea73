//! What a supervisor sees of a real worker process: systemd's notify protocol on a datagram
//! socket the test binds itself (READY=1 after the first heartbeat, WATCHDOG=1 at the interval
//! WATCHDOG_USEC asks while the liveness lease holds and none once it lapsed, STOPPING=1 at
//! TERM), and the `/ready` probe beside `/health` on --metrics-addr.
mod support;

use std::os::unix::net::UnixDatagram;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use support::*;

/// A NOTIFY_SOCKET of the test's own: a unix datagram socket in a temp dir.
struct NotifySocket {
    sock: UnixDatagram,
    path: PathBuf,
    _dir: tempfile::TempDir,
}

impl NotifySocket {
    fn bind() -> NotifySocket {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let sock = UnixDatagram::bind(&path).unwrap();
        sock.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        NotifySocket {
            sock,
            path,
            _dir: dir,
        }
    }

    /// One datagram (one sd_notify call), or None when none came within the read timeout.
    fn recv(&self) -> Option<String> {
        let mut buf = [0u8; 4096];
        let n = self.sock.recv(&mut buf).ok()?;
        Some(String::from_utf8_lossy(&buf[..n]).into_owned())
    }

    /// Every datagram up to and including the first that `done` accepts (within `timeout`).
    fn until(&self, what: &str, timeout: Duration, done: impl Fn(&str) -> bool) -> Vec<String> {
        let deadline = Instant::now() + timeout;
        let mut seen = Vec::new();
        while Instant::now() < deadline {
            if let Some(m) = self.recv() {
                let last = done(&m);
                seen.push(m);
                if last {
                    return seen;
                }
            }
        }
        panic!("no notification {what} within {timeout:?}; got {seen:?}");
    }
}

fn has(msg: &str, line: &str) -> bool {
    msg.lines().any(|l| l == line)
}

fn beat_of(redis: &RedisServer, identity: &str) -> Option<String> {
    redis::cmd("HGET")
        .arg(identity)
        .arg("beat")
        .query(&mut redis.conn())
        .unwrap()
}

fn only_process(redis: &RedisServer) -> String {
    let ids: Vec<String> = redis::cmd("SMEMBERS")
        .arg("processes")
        .query(&mut redis.conn())
        .unwrap();
    assert_eq!(ids.len(), 1, "one worker registered: {ids:?}");
    ids[0].clone()
}

/// The WATCHDOG=1 datagrams between the next two heartbeats (the `beat` field changing twice).
fn pings_between_two_beats(n: &NotifySocket, redis: &RedisServer, identity: &str) -> usize {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = beat_of(redis, identity);
    let (mut changes, mut pings) = (0, 0);
    while changes < 2 {
        assert!(Instant::now() < deadline, "no two heartbeats within 60 s");
        if let Some(m) = n.recv() {
            if changes == 1 && has(&m, "WATCHDOG=1") {
                pings += 1;
            }
        }
        let now = beat_of(redis, identity);
        if now != last {
            changes += 1;
            last = now;
        }
    }
    pings
}

#[test]
fn systemd_hears_ready_watchdog_while_live_none_once_lapsed_and_stopping() {
    let redis = RedisServer::start();
    let p = Project::with_jobs(&[("NoopJob", "noop", "#!/bin/sh\n")]);
    let n = NotifySocket::bind();
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-c", "3"])
        .env("NOTIFY_SOCKET", &n.path)
        .env("WATCHDOG_USEC", "2000000")
        .start();
    let first = n.until("READY=1", Duration::from_secs(30), |m| has(m, "READY=1"));
    assert_eq!(first.len(), 1, "READY=1 comes first: {first:?}");
    let status = format!("STATUS=running: busy 0/3, Redis {}", redis.url());
    assert!(has(&first[0], &status), "{first:?}, wanted {status}");
    // READY=1 is sent only after the first heartbeat landed: the process is registered.
    let identity = only_process(&redis);

    // WATCHDOG_USEC=2 s asks for a ping every second; beats come every 5 s. More than one
    // ping between two beats shows the pings follow WATCHDOG_USEC, not the beat.
    let pings = pings_between_two_beats(&n, &redis, &identity);
    assert!(pings >= 2, "{pings} WATCHDOG=1 between two beats");

    // Frozen Redis: no beat lands, the lease lapses, the pings stop while the status ticks on.
    redis.pause();
    let lapsed = "liveness lease lapsed: watchdog withheld";
    n.until("saying the lease lapsed", Duration::from_secs(60), |m| {
        m.contains(lapsed)
    });
    let withheld = std::cell::Cell::new(1);
    let after = n.until("three more withheld ticks", Duration::from_secs(60), |m| {
        withheld.set(withheld.get() + m.contains(lapsed) as usize);
        withheld.get() >= 4
    });
    assert!(
        after.iter().all(|m| !has(m, "WATCHDOG=1")),
        "no WATCHDOG=1 once the lease lapsed: {after:?}"
    );

    // Redis answers again: a beat lands, the lease holds again, and so do the pings.
    redis.resume();
    n.until(
        "WATCHDOG=1 after Redis is back",
        Duration::from_secs(60),
        |m| has(m, "WATCHDOG=1"),
    );

    w.signal("TERM");
    let stop = n.until("STOPPING=1", Duration::from_secs(30), |m| {
        has(m, "STOPPING=1")
    });
    assert!(
        stop.last().unwrap().contains("STATUS=stopping (TERM)"),
        "{stop:?}"
    );
    assert_eq!(
        w.wait_exit(Duration::from_secs(40)),
        Some(0),
        "{}",
        w.output()
    );
}

#[test]
fn ready_goes_503_on_tstp_while_health_stays_200() {
    let redis = RedisServer::start();
    let p = Project::with_jobs(&[("NoopJob", "noop", "#!/bin/sh\n")]);
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["--metrics-addr", &addr])
        .start();
    wait_until("/ready answers 200", Duration::from_secs(30), || {
        http_get(port, "/ready") == Some((200, "ready\n".into()))
    });
    assert_eq!(http_get(port, "/health").map(|r| r.0), Some(200));
    w.signal("TSTP");
    wait_until("/ready answers 503 quiet", Duration::from_secs(30), || {
        http_get(port, "/ready") == Some((503, "quiet\n".into()))
    });
    assert_eq!(
        http_get(port, "/health"),
        Some((200, "ok\n".into())),
        "a quiet worker is healthy, only not ready"
    );
    w.stop(Duration::from_secs(40));
}

//! Start-up errors and their exit codes, against a fake Redis: a loopback listener that speaks
//! just enough RESP to pass connection setup and PING, then either drops the connection when
//! `INFO` arrives (an unreachable Redis: exit 1) or answers `redis_version:5.0.0` (too old:
//! exit 2, named as such). Touches no keys; starts no redis-server.
mod support;

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Output};
use support::*;

#[derive(Clone, Copy)]
enum OnInfo {
    /// Close the socket instead of answering.
    Drop,
    /// Answer with this version.
    Version(&'static str),
}

/// Read one command (a RESP array of bulk strings) from the client; None at EOF.
fn read_command(r: &mut BufReader<TcpStream>) -> Option<Vec<String>> {
    let mut line = String::new();
    if r.read_line(&mut line).ok()? == 0 {
        return None;
    }
    let n: usize = line.trim_end().strip_prefix('*')?.parse().ok()?;
    let mut parts = Vec::with_capacity(n);
    for _ in 0..n {
        line.clear();
        r.read_line(&mut line).ok()?;
        let len: usize = line.trim_end().strip_prefix('$')?.parse().ok()?;
        let mut buf = vec![0u8; len + 2];
        std::io::Read::read_exact(r, &mut buf).ok()?;
        buf.truncate(len);
        parts.push(String::from_utf8_lossy(&buf).into_owned());
    }
    Some(parts)
}

fn serve(stream: TcpStream, on_info: OnInfo) {
    let mut w = stream.try_clone().unwrap();
    let mut r = BufReader::new(stream);
    while let Some(cmd) = read_command(&mut r) {
        let reply = match cmd.first().map(|c| c.to_ascii_uppercase()).as_deref() {
            Some("PING") => "+PONG\r\n".to_string(),
            Some("INFO") => match on_info {
                OnInfo::Drop => return,
                OnInfo::Version(v) => {
                    let body =
                        format!("# Server\r\nredis_version:{v}\r\nredis_mode:standalone\r\n");
                    format!("${}\r\n{body}\r\n", body.len())
                }
            },
            // CLIENT SETINFO and the like during connection setup.
            _ => "+OK\r\n".to_string(),
        };
        if w.write_all(reply.as_bytes()).is_err() {
            return;
        }
    }
}

/// Start the fake server on a free loopback port; it lives until the test process exits.
fn fake_redis(on_info: OnInfo) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for s in listener.incoming().map_while(Result::ok) {
            std::thread::spawn(move || serve(s, on_info));
        }
    });
    format!("redis://127.0.0.1:{port}/0")
}

fn playguard(sub: &str, url: &str, p: &Project) -> (Option<i32>, String) {
    let out: Output = Command::new(bin())
        .args([sub, "-r", url])
        .current_dir(p.path())
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn project() -> Project {
    Project::with_jobs(&[("OkJob", "ok", "#!/bin/sh\n")])
}

#[test]
fn connection_dropped_during_info_is_an_unreachable_redis() {
    let p = project();
    let url = fake_redis(OnInfo::Drop);
    for sub in ["run", "check"] {
        let (code, err) = playguard(sub, &url, &p);
        assert_eq!(code, Some(1), "{sub}: {err}");
        assert!(
            err.contains(&format!("cannot reach Redis at {url}")),
            "{sub}: {err}"
        );
        assert!(!err.contains("configuration error"), "{sub}: {err}");
    }
}

#[test]
fn too_old_redis_is_refused_by_name() {
    let p = project();
    let url = fake_redis(OnInfo::Version("5.0.0"));
    for sub in ["run", "check"] {
        let (code, err) = playguard(sub, &url, &p);
        assert_eq!(code, Some(2), "{sub}: {err}");
        assert!(
            err.contains(&format!(
                "Redis 5.0.0 at {url} is too old: playguard needs 6.2 or newer"
            )),
            "{sub}: {err}"
        );
        assert!(!err.contains("cannot reach"), "{sub}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{sub}: one line: {err}");
    }
}

#[test]
fn a_recent_fake_server_passes_check() {
    let p = project();
    let url = fake_redis(OnInfo::Version("7.2.4"));
    let out = Command::new(bin())
        .args(["check", "-r", &url])
        .current_dir(p.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("Redis 7.2.4 at"));
}

//! Every subcommand opens Redis the same way and maps a failure to the same exit code, as
//! docs/configuration.md promises: a Redis URL that does not parse is a configuration error (exit 2), a
//! server that does not answer is 1. Each failure is one line on stderr that names the URL.
//! Starts no server: the unreachable URL points at a loopback port nothing listens on.

use std::process::Command;

/// A loopback port nothing listens on (bound, then released).
fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// `playguard <sub> -r <url> <rest>` with no REDIS_URL or DATABASE_URL from the environment.
fn playguard(sub: &[&str], url: &str) -> std::process::Output {
    let jobs = tempfile::tempdir().unwrap();
    let manifest = "[[job]]\nclass = \"EchoJob\"\nrun = [\"/bin/true\"]\n";
    std::fs::write(jobs.path().join("echo.toml"), manifest).unwrap();
    let jobs_dir = jobs.path().to_str().unwrap();
    let mut args: Vec<&str> = sub.to_vec();
    args.extend(["-r", url]);
    if matches!(sub[0], "run" | "check") {
        args.extend(["-j", jobs_dir]);
    }
    Command::new(env!("CARGO_BIN_EXE_playguard"))
        .args(&args)
        .env_remove("REDIS_URL")
        .env_remove("DATABASE_URL")
        .env("RUST_LOG", "warn")
        .output()
        .unwrap()
}

const SUBCOMMANDS: [&[&str]; 5] = [
    &["run"],
    &["check"],
    &["enqueue", "SomeJob"],
    &["locks"],
    &["cycles"],
];

#[test]
fn a_malformed_redis_url_exits_2_under_every_subcommand() {
    for sub in SUBCOMMANDS {
        let out = playguard(sub, "redis://x:y:z");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{sub:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{sub:?}: one line: {err}");
        assert!(err.contains("Redis URL"), "{sub:?}: {err}");
    }
}

#[test]
fn an_unreachable_redis_exits_1_under_every_subcommand() {
    let url = format!("redis://127.0.0.1:{}/0", closed_port());
    for sub in SUBCOMMANDS {
        let out = playguard(sub, &url);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{sub:?}: {err}");
        assert!(err.contains("cannot reach Redis at"), "{sub:?}: {err}");
        assert!(err.contains(&url), "{sub:?}: {err}");
    }
}

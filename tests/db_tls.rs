//! TLS to PostgreSQL with libpq's sslmode, against a private cluster that speaks TLS with a
//! throwaway CA's certificate and refuses plain TCP (pg_hba.conf has only `hostssl` lines),
//! through the real binary: `run` with a `fence = "database"` reconcile job, and `check`.
//! Redis keys: `lock:tls:*` and Sidekiq's queues. Tables: `playguard_fences`,
//! `playguard_cycles`.

mod support;

use std::path::Path;
use std::process::Command;
use std::time::Duration;
use support::*;

const PATIENCE: Duration = Duration::from_secs(20);
const BOTH_NAMES: &str = "IP:127.0.0.1,DNS:localhost";

/// A project with one database-fenced reconcile job whose phase appends its fence to
/// `fences.log`.
fn project() -> Project {
    let p = Project::new();
    p.script(
        "jobs/bin/record",
        "#!/bin/sh\necho \"$PLAYGUARD_FENCE\" >> fences.log\n",
    );
    p.write(
        "jobs/app.toml",
        r#"
[[job]]
class = "TlsFenced"
lock = { key = "lock:tls:{args.0}", ttl_secs = 30, fence = "database" }
[[job.phase]]
name = "record"
run = ["jobs/bin/record"]
"#,
    );
    p
}

/// Start a worker on `url`, run one cycle of Marquee 7 and wait for its ledger row to be
/// `complete`; the worker is returned still running.
fn one_cycle(redis: &RedisServer, pg: &PostgresServer, p: &Project, url: &str) -> Worker {
    let w = Worker::builder(redis)
        .jobs(p.path())
        .args(["-c", "2", "-t", "5"])
        .env("DATABASE_URL", url)
        .start();
    enqueue(redis, &["TlsFenced", "7"]);
    let log = p.path().join("fences.log");
    wait_until("the cycle's fence line", PATIENCE, || {
        !read_or_empty(&log).trim().is_empty()
    });
    wait_until("the ledger row to be complete", PATIENCE, || {
        pg.try_psql(
            "SELECT outcome FROM playguard_cycles WHERE lock_key = 'lock:tls:7' ORDER BY id DESC LIMIT 1",
        )
        .is_ok_and(|o| o == "complete")
    });
    let fence: i64 = read_or_empty(&log).trim().parse().unwrap();
    assert_eq!(
        pg.psql("SELECT fence FROM playguard_fences WHERE lock_key = 'lock:tls:7'"),
        fence.to_string(),
        "the phase ran with the database's fence"
    );
    w
}

/// `playguard run` that must stop at start: (exit code, its stderr line(s)).
fn run_refused(redis: &RedisServer, p: &Project, url: &str) -> (Option<i32>, String) {
    let mut w = Worker::builder(redis)
        .jobs(p.path())
        .env("DATABASE_URL", url)
        .start();
    let code = w.wait_exit(PATIENCE);
    let err: Vec<String> = w
        .output()
        .lines()
        .filter(|l| l.starts_with("playguard:"))
        .map(String::from)
        .collect();
    assert_eq!(err.len(), 1, "one error line: {}", w.output());
    (code, err[0].clone())
}

/// `playguard check --database-url URL`: (exit code, stdout + stderr).
fn check(redis: &RedisServer, p: &Project, url: &str) -> (Option<i32>, String) {
    let out = Command::new(bin())
        .args(["check", "-r", &redis.url(), "--database-url", url])
        .current_dir(p.path())
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    let text = output_text(&out);
    (out.status.code(), text)
}

/// sslmode=require (Heroku's and RDS's DATABASE_URL) connects to a server that takes only TLS,
/// without a root CA to check against, and the database-fenced cycle runs; the server's own
/// pg_stat_ssl shows playguard's connections encrypted.
#[test]
fn require_connects_over_tls_and_the_cycle_runs() {
    let redis = RedisServer::start();
    let pg = PostgresServer::start_tls(BOTH_NAMES);
    let p = project();
    let url = pg
        .url_with("127.0.0.1", "sslmode=require")
        .replace("postgres@", "postgres:not-shown-anywhere@");
    let mut w = one_cycle(&redis, &pg, &p, &url);
    let (tls, plain) = pg
        .psql(
            "SELECT count(*) FILTER (WHERE s.ssl), count(*) FILTER (WHERE NOT s.ssl) \
             FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) \
             WHERE a.application_name = 'playguard'",
        )
        .split_once('|')
        .map(|(a, b)| (a.parse::<i64>().unwrap(), b.parse::<i64>().unwrap()))
        .unwrap();
    assert!(tls >= 1 && plain == 0, "tls={tls} plain={plain}");
    w.stop(PATIENCE);
    assert!(!w.output().contains("not-shown-anywhere"), "{}", w.output());
}

/// verify-full with the test CA as sslrootcert connects (the certificate names 127.0.0.1),
/// and so does verify-ca; the cycle runs.
#[test]
fn verify_full_with_the_servers_ca_connects() {
    let redis = RedisServer::start();
    let pg = PostgresServer::start_tls(BOTH_NAMES);
    let p = project();
    let ca = pg.ca_path();
    let url = pg.url_with(
        "127.0.0.1",
        &format!("sslmode=verify-full&sslrootcert={}", ca.display()),
    );
    let mut w = one_cycle(&redis, &pg, &p, &url);
    w.stop(PATIENCE);
    let url = pg.url_with(
        "127.0.0.1",
        &format!("sslmode=verify-ca&sslrootcert={}", ca.display()),
    );
    let (code, text) = check(&redis, &p, &url);
    assert_eq!(code, Some(0), "{text}");
}

/// A certificate that names only `localhost`, reached as 127.0.0.1: verify-full refuses it at
/// start with one line naming the name check; verify-ca (chain only) accepts it; a CA that did
/// not sign it is refused by both, naming the unknown issuer.
#[test]
fn verify_full_refuses_a_certificate_for_another_name_or_another_ca() {
    let redis = RedisServer::start();
    let pg = PostgresServer::start_tls("DNS:localhost");
    let p = project();
    let ca = pg.ca_path();
    let url = |mode: &str, ca: &Path| {
        pg.url_with(
            "127.0.0.1",
            &format!("sslmode={mode}&sslrootcert={}", ca.display()),
        )
        .replace("postgres@", "postgres:not-shown-anywhere@")
    };

    let (code, line) = run_refused(&redis, &p, &url("verify-full", &ca));
    assert_eq!(code, Some(1), "{line}");
    assert!(
        line.contains("TLS")
            && line.contains("not valid for name \"127.0.0.1\"")
            && line.contains("wants the host name"),
        "{line}"
    );
    assert!(!line.contains("not-shown-anywhere"), "{line}");

    let (code, text) = check(&redis, &p, &url("verify-ca", &ca));
    assert_eq!(code, Some(0), "verify-ca checks no name: {text}");

    let other = tempfile::tempdir().unwrap();
    let other_ca = make_ca(other.path(), "other");
    for mode in ["verify-ca", "verify-full"] {
        let (code, text) = check(&redis, &p, &url(mode, &other_ca));
        assert_eq!(code, Some(1), "{mode}: {text}");
        assert!(
            text.contains("not signed by the root CA of sslrootcert"),
            "{mode}: {text}"
        );
        assert!(!text.contains("not-shown-anywhere"), "{text}");
    }
}

/// sslmode=disable never tries TLS, so a hostssl-only server turns it away with its own clear
/// reason; sslmode=prefer (libpq's default) does try TLS and gets in.
#[test]
fn disable_is_refused_by_a_tls_only_server_and_prefer_tries_tls() {
    let redis = RedisServer::start();
    let pg = PostgresServer::start_tls(BOTH_NAMES);
    let p = project();
    let (code, line) = run_refused(&redis, &p, &pg.url_with("127.0.0.1", "sslmode=disable"));
    assert_eq!(code, Some(1), "{line}");
    assert!(
        line.contains("cannot reach PostgreSQL") && line.contains("no encryption"),
        "{line}"
    );
    let mut w = one_cycle(&redis, &pg, &p, &pg.url_with("127.0.0.1", "sslmode=prefer"));
    w.stop(PATIENCE);
}

/// `playguard check` with sslmode=require reaches the TLS-only server and says so.
#[test]
fn check_with_require_reports_ok() {
    let redis = RedisServer::start();
    let pg = PostgresServer::start_tls(BOTH_NAMES);
    let p = project();
    let url = pg
        .url_with("127.0.0.1", "sslmode=require")
        .replace("postgres@", "postgres:not-shown-anywhere@");
    let (code, text) = check(&redis, &p, &url);
    assert_eq!(code, Some(0), "{text}");
    assert!(
        text.contains("PostgreSQL") && text.contains("answers") && text.contains("postgres:***@"),
        "{text}"
    );
    assert!(!text.contains("not-shown-anywhere"), "{text}");
}

/// A password over TLS, as on Heroku and RDS: SCRAM-SHA-256 with channel binding to the TLS
/// session (`channel_binding=require`, so the server's certificate is bound into the
/// authentication) is accepted, and a wrong password is refused without being printed.
#[test]
fn scram_with_channel_binding_over_tls() {
    let redis = RedisServer::start();
    let mut pg = PostgresServer::start_tls(BOTH_NAMES);
    pg.psql("ALTER USER postgres PASSWORD 'tls-secret-pw'");
    pg.set_hba_and_restart("local all all trust\nhostssl all all 127.0.0.1/32 scram-sha-256\n");
    let p = project();
    let url = |pw: &str| {
        pg.url_with("127.0.0.1", "sslmode=require&channel_binding=require")
            .replace("postgres@", &format!("postgres:{pw}@"))
    };
    let (code, text) = check(&redis, &p, &url("tls-secret-pw"));
    assert_eq!(code, Some(0), "{text}");
    assert!(!text.contains("tls-secret-pw"), "{text}");
    let (code, text) = check(&redis, &p, &url("wrong-pw"));
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("password authentication failed"), "{text}");
    assert!(!text.contains("wrong-pw"), "{text}");
}

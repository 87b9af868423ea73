//! Secrets never reach output: the password of REDIS_URL (or DATABASE_URL) is in no log line,
//! no `check` or `enqueue` message and no `--help` text; a manifest job can name which
//! environment variables its commands get.
//! Each test owns its redis-server; waits are conditions with deadlines, never timings.

mod support;

use std::process::Command;
use std::time::Duration;
use support::*;

const SECRET: &str = "s3cret-Pw";

fn passworded(redis: &RedisServer) -> String {
    let mut c = redis.conn();
    let _: () = redis::cmd("CONFIG")
        .arg(&["SET", "requirepass", SECRET])
        .query(&mut c)
        .unwrap();
    format!("redis://:{SECRET}@127.0.0.1:{}/0", redis.port)
}

/// `--help` of every subcommand, `check` and `enqueue` (reachable or not) never print it.
#[test]
fn help_check_and_enqueue_never_print_the_password() {
    let unreachable = format!("redis://app:{SECRET}@127.0.0.1:{}/0", free_port());
    for sub in [&[][..], &["run"], &["check"], &["enqueue"]] {
        let out = Command::new(bin())
            .args(sub)
            .arg("--help")
            .env("REDIS_URL", &unreachable)
            .env("DATABASE_URL", format!("postgres://u:{SECRET}@db/app"))
            .output()
            .unwrap();
        let t = output_text(&out);
        assert!(out.status.success(), "{t}");
        assert!(
            !t.contains(SECRET),
            "--help of {sub:?} shows the password:\n{t}"
        );
    }
    let out = Command::new(bin())
        .args([
            "check",
            "-j",
            &project_dir().join("jobs").display().to_string(),
        ])
        .env("REDIS_URL", &unreachable)
        .env(
            "DATABASE_URL",
            format!("postgres://u:{SECRET}@127.0.0.1:{}/app", free_port()),
        )
        .output()
        .unwrap();
    let t = output_text(&out);
    assert!(
        !out.status.success() && t.contains("cannot reach PostgreSQL at postgres://u:***@"),
        "{t}"
    );
    assert!(!t.contains(SECRET), "{t}");
    let plain = Project::with_jobs(&[("PlainJob", "plain", "#!/bin/sh\ntrue\n")]);
    let out = Command::new(bin())
        .arg("check")
        .current_dir(plain.path())
        .env("REDIS_URL", &unreachable)
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    let t = output_text(&out);
    assert!(
        !out.status.success() && t.contains("cannot reach Redis at redis://app:***@"),
        "{t}"
    );
    assert!(!t.contains(SECRET), "{t}");
    let out = Command::new(bin())
        .args(["enqueue", "-r", &unreachable, "AJob"])
        .output()
        .unwrap();
    let t = output_text(&out);
    assert!(!out.status.success() && !t.contains(SECRET), "{t}");

    let redis = RedisServer::start();
    let url = passworded(&redis);
    let out = Command::new(bin())
        .args(["check", "-r", &url])
        .current_dir(plain.path())
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    let t = output_text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("ok:") && !t.contains(SECRET), "{t}");
}

/// A password typed raw with `#`, `/` or `?` in it makes a URL that does not parse: the "bad
/// Redis URL" line that names it hides the whole password, not only what comes before them.
#[test]
fn a_password_holding_url_delimiters_is_hidden_whole() {
    let plain = Project::with_jobs(&[("PlainJob", "plain", "#!/bin/sh\ntrue\n")]);
    for pw in ["s3cret#Pw", "s3cret/Pw", "s3cret?Pw", "a#s3cret/Pw?x"] {
        let url = format!("redis://app:{pw}@127.0.0.1:{}/0", free_port());
        for args in [&["check", "-r", &url][..], &["enqueue", "-r", &url, "AJob"]] {
            let out = Command::new(bin())
                .args(args)
                .current_dir(plain.path())
                .env_remove("DATABASE_URL")
                .output()
                .unwrap();
            let t = output_text(&out);
            assert!(!out.status.success(), "{t}");
            assert!(!t.contains("s3cret"), "{args:?} shows the password: {t}");
        }
    }
}

/// A worker run (start, a job, a failing job, stop) and a failed start log no password.
#[test]
fn worker_logs_never_print_the_password() {
    let redis = RedisServer::start();
    let url = passworded(&redis);
    let p = Project::with_jobs(&[
        ("OkJob", "ok", "#!/bin/sh\necho ran\n"),
        ("BadJob", "bad", "#!/bin/sh\necho boom >&2; exit 3\n"),
    ]);
    let mut w = Worker::builder_url(&url).jobs(p.path()).start();
    w.wait_for_line("playguard starting", Duration::from_secs(20));
    for class in ["OkJob", "BadJob"] {
        let out = Command::new(bin())
            .args(["enqueue", "-r", &url, class])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", output_text(&out));
    }
    w.wait_for_line("fail: retry scheduled", Duration::from_secs(20));
    w.wait_for_line("done", Duration::from_secs(20));
    w.stop(Duration::from_secs(30));
    assert!(!w.output().contains(SECRET), "{}", w.output());

    // Wrong password: a failed start names the URL, not the password.
    let wrong = format!("redis://:{SECRET}x@127.0.0.1:{}/0", redis.port);
    let mut w = Worker::builder_url(&wrong).jobs(p.path()).start();
    assert_eq!(w.wait_exit(Duration::from_secs(30)), Some(1));
    assert!(w.output().contains(":***@"), "{}", w.output());
    assert!(!w.output().contains(SECRET), "{}", w.output());
}

/// `env = [...]` on a job: its command gets only those variables (plus PLAYGUARD_*); without
/// it, the worker's whole environment, as a Procfile process has.
#[test]
fn a_job_gets_only_the_environment_it_names() {
    let redis = RedisServer::start();
    let p = Project::new();
    p.script(
        "jobs/bin/show-env",
        // Written whole, then renamed: the test reads the file as soon as it exists.
        "#!/bin/sh\nenv | sort > \"env-$PLAYGUARD_CLASS.tmp\"\nmv \"env-$PLAYGUARD_CLASS.tmp\" \"env-$PLAYGUARD_CLASS.txt\"\n",
    );
    p.write(
        "jobs/app.toml",
        r#"
[[job]]
class = "Narrow"
run = ["jobs/bin/show-env"]
env = ["HOME", "PATH", "NOT_SET_ANYWHERE"]

[[job]]
class = "Wide"
run = ["jobs/bin/show-env"]
"#,
    );
    let _w = Worker::builder(&redis)
        .jobs(p.path())
        .env("APP_API_TOKEN", "not-for-narrow-jobs")
        .env("HOME", "/home/x")
        .start();
    for class in ["Narrow", "Wide"] {
        enqueue(&redis, &[class]);
    }
    let read = |class: &str| std::fs::read_to_string(p.path().join(format!("env-{class}.txt")));
    wait_until("both jobs ran", Duration::from_secs(20), || {
        read("Narrow").is_ok() && read("Wide").is_ok()
    });
    let narrow = read("Narrow").unwrap();
    let wide = read("Wide").unwrap();
    let names = |t: &str| -> Vec<String> {
        t.lines()
            .filter_map(|l| l.split_once('=').map(|(k, _)| k.to_string()))
            .filter(|k| !k.starts_with("PLAYGUARD_"))
            .collect()
    };
    // sh itself adds PWD (and may add OLDPWD, SHLVL): those are not from the worker.
    let narrow_names: Vec<String> = names(&narrow)
        .into_iter()
        .filter(|k| !["PWD", "OLDPWD", "SHLVL", "_"].contains(&k.as_str()))
        .collect();
    assert_eq!(narrow_names, vec!["HOME", "PATH"], "{narrow}");
    assert!(
        narrow.contains("HOME=/home/x\n") && narrow.contains("PLAYGUARD_JID="),
        "{narrow}"
    );
    assert!(
        wide.contains("APP_API_TOKEN=not-for-narrow-jobs") && wide.contains("RUST_LOG="),
        "{wide}"
    );
}

//! `[[periodic]]` with `cron` and `tz`: run times as fugit (sidekiq-cron's parser) finds them,
//! DST gaps and repeats included; three processes enqueue exactly one job per cron tick; and
//! `playguard check` prints each schedule's next three run times.
mod support;

use playguard::test_support::CronSchedule;
use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;
use support::*;

/// (line, zone, from): the days around both 2026 DST changes in Paris and New York, a zone
/// without DST, and lines of every shape.
const CASES: &[(&str, &str, &str)] = &[
    ("30 2 * * *", "Europe/Paris", "2026-03-27T12:00:00Z"),
    ("30 2 * * *", "Europe/Paris", "2026-10-23T12:00:00Z"),
    ("0 * * * *", "Europe/Paris", "2026-03-28T23:30:00Z"),
    ("15,45 * * * *", "Europe/Paris", "2026-10-24T23:40:00Z"),
    ("0 3 * * *", "Europe/Paris", "2026-12-03T12:00:00Z"),
    ("59 1 * * *", "America/New_York", "2026-10-31T12:00:00Z"),
    ("30 2 * * 0", "America/New_York", "2026-03-01T12:00:00Z"),
    ("0 9 1 * 1", "Asia/Tokyo", "2026-12-01T00:00:00Z"),
    (
        "*/20 8-10 * * 1-5",
        "Australia/Sydney",
        "2026-04-03T12:00:00Z",
    ),
    ("0 0 29 2 *", "UTC", "2026-12-03T12:00:00Z"),
];

fn fugit(line: &str, tz: &str, from: &str, n: usize) -> Vec<i64> {
    let script = format!(
        "require 'fugit'; require 'time'; c = Fugit::Cron.parse({:?}); t = Time.parse({from:?}).utc; \
         {n}.times {{ t = c.next_time(t); puts t.to_i }}",
        format!("{line} {tz}")
    );
    let out = Command::new("ruby").args(["-e", &script]).output().unwrap();
    assert_success(&out);
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| l.parse().unwrap())
        .collect()
}

#[test]
fn run_times_match_fugit() {
    if !ruby_can("require 'fugit'", "ruby-fugit") {
        return;
    }
    for (line, tz, from) in CASES {
        let c = CronSchedule::parse(line, Some(tz)).unwrap();
        let start = chrono::DateTime::parse_from_rfc3339(from)
            .unwrap()
            .timestamp();
        let ours: Vec<i64> = c.upcoming(start, 4).iter().map(|t| t.timestamp()).collect();
        assert_eq!(ours, fugit(line, tz, from, 4), "{line} in {tz} from {from}");
    }
}

#[test]
fn three_processes_enqueue_one_job_per_cron_tick() {
    let redis = RedisServer::start();
    let p = Project::new();
    p.write(
        "jobs/periodic.toml",
        "[[periodic]]\nname = \"cron\"\ncron = \"*/2 * * * * *\"\ntz = \"Europe/Paris\"\n\
         class = \"CronJob\"\nqueue = \"crons\"\nargs = [7]\n",
    );
    let workers = Worker::builder(&redis).jobs(p.path()).start_many(3);
    let fingerprints = || -> BTreeMap<u64, String> {
        let mut c = redis.conn();
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("playguard:periodic:cron:*")
            .query(&mut c)
            .unwrap();
        keys.iter()
            .map(|k| {
                let owner: String = redis::cmd("GET").arg(k).query(&mut c).unwrap();
                (k.rsplit(':').next().unwrap().parse().unwrap(), owner)
            })
            .collect()
    };
    wait_until("five cron ticks", Duration::from_secs(30), || {
        fingerprints().len() >= 5
    });
    let mut workers = workers;
    for w in &mut workers {
        w.stop(Duration::from_secs(15));
    }
    let ticks = fingerprints();
    assert!(
        ticks.keys().all(|t| t % 2 == 0),
        "run times on even seconds: {ticks:?}"
    );
    let jobs = redis.lrange("queue:crons");
    assert_eq!(jobs.len(), ticks.len(), "one job per tick: {ticks:?}");
    let per_tick = workers
        .iter()
        .map(|w| w.count_lines("periodic tick"))
        .sum::<usize>();
    assert_eq!(per_tick, ticks.len(), "one process enqueued each tick");
}

#[test]
fn check_prints_the_next_three_run_times() {
    let redis = RedisServer::start();
    let p = Project::with_jobs(&[("NightlyJob", "nightly", "#!/bin/sh\n")]);
    p.write(
        "jobs/periodic.toml",
        "[[periodic]]\nname = \"nightly\"\ncron = \"0 3 * * *\"\ntz = \"Europe/Paris\"\n\
         class = \"NightlyJob\"\n",
    );
    let out = Command::new(bin())
        .args(["check", "-r", &redis.url(), "-j"])
        .arg(p.path().join("jobs"))
        .current_dir(p.path())
        .output()
        .unwrap();
    assert_success(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.starts_with("periodic \"nightly\""))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(
        line.contains("cron \"0 3 * * *\" in Europe/Paris; next "),
        "{line}"
    );
    let times: Vec<&str> = line.rsplit("next ").next().unwrap().split(", ").collect();
    assert_eq!(times.len(), 3, "{line}");
    for t in &times {
        assert!(
            t.contains("T03:00:00+01:00") || t.contains("T03:00:00+02:00"),
            "{line}"
        );
    }
    // A bad line or zone stops `check` with exit 2 naming the entry.
    p.write(
        "jobs/periodic.toml",
        "[[periodic]]\nname = \"nightly\"\ncron = \"0 3 * * *\"\ntz = \"Europe/Pariss\"\n\
         class = \"NightlyJob\"\n",
    );
    let out = Command::new(bin())
        .args(["check", "-r", &redis.url(), "-j"])
        .arg(p.path().join("jobs"))
        .current_dir(p.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("[[periodic]] #1 (name \"nightly\")") && err.contains("Europe/Pariss"),
        "{err}"
    );
}

//! The Sidekiq 7.x/8.x Metrics-tab keys (`j|…` hashes, histogram bitfields) against fixtures
//! recorded from the real ExecutionTracker of v7.3.10 and v8.0.10
//! (tests/fixtures/sidekiq_metrics/record.rb says how). Each test owns its redis-server.
mod support;

use chrono::{DateTime, Utc};
use playguard::test_support::{JobMetrics, Mode};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::time::Duration;
use support::*;

fn fixture(name: &str) -> Value {
    let p = project_dir()
        .join("tests/fixtures/sidekiq_metrics")
        .join(name);
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

/// Every key in the database as record.rb dumps it: type, TTL, hash fields or bitfield.
fn dump(redis: &RedisServer) -> BTreeMap<String, Value> {
    let mut c = redis.conn();
    let mut keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut c).unwrap();
    keys.sort();
    keys.into_iter()
        .map(|k| {
            let t: String = redis::cmd("TYPE").arg(&k).query(&mut c).unwrap();
            let ttl: i64 = redis::cmd("TTL").arg(&k).query(&mut c).unwrap();
            let value = match t.as_str() {
                "hash" => {
                    let h: BTreeMap<String, String> =
                        redis::cmd("HGETALL").arg(&k).query(&mut c).unwrap();
                    json!(h)
                }
                "string" => {
                    let mut cmd = redis::cmd("BITFIELD");
                    cmd.arg(&k);
                    for i in 0..26 {
                        cmd.arg("GET").arg("u16").arg(format!("#{i}"));
                    }
                    let u16s: Vec<i64> = cmd.query(&mut c).unwrap();
                    let raw: Vec<u8> = redis::cmd("GET").arg(&k).query(&mut c).unwrap();
                    let hex: String = raw.iter().map(|b| format!("{b:02x}")).collect();
                    json!({"u16": u16s, "hex": hex})
                }
                _ => Value::Null,
            };
            (k, json!({"type": t, "ttl": ttl, "value": value}))
        })
        .collect()
}

/// Same keys, types and values; each TTL at most the fixture's and at most 5 s below it.
fn assert_matches(
    got: &BTreeMap<String, Value>,
    want: &serde_json::Map<String, Value>,
    what: &str,
) {
    let got_keys: Vec<&String> = got.keys().collect();
    let mut want_keys: Vec<&String> = want.keys().collect();
    want_keys.sort();
    assert_eq!(got_keys, want_keys, "{what}: key names");
    for (k, w) in want {
        let g = &got[k];
        assert_eq!(g["type"], w["type"], "{what}: type of {k}");
        assert_eq!(g["value"], w["value"], "{what}: content of {k}");
        let (gt, wt) = (g["ttl"].as_i64().unwrap(), w["ttl"].as_i64().unwrap());
        assert!(
            gt <= wt && gt >= wt - 5,
            "{what}: TTL of {k} is {gt}, want {wt}"
        );
    }
}

fn run_fixture_runs(m: &JobMetrics) {
    let runs = fixture("runs.json");
    let at: DateTime<Utc> = runs["at"].as_str().unwrap().parse().unwrap();
    for r in runs["runs"].as_array().unwrap() {
        m.record_at(
            at,
            r["class"].as_str().unwrap(),
            r["failed"].as_bool().unwrap_or(false),
            r["ms"].as_u64().unwrap(),
        );
    }
}

fn flush(redis: &RedisServer, m: &JobMetrics) {
    let mut pipe = redis::pipe();
    pipe.atomic();
    m.flush_into(&mut pipe);
    pipe.query::<()>(&mut redis.conn()).unwrap();
}

#[test]
fn the_same_runs_write_exactly_what_sidekiq_7_3_and_8_0_write() {
    let v7 = fixture("v7.3.10.json");
    let v8 = fixture("v8.0.10.json");
    for (mode, want, what) in [
        (Mode::V7, v7["keys"].as_object().unwrap().clone(), "7.3.10"),
        (Mode::V8, v8["keys"].as_object().unwrap().clone(), "8.0.10"),
        (
            Mode::Both,
            v7["keys"]
                .as_object()
                .unwrap()
                .clone()
                .into_iter()
                .chain(v8["keys"].as_object().unwrap().clone())
                .collect(),
            "both (no key shared)",
        ),
    ] {
        // A fresh server of our own for each mode: nothing from the last one is left.
        let redis = RedisServer::start();
        let m = JobMetrics::new(mode);
        run_fixture_runs(&m);
        flush(&redis, &m);
        assert_matches(&dump(&redis), &want, what);
    }
    // Off writes nothing.
    let redis = RedisServer::start();
    let m = JobMetrics::new(Mode::Off);
    run_fixture_runs(&m);
    flush(&redis, &m);
    assert!(dump(&redis).is_empty());
}

/// The key names each version reads for one class in the minute of `at`, with TTLs.
fn keys_for(version: &str, class: &str, at: DateTime<Utc>) -> Vec<(String, &'static str, i64)> {
    match version {
        "7.3.10" => vec![
            (at.format("j|%Y%m%d|%-H:%-M").to_string(), "hash", 28800),
            (
                format!("{class}-{}", at.format("%d-%H:%-M")),
                "string",
                28800,
            ),
        ],
        _ => {
            let short = at.format("j|%y%m%d|%-H:%M").to_string();
            let mid = short[..short.len() - 1].to_string();
            vec![
                (short, "hash", 28800),
                (mid, "hash", 259200),
                (
                    format!("h|{class}-{}", at.format("%-d-%-H:%-M")),
                    "string",
                    28800,
                ),
            ]
        }
    }
}

#[test]
fn key_name_formats_agree_with_the_fixtures() {
    let at: DateTime<Utc> = "2025-02-04T08:03:27Z".parse().unwrap();
    for (version, file) in [("7.3.10", "v7.3.10.json"), ("8.0.10", "v8.0.10.json")] {
        let f = fixture(file);
        let keys = f["keys"].as_object().unwrap();
        for (k, t, ttl) in keys_for(version, "OkJob", at) {
            assert_eq!(keys[&k]["type"], t, "{version} {k}");
            assert_eq!(keys[&k]["ttl"], ttl, "{version} {k}");
        }
    }
}

const OK: &str = "#!/bin/sh\necho \"$PLAYGUARD_JID\" >> ran.txt\n";
const FAIL: &str = "#!/bin/sh\necho \"$PLAYGUARD_JID\" >> ran.txt\necho broke >&2\nexit 1\n";

#[test]
fn a_real_worker_writes_both_versions_keys_for_the_jobs_it_ran() {
    let redis = RedisServer::start();
    let p = Project::with_jobs(&[
        ("OkJob", "ok", OK),
        ("FailJob", "fail", FAIL),
        ("SendReportJob", "ok", OK),
    ]);
    let start = Utc::now();
    for _ in 0..3 {
        enqueue(&redis, &["OkJob", "1"]);
    }
    enqueue(&redis, &["FailJob", "--retry", "false"]);
    // An ActiveJob payload counts under `wrapped`; a class nobody runs is not counted at all.
    let aj = json!({"class": "ActiveJob::QueueAdapters::SidekiqAdapter::JobWrapper",
        "wrapped": "SendReportJob", "queue": "default", "jid": "0123456789abcdef01234567",
        "retry": false, "created_at": 1.0, "enqueued_at": 1.0,
        "args": [{"job_class": "SendReportJob", "job_id": "x", "arguments": [1]}]});
    let unknown = json!({"class": "NobodyJob", "queue": "default", "retry": false,
        "jid": "fedcba9876543210fedcba98", "args": [], "created_at": 1.0, "enqueued_at": 1.0});
    let _: () = redis::cmd("LPUSH")
        .arg("queue:default")
        .arg(aj.to_string())
        .arg(unknown.to_string())
        .query(&mut redis.conn())
        .unwrap();
    let mut w = Worker::builder(&redis).jobs(p.path()).start();
    wait_until(
        "5 runs and the unknown class failed",
        Duration::from_secs(30),
        || {
            std::fs::read_to_string(p.path().join("ran.txt"))
                .map(|s| s.lines().count() >= 5)
                .unwrap_or(false)
                && w.saw("uninitialized constant NobodyJob")
        },
    );
    w.stop(Duration::from_secs(30));
    let end = Utc::now();

    let keys = dump(&redis);
    let mut minutes = Vec::new();
    let mut t = start;
    while t <= end + chrono::Duration::seconds(60) {
        minutes.push(t);
        t += chrono::Duration::seconds(60);
    }
    for version in ["7.3.10", "8.0.10"] {
        let mut seen_hist: BTreeMap<&str, i64> = BTreeMap::new();
        let mut fields: BTreeMap<String, i64> = BTreeMap::new();
        let mut rollup: BTreeMap<String, i64> = BTreeMap::new();
        let mut checked = std::collections::BTreeSet::new();
        for at in &minutes {
            for class in ["OkJob", "FailJob", "SendReportJob", "NobodyJob"] {
                for (k, t, ttl) in keys_for(version, class, *at) {
                    let Some(v) = keys.get(&k) else { continue };
                    if !checked.insert(k.clone()) {
                        continue;
                    }
                    assert_eq!(v["type"], t, "{version} {k}");
                    let got = v["ttl"].as_i64().unwrap();
                    assert!(got <= ttl && got > ttl - 60, "{version} {k}: TTL {got}");
                    match t {
                        "hash" => {
                            let sum = if ttl == 259200 {
                                &mut rollup
                            } else {
                                &mut fields
                            };
                            for (f, n) in v["value"].as_object().unwrap() {
                                *sum.entry(f.clone()).or_default() +=
                                    n.as_str().unwrap().parse::<i64>().unwrap();
                            }
                        }
                        _ => {
                            let u16s = v["value"]["u16"].as_array().unwrap();
                            assert_eq!(u16s.len(), 26);
                            // 2 bytes per bucket, up to the last bucket written.
                            assert!(v["value"]["hex"].as_str().unwrap().len() <= 26 * 4);
                            *seen_hist.entry(class).or_default() +=
                                u16s.iter().map(|n| n.as_i64().unwrap()).sum::<i64>();
                        }
                    }
                }
            }
        }
        let get = |m: &BTreeMap<String, i64>, f: &str| m.get(f).copied();
        for m in std::iter::once(&fields).chain((version == "8.0.10").then_some(&rollup)) {
            assert_eq!(get(m, "OkJob|p"), Some(3), "{version}: {m:?}");
            assert!(get(m, "OkJob|ms").is_some(), "{version}: {m:?}");
            assert_eq!(get(m, "OkJob|f"), None, "{version}: {m:?}");
            assert_eq!(get(m, "FailJob|p"), Some(1), "{version}: {m:?}");
            assert_eq!(get(m, "FailJob|f"), Some(1), "{version}: {m:?}");
            assert_eq!(
                get(m, "FailJob|ms"),
                None,
                "{version}: failed runs add no time"
            );
            assert_eq!(get(m, "SendReportJob|p"), Some(1), "{version}: {m:?}");
            assert!(
                !m.keys().any(|f| f.starts_with("NobodyJob|")),
                "{version}: an unknown class is not counted: {m:?}"
            );
        }
        assert_eq!(seen_hist.get("OkJob"), Some(&3), "{version} histogram");
        assert_eq!(
            seen_hist.get("SendReportJob"),
            Some(&1),
            "{version} histogram"
        );
        assert_eq!(
            seen_hist.get("FailJob"),
            None,
            "{version}: no histogram of failures"
        );
    }
}

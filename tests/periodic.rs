//! Periodic dispatch with real processes: three workers race for every tick and exactly one
//! enqueues it; the jobs land in a queue no worker processes (`marquees`), so they can be
//! counted afterwards, grouped by the tick their `created_at` falls in. Each test owns its
//! redis-server.
mod support;

use playguard::test_support::tick_of;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use support::*;

const SET: &str = MARQUEE_SET;
const EVERY: u64 = 2;

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

fn project(extra: &str) -> Project {
    dispatch_project(EVERY, extra)
}

/// Every payload in `queue:<q>`, oldest first.
fn queued(redis: &RedisServer, q: &str) -> Vec<Value> {
    let raw: Vec<String> = redis::cmd("LRANGE")
        .arg(format!("queue:{q}"))
        .arg(0)
        .arg(-1)
        .query(&mut redis.conn())
        .unwrap();
    raw.iter()
        .rev()
        .map(|s| serde_json::from_str(s).expect("payload is JSON"))
        .collect()
}

/// tick -> owner identity, from the fingerprint keys.
fn fingerprints(redis: &RedisServer, name: &str) -> BTreeMap<u64, String> {
    let mut c = redis.conn();
    let prefix = format!("playguard:periodic:{name}:");
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}*"))
        .query(&mut c)
        .unwrap();
    keys.iter()
        .map(|k| {
            let owner: String = redis::cmd("GET").arg(k).query(&mut c).unwrap();
            let ttl: i64 = redis::cmd("TTL").arg(k).query(&mut c).unwrap();
            assert!(ttl > 0, "{k} has a TTL ({ttl})");
            (k[prefix.len()..].parse().unwrap(), owner)
        })
        .collect()
}

fn has_fingerprint(redis: &RedisServer, name: &str, tick: u64) -> bool {
    let n: i64 = redis::cmd("EXISTS")
        .arg(format!("playguard:periodic:{name}:{tick}"))
        .query(&mut redis.conn())
        .unwrap();
    n == 1
}

fn set_of(items: &[&str]) -> BTreeSet<String> {
    items
        .iter()
        .map(|m| serde_json::to_string(&playguard::test_support::member_arg(m)).unwrap())
        .collect()
}

/// Three processes, one of them alone for the second half, the set changed mid-run: every tick
/// from the first to the last one a process was surely up for has exactly one job per member,
/// one fingerprint and one log line counting them.
#[test]
fn three_processes_enqueue_each_member_once_per_tick() {
    let redis = RedisServer::start();
    let p = project("");
    let old = ["11", "12", "13", "14", "marquee-15"];
    let new = ["12", "13", "14", "marquee-15", "16"];
    let mut c = redis.conn();
    let _: () = redis::cmd("SADD").arg(SET).arg(&old).query(&mut c).unwrap();

    let mut workers = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-q", "default"])
        .start_many(3);
    wait_until(
        "three processes registered",
        Duration::from_secs(20),
        || {
            let n: i64 = redis::cmd("SCARD").arg("processes").query(&mut c).unwrap();
            n == 3
        },
    );
    let first = tick_of(now(), EVERY);
    wait_until(
        "the tick after all three registered was dispatched",
        Duration::from_secs(10),
        || has_fingerprint(&redis, "dispatch", first + 1),
    );
    wait_until("two more ticks", Duration::from_secs(10), || {
        has_fingerprint(&redis, "dispatch", first + 3)
    });

    // Stop two of three: one cleanly, one with SIGKILL.
    workers[0].signal("TERM");
    assert_eq!(workers[0].wait_exit(Duration::from_secs(15)), Some(0));
    let killed_from = tick_of(now(), EVERY);
    workers[1].kill9();
    let killed_to = tick_of(now(), EVERY);
    let alone_from = tick_of(now(), EVERY) + 1;

    // Change the set atomically; ticks strictly after `changed_at` must see the new set.
    let before_change = tick_of(now(), EVERY);
    let _: () = redis::pipe()
        .atomic()
        .cmd("SREM")
        .arg(SET)
        .arg("11")
        .ignore()
        .cmd("SADD")
        .arg(SET)
        .arg("16")
        .ignore()
        .query(&mut c)
        .unwrap();
    let changed_at = tick_of(now(), EVERY);
    wait_until(
        "two ticks dispatched by the survivor after the change",
        Duration::from_secs(10),
        || has_fingerprint(&redis, "dispatch", changed_at.max(alone_from) + 2),
    );
    let last_up = tick_of(now(), EVERY);
    workers[2].signal("TERM");
    assert_eq!(workers[2].wait_exit(Duration::from_secs(15)), Some(0));

    // Group the jobs by the tick their created_at falls in.
    let jobs = queued(&redis, "marquees");
    let mut by_tick: BTreeMap<u64, Vec<String>> = BTreeMap::new();
    let mut jids = HashSet::new();
    for j in &jobs {
        assert_eq!(j["class"], "PlayguardJob", "{j}");
        assert_eq!(j["queue"], "marquees", "{j}");
        assert_eq!(j["retry"], true, "{j}");
        assert_eq!(j["created_at"], j["enqueued_at"], "{j}");
        let jid = j["jid"].as_str().unwrap();
        assert!(
            jid.len() == 24 && jid.chars().all(|c| c.is_ascii_hexdigit()),
            "{jid}"
        );
        assert!(jids.insert(jid.to_string()), "duplicate jid {jid}");
        let args = j["args"].as_array().unwrap();
        assert_eq!(args.len(), 1, "{j}");
        let created = j["created_at"].as_f64().unwrap();
        by_tick
            .entry(tick_of(created, EVERY))
            .or_default()
            .push(serde_json::to_string(&args[0]).unwrap());
    }
    // Numeric members stayed numbers.
    assert!(jobs.iter().any(|j| j["args"][0] == 12), "{jobs:?}");
    assert!(jobs.iter().any(|j| j["args"][0] == "marquee-15"));

    let owners = fingerprints(&redis, "dispatch");
    assert_eq!(
        by_tick.keys().collect::<Vec<_>>(),
        owners.keys().collect::<Vec<_>>(),
        "every claimed tick has jobs and every job's tick was claimed"
    );
    // A process was surely running its loop from the tick after all three registered until
    // the tick before the last one was stopped.
    for t in first + 1..last_up {
        assert!(by_tick.contains_key(&t), "tick {t} is missing: {by_tick:?}");
    }
    let (old, new) = (set_of(&old), set_of(&new));
    for (t, members) in &by_tick {
        let got: BTreeSet<String> = members.iter().cloned().collect();
        assert_eq!(
            got.len(),
            members.len(),
            "tick {t}: a member enqueued twice: {members:?}"
        );
        if *t < before_change {
            assert_eq!(got, old, "tick {t} (before the change)");
        } else if *t > changed_at {
            assert_eq!(got, new, "tick {t} (after the change)");
        } else {
            assert!(got == old || got == new, "tick {t}: {got:?}");
        }
    }
    // The survivor owned every tick once it was alone, and they were complete.
    let survivor: HashSet<&String> = owners.range(alone_from..).map(|(_, o)| o).collect();
    assert_eq!(survivor.len(), 1, "{owners:?}");
    assert!(
        by_tick.range(alone_from..).count() >= 2,
        "the survivor dispatched at least two ticks alone: {by_tick:?}"
    );

    // One log line per tick, across all processes, with the count enqueued. SIGKILL may land
    // between a dispatch and its log line, so only the tick of the kill may lack one. The
    // lines of stopped processes may still be on their way through the pipes: wait for them.
    let logs_ok = || {
        let mut logged: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
        for w in &workers {
            for (t, n) in w.periodic_ticks("dispatch") {
                logged.entry(t).or_default().push(n);
            }
        }
        let ok = logged.keys().all(|t| by_tick.contains_key(t))
            && by_tick.iter().all(|(t, members)| match logged.get(t) {
                Some(v) => v == &vec![members.len()],
                None => (killed_from..=killed_to).contains(t),
            });
        (ok, logged)
    };
    wait_until(
        "one log line per tick with its count",
        Duration::from_secs(5),
        || logs_ok().0,
    );
    let (_, logged) = logs_ok();
    assert!(
        logged.len() + 1 >= by_tick.len(),
        "{logged:?} vs {by_tick:?}"
    );
}

/// Ruby's Sidekiq::Queue reads what the dispatcher enqueued, for a fan-out entry and for one
/// with fixed args and a retry count.
#[test]
fn ruby_reads_the_dispatched_jobs() {
    if !ruby_available() {
        return;
    }
    let redis = RedisServer::start();
    let p = project(
        r#"
[[periodic]]
name = "fixed"
every_secs = 2
class = "Nightly::ReportJob"
queue = "reports"
args = [1, "x", { deep = [true, 2.5] }]
retry = 3
"#,
    );
    let members = ["7", "marquee-x", r#"{"id":3}"#];
    let mut c = redis.conn();
    let _: () = redis::cmd("SADD")
        .arg(SET)
        .arg(&members)
        .query(&mut c)
        .unwrap();
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-q", "default"])
        .start();
    wait_until(
        "both entries dispatched once",
        Duration::from_secs(20),
        || !queued(&redis, "marquees").is_empty() && !queued(&redis, "reports").is_empty(),
    );
    w.stop(Duration::from_secs(15));

    let out = ruby(
        &redis,
        r#"
out = {}
%w[marquees reports].each do |q|
  out[q] = Sidekiq::Queue.new(q).map do |j|
    {"class" => j.klass, "display_class" => j.display_class, "args" => j.args, "jid" => j.jid,
     "enqueued_at" => j.enqueued_at.to_f, "created_at" => j.created_at.to_f,
     "queue" => j.queue, "retry" => j["retry"]}
  end
end
out["queues"] = Sidekiq::Queue.all.map(&:name).sort
out["latency"] = Sidekiq::Queue.new("marquees").latency.is_a?(Float)
puts JSON.generate(out)
"#,
    );
    let v: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["queues"], serde_json::json!(["marquees", "reports"]));
    assert_eq!(v["latency"], true);
    for q in ["marquees", "reports"] {
        let raw = queued(&redis, q);
        let read = v[q].as_array().unwrap();
        assert_eq!(read.len(), raw.len(), "{q}");
        // Sidekiq::Queue iterates newest first.
        for (r, j) in read.iter().zip(raw.iter().rev()) {
            assert_eq!(r["jid"], j["jid"]);
            assert_eq!(r["class"], j["class"]);
            assert_eq!(r["display_class"], j["class"]);
            assert_eq!(r["args"], j["args"]);
            assert_eq!(r["queue"], q);
            let at = |k: &str| r[k].as_f64().unwrap() - j[k].as_f64().unwrap();
            assert!(at("enqueued_at").abs() < 1e-3, "{r} vs {j}");
            assert!(at("created_at").abs() < 1e-3, "{r} vs {j}");
        }
    }
    let marquees = v["marquees"].as_array().unwrap();
    let first_tick = &marquees[marquees.len() - 3..];
    let mut args: Vec<String> = first_tick.iter().map(|r| r["args"].to_string()).collect();
    args.sort();
    assert_eq!(args, vec![r#"["marquee-x"]"#, "[7]", r#"[{"id":3}]"#]);
    assert!(marquees
        .iter()
        .all(|r| r["class"] == "PlayguardJob" && r["retry"] == true));
    let reports = v["reports"].as_array().unwrap();
    assert!(reports.iter().all(|r| {
        r["class"] == "Nightly::ReportJob"
            && r["retry"] == 3
            && r["args"] == serde_json::json!([1, "x", {"deep": [true, 2.5]}])
    }));
}

/// Redis stops answering for longer than the response timeout: attempts fail and are retried,
/// commands the server runs late land atomically or not at all, so every claimed tick still has
/// exactly its jobs, and dispatch resumes once Redis answers again.
#[test]
fn a_redis_outage_neither_loses_nor_doubles_a_claimed_tick() {
    let redis = RedisServer::start();
    let p = project("");
    let members = ["1", "2", "3"];
    let mut c = redis.conn();
    let _: () = redis::cmd("SADD")
        .arg(SET)
        .arg(&members)
        .query(&mut c)
        .unwrap();
    let mut workers = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-q", "default"])
        .start_many(2);
    // Both started before the outage: one still connecting when Redis pauses fails its start.
    for w in &workers {
        w.wait_for_line("playguard starting", Duration::from_secs(20));
    }
    wait_until("a first tick dispatched", Duration::from_secs(20), || {
        !fingerprints(&redis, "dispatch").is_empty()
    });
    // Longer than one tick plus the 5 s response timeout, so an attempt surely times out.
    redis.pause();
    let paused_at = now();
    wait_until("8 s of outage", Duration::from_secs(10), || {
        now() >= paused_at + 8.0
    });
    redis.resume();
    let resumed = tick_of(now(), EVERY);
    wait_until(
        "two ticks dispatched after the outage",
        Duration::from_secs(20),
        || has_fingerprint(&redis, "dispatch", resumed + 2),
    );
    assert!(
        workers.iter().any(|w| w.saw("periodic tick failed")),
        "an attempt failed during the outage"
    );
    for w in &mut workers {
        w.stop(Duration::from_secs(20));
    }

    let mut by_tick: BTreeMap<u64, Vec<String>> = BTreeMap::new();
    for j in queued(&redis, "marquees") {
        by_tick
            .entry(tick_of(j["created_at"].as_f64().unwrap(), EVERY))
            .or_default()
            .push(j["args"][0].to_string());
    }
    let owners = fingerprints(&redis, "dispatch");
    assert_eq!(
        by_tick.keys().collect::<Vec<_>>(),
        owners.keys().collect::<Vec<_>>(),
        "every claimed tick has jobs"
    );
    for (t, got) in &by_tick {
        let mut got = got.clone();
        got.sort();
        assert_eq!(got, vec!["1", "2", "3"], "tick {t}");
    }
    for t in resumed + 1..=resumed + 2 {
        assert!(by_tick.contains_key(&t), "tick {t} after the outage");
    }
}

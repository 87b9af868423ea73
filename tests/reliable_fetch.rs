//! Reliable fetch with the real binary (issue 7): SIGKILL loses no job, a job that keeps killing
//! its worker ends in `dead` as a poison pill, SIGTERM hands the running job back exactly once,
//! Ruby Sidekiq 6.4.1 and playguard share a queue, and `--fetch basic` stays plain BRPOP.
//! Each test owns its redis-server; waits are conditions with deadlines, never timings.
mod support;

use rand::Rng;
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use support::*;

/// A Sidekiq-shaped payload as the Ruby client writes it.
fn payload(class: &str, args: Value) -> (String, String) {
    let bytes: [u8; 12] = rand::random();
    let jid: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let p = json!({"retry": true, "queue": "default", "class": class, "args": args,
        "jid": jid, "created_at": now, "enqueued_at": now});
    (jid, p.to_string())
}

/// LPUSH jobs onto queue:default, as `push_bulk` does; returns (jid, payload) in push order.
fn push(redis: &RedisServer, class: &str, n: usize) -> Vec<(String, String)> {
    let jobs: Vec<(String, String)> = (0..n).map(|i| payload(class, json!([i]))).collect();
    let raws: Vec<&String> = jobs.iter().map(|(_, p)| p).collect();
    push_to_default(redis, raws);
    jobs
}

#[test]
fn sigkill_three_times_loses_no_job() {
    let redis = RedisServer::start();
    let p = Project::new();
    // Recorded when the job finishes, so a run cut short by the kill does not count as a run.
    p.script(
        "jobs/bin/work",
        "#!/bin/sh\nsleep 0.02\necho \"$PLAYGUARD_JID\" >> ledger.txt\n",
    );
    p.write(
        "jobs/app.toml",
        "[[job]]\nclass = \"WorkJob\"\nrun = [\"jobs/bin/work\"]\n",
    );
    let jobs = push(&redis, "WorkJob", 300);
    let all: HashSet<String> = jobs.iter().map(|(j, _)| j.clone()).collect();
    let done = |p: &Project| -> HashSet<String> { p.lines("ledger.txt").into_iter().collect() };

    let mut rng = rand::rng();
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-c", "5"])
        .start();
    // Kill at random points of progress, each a little later than the last.
    for round in 0..3 {
        let target = rng.random_range(round * 60 + 10..round * 60 + 70);
        wait_until(
            &format!("{target} jobs finished before kill {}", round + 1),
            Duration::from_secs(60),
            || p.lines("ledger.txt").len() >= target,
        );
        // Land anywhere inside a job, not just on a boundary.
        std::thread::sleep(Duration::from_millis(rng.random_range(0..25)));
        let in_flight = redis.working_jobs().len();
        w.kill9();
        eprintln!(
            "kill {}: after {} finished runs, {in_flight} job(s) in working lists",
            round + 1,
            p.lines("ledger.txt").len()
        );
        w = Worker::builder(&redis)
            .jobs(p.path())
            .args(["-c", "5"])
            .start();
    }
    wait_until(
        "every jid ran at least once",
        Duration::from_secs(90),
        || done(&p).is_superset(&all),
    );
    wait_until(
        "queue and working lists empty",
        Duration::from_secs(30),
        || redis.llen("queue:default") == 0 && redis.working_jobs().is_empty(),
    );
    let runs = p.lines("ledger.txt");
    let mut counts: HashMap<&str, usize> = HashMap::new();
    for j in &runs {
        *counts.entry(j.as_str()).or_default() += 1;
    }
    let dups: Vec<(&&str, &usize)> = counts.iter().filter(|(_, n)| **n > 1).collect();
    eprintln!(
        "300 jobs, 3 SIGKILLs: {} runs, {} distinct jids, {} jid(s) ran more than once ({} extra runs)",
        runs.len(),
        counts.len(),
        dups.len(),
        runs.len() - counts.len()
    );
    assert!(counts.keys().all(|j| all.contains(*j)), "only our jids ran");
    w.stop(Duration::from_secs(30));
}

#[test]
fn job_that_kills_its_worker_ends_dead_as_poison_pill() {
    let redis = RedisServer::start();
    let p = Project::new();
    // A command's parent is playguard's command guardian and the worker is one level up: only
    // kill that process when it really is playguard.
    p.script(
        "jobs/bin/killer",
        "#!/bin/sh\nw=$(cut -d' ' -f4 /proc/$PPID/stat)\necho \"$w\" >> ppids.txt\n\
         if [ \"$(cat /proc/$w/comm)\" = playguard ]; then kill -9 \"$w\"; fi\nsleep 30\n",
    );
    p.write(
        "jobs/app.toml",
        "[[job]]\nclass = \"KillerJob\"\nrun = [\"jobs/bin/killer\"]\n",
    );
    let jobs = push(&redis, "KillerJob", 1);
    let jid = jobs[0].0.clone();
    let mut started: Vec<i32> = Vec::new();
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-c", "2"])
        .start();
    started.push(w.pid());
    let dead = |redis: &RedisServer| -> Vec<String> {
        redis::cmd("ZRANGE")
            .arg("dead")
            .arg(0)
            .arg(-1)
            .query(&mut redis.conn())
            .unwrap()
    };
    wait_until(
        "the job is in the dead set",
        Duration::from_secs(90),
        || {
            if let Ok(Some(status)) = w.child.try_wait() {
                assert!(
                    status.code().is_none(),
                    "worker exited by itself: {status}\n{}",
                    w.output()
                );
                w = Worker::builder(&redis)
                    .jobs(p.path())
                    .args(["-c", "2"])
                    .start();
                started.push(w.pid());
            }
            !dead(&redis).is_empty()
        },
    );
    let ppids: Vec<i32> = p
        .lines("ppids.txt")
        .iter()
        .map(|l| l.parse().unwrap())
        .collect();
    assert_eq!(ppids.len(), 3, "the job ran three times: {ppids:?}");
    assert_eq!(
        ppids,
        started[..3],
        "each run was a child of the worker it killed"
    );
    let d = dead(&redis);
    assert_eq!(d.len(), 1);
    let entry: Value = serde_json::from_str(&d[0]).unwrap();
    assert_eq!(entry["jid"], jid.as_str());
    assert_eq!(entry["error_class"], "Playguard::PoisonPill");
    let msg = entry["error_message"].as_str().unwrap();
    assert!(msg.contains("recovered 3 times"), "{msg}");
    eprintln!("dead entry: {msg}");
    assert_eq!(redis.llen("queue:default"), 0);
    assert_eq!(redis.working_jobs().len(), 0);
    w.stop(Duration::from_secs(30));
}

#[test]
fn sigterm_puts_the_running_job_back_once() {
    let redis = RedisServer::start();
    let p = Project::new();
    p.script(
        "jobs/bin/slow",
        "#!/bin/sh\necho started >> started.txt\nexec sleep 60\n",
    );
    p.write(
        "jobs/app.toml",
        "[[job]]\nclass = \"SlowJob\"\nrun = [\"jobs/bin/slow\"]\n",
    );
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-c", "3", "-t", "1"])
        .start();
    let jobs = push(&redis, "SlowJob", 1);
    wait_until("the job started", Duration::from_secs(30), || {
        !p.lines("started.txt").is_empty()
    });
    assert_eq!(redis.working_jobs().len(), 1, "held in the working list");
    w.stop(Duration::from_secs(30));
    let queued = redis.lrange("queue:default");
    // Byte for byte but for the shutdown count (job/interrupted.rs) at the end.
    let counted = format!(
        "{},\"interrupted_count\":1}}",
        jobs[0].1.strip_suffix('}').unwrap()
    );
    assert_eq!(queued, vec![counted], "back once");
    assert_eq!(redis.working_jobs().len(), 0, "working list empty");
}

/// A Ruby Sidekiq 6.4.1 process started from the CLI, stopped on drop.
struct RubySidekiq(Child);

impl Drop for RubySidekiq {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn ruby_sidekiq_and_playguard_share_a_queue() {
    if !ruby_available() {
        return;
    }
    let redis = RedisServer::start();
    let p = Project::new();
    p.write(
        "ruby_job.rb",
        "require 'sidekiq'\nclass MixedJob\n  include Sidekiq::Worker\n  def perform(_i)\n    \
         sleep 0.02\n    File.open(ENV.fetch('LEDGER'), 'a') { |f| f.puts(\"ruby #{jid}\") }\n  \
         end\nend\n",
    );
    p.script(
        "jobs/bin/mixed",
        "#!/bin/sh\nsleep 0.02\necho \"pg $PLAYGUARD_JID\" >> pg.txt\n",
    );
    p.write(
        "jobs/app.toml",
        "[[job]]\nclass = \"MixedJob\"\nrun = [\"jobs/bin/mixed\"]\n",
    );
    let mut ruby_proc = RubySidekiq(
        Command::new("sidekiq")
            .args(["-r", "./ruby_job.rb", "-c", "5", "-q", "default"])
            .current_dir(p.path())
            .env("REDIS_URL", redis.url())
            .env("LEDGER", p.path().join("ruby.txt"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the sidekiq CLI"),
    );
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-c", "5"])
        .start();
    // Both are fetching once both are registered (the Ruby heartbeat runs after boot).
    wait_until("both processes registered", Duration::from_secs(60), || {
        redis::cmd("SCARD")
            .arg("processes")
            .query::<usize>(&mut redis.conn())
            .unwrap()
            >= 2
    });
    let sent = ruby(
        &redis,
        "puts Sidekiq::Client.push_bulk('class' => 'MixedJob', 'args' => (1..400).map { |i| [i] }).join(' ')",
    );
    let sent: HashSet<String> = sent.split_whitespace().map(str::to_string).collect();
    assert_eq!(sent.len(), 400);
    let runs = |p: &Project| -> Vec<(String, String)> {
        let mut v = Vec::new();
        for f in ["ruby.txt", "pg.txt"] {
            for l in p.lines(f) {
                let (who, jid) = l.split_once(' ').unwrap();
                v.push((who.to_string(), jid.to_string()));
            }
        }
        v
    };
    wait_until("all 400 jobs ran", Duration::from_secs(90), || {
        runs(&p).len() >= 400
    });
    wait_until(
        "queue and working lists empty",
        Duration::from_secs(30),
        || redis.llen("queue:default") == 0 && redis.working_jobs().is_empty(),
    );
    let all = runs(&p);
    let by_ruby = all.iter().filter(|(w, _)| w == "ruby").count();
    eprintln!(
        "mixed fleet: ruby ran {by_ruby}, playguard ran {}",
        all.len() - by_ruby
    );
    let jids: HashSet<&String> = all.iter().map(|(_, j)| j).collect();
    assert_eq!(all.len(), 400, "no job ran twice");
    assert_eq!(jids.len(), 400);
    assert!(jids.iter().all(|j| sent.contains(*j)));
    assert!(by_ruby > 0 && by_ruby < 400, "both processes took work");
    w.stop(Duration::from_secs(30));
    signal(ruby_proc.0.id() as i32, "TERM");
    wait_until("ruby sidekiq exited", Duration::from_secs(40), || {
        ruby_proc.0.try_wait().unwrap().is_some()
    });
}

#[test]
fn basic_fetch_is_plain_brpop() {
    let redis = RedisServer::start();
    let p = Project::new();
    p.script(
        "jobs/bin/rec",
        "#!/bin/sh\necho \"$PLAYGUARD_JID\" >> ledger.txt\n",
    );
    p.write(
        "jobs/app.toml",
        "[[job]]\nclass = \"RecJob\"\nrun = [\"jobs/bin/rec\"]\n",
    );
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query(&mut redis.conn())
        .unwrap();
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-c", "3", "--fetch", "basic"])
        .start();
    // Idle first, so it waits in BRPOP (busy queues are popped in batches with RPOP <count>).
    wait_until(
        "the idle worker waits in BRPOP",
        Duration::from_secs(20),
        || {
            redis::cmd("CLIENT")
                .arg("LIST")
                .query::<String>(&mut redis.conn())
                .unwrap()
                .contains("cmd=brpop")
        },
    );
    push(&redis, "RecJob", 20);
    wait_until("20 jobs ran", Duration::from_secs(30), || {
        p.lines("ledger.txt").len() >= 20
    });
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut redis.conn())
        .unwrap();
    assert!(stats.contains("cmdstat_brpop:"), "{stats}");
    assert!(!stats.contains("cmdstat_blmove:"), "{stats}");
    assert!(!stats.contains("cmdstat_lrem:"), "no acks: {stats}");
    assert_eq!(redis.working_jobs().len(), 0);
    w.stop(Duration::from_secs(30));
    assert_eq!(p.lines("ledger.txt").len(), 20);
}

fn calls(redis: &RedisServer, cmd: &str) -> u64 {
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut redis.conn())
        .unwrap();
    stats
        .lines()
        .find_map(|l| l.strip_prefix(&format!("cmdstat_{cmd}:calls=")))
        .map_or(0, |rest| rest.split(',').next().unwrap().parse().unwrap())
}

fn working(c: &mut redis::Connection, key: &str) -> Vec<String> {
    redis::cmd("LRANGE")
        .arg(key)
        .arg(0)
        .arg(-1)
        .query(c)
        .unwrap()
}

/// lua/fetch.lua moves a batch with one LPUSH per queue, oldest job rightmost (the order the
/// orphan sweep relies on), in queue order.
#[test]
fn fetch_script_moves_a_batch_with_one_lpush_per_queue() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let fetch = redis::Script::new(include_str!("../lua/fetch.lua"));
    // LPUSH as the client does: a0 is the oldest of queue:a.
    for (q, jobs) in [("a", vec!["a0", "a1", "a2"]), ("b", vec!["b0", "b1"])] {
        for j in jobs {
            let _: () = redis::cmd("LPUSH")
                .arg(format!("queue:{q}"))
                .arg(j)
                .query(&mut c)
                .unwrap();
        }
    }
    // The process's alive key (the script fetches nothing for a process without one).
    let _: () = redis::cmd("SET").arg("alive").arg(1).query(&mut c).unwrap();
    let before = calls(&redis, "lpush");
    let got: Vec<redis::Value> = fetch
        .key("queue:a")
        .key("queue:b")
        .key("w:a")
        .key("w:b")
        .key("alive")
        .arg(4)
        .invoke(&mut c)
        .unwrap();
    // Per queue: its position in KEYS and its jobs, oldest first.
    let got: Vec<(i64, Vec<String>)> = got
        .chunks(2)
        .map(|p| {
            (
                redis::from_redis_value_ref(&p[0]).unwrap(),
                redis::from_redis_value_ref(&p[1]).unwrap(),
            )
        })
        .collect();
    let want: Vec<(i64, Vec<String>)> = vec![
        (1, vec!["a0".into(), "a1".into(), "a2".into()]),
        (2, vec!["b0".into()]),
    ];
    assert_eq!(got, want);
    assert_eq!(calls(&redis, "lpush") - before, 2, "one LPUSH per queue");
    assert_eq!(working(&mut c, "w:a"), ["a2", "a1", "a0"]);
    assert_eq!(working(&mut c, "w:b"), ["b0"]);
}

/// Appends its job's queue to `ledger.txt`.
const RECORD_QUEUE: &str = "#!/bin/sh\necho \"$PLAYGUARD_QUEUE\" >> ledger.txt\n";

/// LPUSH `n` RecJob payloads for queue `q` onto `queue:<q>` in one call.
fn push_rec_jobs(redis: &RedisServer, q: &str, n: usize) {
    let raws: Vec<String> = (0..n)
        .map(|i| {
            let (_, p) = payload("RecJob", json!([i]));
            p.replace("\"queue\":\"default\"", &format!("\"queue\":\"{q}\""))
        })
        .collect();
    let _: () = redis::cmd("LPUSH")
        .arg(format!("queue:{q}"))
        .arg(raws)
        .query(&mut redis.conn())
        .unwrap();
}

/// Basic fetch pops batches with RPOP <count> while the queues are busy, in strict queue order:
/// queue `b` is touched only once `a` is empty.
#[test]
fn basic_fetch_pops_batches_in_strict_order() {
    let redis = RedisServer::start();
    let p = Project::with_jobs(&[("RecJob", "rec", RECORD_QUEUE)]);
    for q in ["b", "a"] {
        push_rec_jobs(&redis, q, 30);
    }
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-c", "3", "--fetch", "basic", "-q", "a", "-q", "b"])
        .start();
    wait_until("60 jobs ran", Duration::from_secs(60), || {
        p.lines("ledger.txt").len() >= 60
    });
    let ledger = p.lines("ledger.txt");
    // Slots start jobs as they free up, so only the last batch of `a` may finish among `b`'s.
    assert!(ledger[..27].iter().all(|q| q == "a"), "{ledger:?}");
    assert_eq!(ledger.iter().filter(|q| *q == "b").count(), 30);
    assert!(calls(&redis, "rpop") > 0, "batched pops");
    w.stop(Duration::from_secs(30));
}

/// Reliable fetch looks at its queues a few at a time (so a batch the first queues can fill does
/// not pay for every queue's keys): the order stays strict across those calls, and a queue past
/// the first call's reach is still served.
#[test]
fn reliable_fetch_keeps_strict_order_over_many_queues() {
    let redis = RedisServer::start();
    let p = Project::with_jobs(&[("RecJob", "rec", RECORD_QUEUE)]);
    for q in ["q11", "q1"] {
        push_rec_jobs(&redis, q, 20);
    }
    let mut args = vec!["-c".to_string(), "3".to_string()];
    for i in 0..12 {
        args.push("-q".into());
        args.push(format!("q{i}"));
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut w = Worker::builder(&redis).jobs(p.path()).args(&args).start();
    wait_until("40 jobs ran", Duration::from_secs(60), || {
        p.lines("ledger.txt").len() >= 40
    });
    let ledger = p.lines("ledger.txt");
    assert!(ledger[..17].iter().all(|q| q == "q1"), "{ledger:?}");
    assert_eq!(ledger.iter().filter(|q| *q == "q11").count(), 20);
    wait_until("every job acked", Duration::from_secs(30), || {
        redis.working_jobs().is_empty()
    });
    w.stop(Duration::from_secs(30));
}

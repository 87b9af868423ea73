//! Periodic fan-out over a member set larger than one batch, with real processes: each member
//! gets exactly one job per tick, no Redis command the tick sends is slow (the test's own
//! server logs every command over 20 ms in SLOWLOG; a batch takes about 1 ms), and a tick whose owner dies, or is told to
//! stop, mid-tick is finished by a peer from the recorded progress, or by a process started
//! after it. The jobs land in a queue no
//! worker processes (`marquees`). Each test owns its redis-server.
mod support;

use playguard::test_support::{member_arg, tick_of};
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;
use support::*;

const SET: &str = MARQUEE_SET;

fn project(every: u64) -> Project {
    dispatch_project(every, "")
}

/// Numbers and strings alike, so the set is a hash table SSCAN walks in many steps.
fn fill_set(redis: &RedisServer, n: usize) -> Vec<String> {
    let members: Vec<String> = (0..n)
        .map(|i| {
            if i % 2 == 0 {
                i.to_string()
            } else {
                format!("marquee-{i}")
            }
        })
        .collect();
    let mut c = redis.conn();
    for chunk in members.chunks(1000) {
        let _: () = redis::cmd("SADD")
            .arg(SET)
            .arg(chunk)
            .query(&mut c)
            .unwrap();
    }
    members
}

/// tick -> (member as JSON -> jobs), from every payload in `queue:marquees`.
fn jobs_by_tick(redis: &RedisServer, every: u64) -> BTreeMap<u64, HashMap<String, usize>> {
    let mut by_tick: BTreeMap<u64, HashMap<String, usize>> = BTreeMap::new();
    for raw in redis.lrange("queue:marquees") {
        let j: Value = serde_json::from_str(&raw).expect("payload is JSON");
        assert_eq!(j["class"], "PlayguardJob", "{j}");
        let args = j["args"].as_array().expect("args");
        assert_eq!(args.len(), 1, "{j}");
        let tick = tick_of(j["created_at"].as_f64().unwrap(), every);
        *by_tick
            .entry(tick)
            .or_default()
            .entry(args[0].to_string())
            .or_default() += 1;
    }
    by_tick
}

/// Every member exactly once.
fn assert_each_member_once(tick: u64, got: &HashMap<String, usize>, members: &[String]) {
    let twice: Vec<_> = got.iter().filter(|(_, n)| **n > 1).take(5).collect();
    assert!(
        twice.is_empty(),
        "tick {tick}: members enqueued twice: {twice:?}"
    );
    let missing: Vec<_> = members
        .iter()
        .map(|m| member_arg(m).to_string())
        .filter(|m| !got.contains_key(m))
        .take(5)
        .collect();
    assert!(
        missing.is_empty(),
        "tick {tick}: members missing: {missing:?}"
    );
    assert_eq!(
        got.len(),
        members.len(),
        "tick {tick}: jobs for non-members"
    );
}

/// SLOWLOG's entries as (duration in µs, command line).
fn slowlog(redis: &RedisServer) -> Vec<(i64, String)> {
    let entries: Vec<redis::Value> = redis::cmd("SLOWLOG")
        .arg("GET")
        .arg(1000)
        .query(&mut redis.conn())
        .unwrap();
    entries
        .iter()
        .map(|e| {
            let redis::Value::Array(f) = e else {
                panic!("slowlog entry {e:?}")
            };
            let us: i64 = redis::from_redis_value(f[2].clone()).unwrap();
            let argv: Vec<Vec<u8>> = redis::from_redis_value(f[3].clone()).unwrap();
            let line: Vec<String> = argv
                .iter()
                .take(3)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            (us, line.join(" "))
        })
        .collect()
}

/// Three processes race for every tick of a 100,000-member set: each finished tick has exactly
/// one job per member, and no command took 20 ms (before the fan-out went in steps, the tick's
/// one SMEMBERS took 28 ms here and its one script 80 to 230 ms).
#[test]
fn a_tick_larger_than_a_batch_pushes_each_member_once_in_short_steps() {
    let every = 4;
    let redis = RedisServer::start_with(&["--slowlog-log-slower-than", "20000"]);
    let members = fill_set(&redis, 100_000);
    let _: () = redis::cmd("SLOWLOG")
        .arg("RESET")
        .query(&mut redis.conn())
        .unwrap();
    let p = project(every);
    let mut workers = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-q", "default"])
        .start_many(3);
    wait_until("two ticks finished", Duration::from_secs(60), || {
        workers
            .iter()
            .map(|w| w.periodic_ticks("dispatch").len())
            .sum::<usize>()
            >= 2
    });
    for w in &mut workers {
        w.stop(Duration::from_secs(20));
    }
    let slow = slowlog(&redis);
    assert!(slow.is_empty(), "commands over 20 ms: {slow:?}");

    let by_tick = jobs_by_tick(&redis, every);
    let mut finished = Vec::new();
    for w in &workers {
        finished.extend(w.periodic_ticks("dispatch"));
    }
    finished.sort();
    let ticks: Vec<u64> = finished.iter().map(|(t, _)| *t).collect();
    let mut unique = ticks.clone();
    unique.dedup();
    assert_eq!(ticks, unique, "one finishing line per tick: {finished:?}");
    for (t, n) in &finished {
        assert_eq!(*n, members.len(), "tick {t}'s line counts every member");
        assert_each_member_once(*t, &by_tick[t], &members);
    }
}

/// The identity ("host:pid:nonce") of the process pushing the tick under way, once it has
/// pushed a few batches and has not finished: (tick, owner).
fn tick_under_way(redis: &RedisServer) -> Option<(u64, String)> {
    let mut c = redis.conn();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("playguard:periodic-progress:dispatch:*")
        .query(&mut c)
        .unwrap();
    keys.iter().find_map(|k| {
        let (owner, step, done): (String, u64, u64) = redis::cmd("HMGET")
            .arg(k)
            .arg(&["owner", "step", "done"])
            .query(&mut c)
            .ok()?;
        let tick = k.rsplit(':').next()?.parse().ok()?;
        (step >= 3 && done == 0).then_some((tick, owner))
    })
}

fn tick_done(redis: &RedisServer, tick: u64) -> bool {
    let done: Option<u64> = redis::cmd("HGET")
        .arg(format!("playguard:periodic-progress:dispatch:{tick}"))
        .arg("done")
        .query(&mut redis.conn())
        .unwrap();
    done == Some(1)
}

/// The owner of a tick stops mid-tick (`stop` does it: SIGKILL, or TERM); a peer finishes the
/// tick from the recorded progress and every member gets exactly one job. A `late` peer is
/// started only once the owner has stopped (a deploy that replaces the only process).
fn peer_finishes_the_tick(stop: impl Fn(&mut Worker), late: bool) -> Vec<Worker> {
    // One tick per hour: the test sees one tick (or two, across an hour's boundary).
    let every = 3600;
    let redis = RedisServer::start();
    let members = fill_set(&redis, 25_000);
    let p = project(every);
    // Small batches: 500 steps for 25,000 members, long enough to interrupt.
    let fleet = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-q", "default"])
        .env("PLAYGUARD_PERIODIC_BATCH", "50");
    let mut workers = fleet.clone().start_many(if late { 1 } else { 2 });
    let mut under_way = None;
    wait_until("a tick under way", Duration::from_secs(30), || {
        under_way = tick_under_way(&redis);
        under_way.is_some()
    });
    let (tick, owner) = under_way.unwrap();
    let pid: i32 = owner.split(':').nth(1).unwrap().parse().unwrap();
    let at = workers
        .iter()
        .position(|w| w.pid() == pid)
        .expect("owner is ours");
    stop(&mut workers[at]);
    // The owner stopped before the tick's end: a killed owner's tick is not done now (its
    // lease still holds); a stopped one says it left the tick.
    assert!(
        workers[at].saw("left to a peer at quiet") || !tick_done(&redis, tick),
        "the owner stopped before the tick's end"
    );
    if late {
        workers.push(fleet.start());
    }
    wait_until("a peer finished the tick", Duration::from_secs(30), || {
        tick_done(&redis, tick)
    });
    let peer = workers.iter().find(|w| w.pid() != pid).expect("a peer");
    wait_until("the peer's finishing line", Duration::from_secs(5), || {
        peer.periodic_ticks("dispatch")
            .contains(&(tick, members.len()))
    });
    assert!(peer.saw("took_over=true"), "{}", peer.output());
    let by_tick = jobs_by_tick(&redis, every);
    assert_each_member_once(tick, &by_tick[&tick], &members);
    workers
}

#[test]
fn a_peer_finishes_the_tick_of_an_owner_killed_mid_tick() {
    peer_finishes_the_tick(|w| w.kill9(), false);
}

/// The only process is killed mid-tick and a new one starts: it finds the tick claimed,
/// waits out the dead owner's lease and pushes the rest, each member once.
#[test]
fn a_process_started_after_the_owner_was_killed_finishes_its_tick() {
    peer_finishes_the_tick(|w| w.kill9(), true);
}

/// A deploy: the only process is stopped mid-tick (it leaves the tick with its lease lapsed)
/// and its replacement, started after it exited, finishes the tick, each member once.
#[test]
fn a_process_started_after_the_owner_stopped_finishes_its_tick() {
    peer_finishes_the_tick(|w| w.stop(Duration::from_secs(20)), true);
}

/// TERM mid-tick: the owner stops between two batches and hands the rest over at once (its
/// lease lapsed on purpose), so shutting down never waits for a long tick.
#[test]
fn a_peer_finishes_the_tick_of_an_owner_stopped_mid_tick() {
    let workers = peer_finishes_the_tick(|w| w.stop(Duration::from_secs(20)), false);
    assert!(
        workers.iter().any(|w| w.saw("left to a peer at quiet")),
        "the stopped owner said it left the tick"
    );
}

//! The heartbeat, as Sidekiq's launcher.rb `❤`: every beat one MULTI writes `processes`,
//! the `<identity>` hash (info, busy, beat, quiet, rss, rtt_us, concurrency; TTL 60), the work
//! hash under `<identity>:workers` (read by Sidekiq <= 6.4.1) and `<identity>:work` (6.4.2+),
//! the `stat:processed`/`stat:failed` deltas and their dated keys, our liveness key
//! `playguard:alive:<identity>` and the `playguard:fetchers` registry, and pops one remote
//! signal from `<identity>-signals`. `clear` undoes the process entries at a clean stop.

use crate::runtime::Runtime;
use serde_json::json;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// TTL of the identity and work hashes (launcher.rb).
pub const PROCESS_TTL_SECS: i64 = 60;
/// Dated stat keys live five years (`5*365*24*60*60`).
pub const STAT_TTL_SECS: i64 = 157_680_000;
/// Our own liveness key's TTL: the orphan sweep treats a process as dead once it lapses.
pub const ALIVE_TTL_SECS: i64 = 15;

pub fn alive_key(identity: &str) -> String {
    format!("playguard:alive:{identity}")
}

pub const FETCHERS_KEY: &str = "playguard:fetchers";

/// A fresh identity: hostname:pid:nonce, the nonce new at every start (SecureRandom.hex(6)).
pub fn new_identity() -> String {
    let nonce: [u8; 6] = rand::random();
    let nonce: String = nonce.iter().map(|b| format!("{b:02x}")).collect();
    format!("{}:{}:{}", hostname(), std::process::id(), nonce)
}

pub fn hostname() -> String {
    hostname::get()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "localhost".into())
}

/// The `info` JSON, written once per process as Sidekiq does.
pub fn info_json(rt: &Runtime, started_at: f64) -> String {
    let cfg = &rt.config;
    let weights: serde_json::Map<String, serde_json::Value> = cfg
        .queues
        .queues
        .iter()
        .map(|(q, w)| (q.clone(), json!(w)))
        .collect();
    json!({
        "hostname": hostname(),
        "started_at": started_at,
        "pid": std::process::id(),
        "tag": cfg.tag.clone().unwrap_or_default(),
        "concurrency": cfg.concurrency,
        "queues": cfg.queues.names(),
        "weights": [weights],
        "labels": cfg.labels,
        "identity": rt.identity,
        "version": format!("playguard {}", env!("CARGO_PKG_VERSION")),
        "embedded": false,
    })
    .to_string()
}

/// Resident set size in KB, from /proc (Sidekiq reads `ps` for the same number).
fn rss_kb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|n| n.parse().ok()))
        })
        .unwrap_or(0)
}

/// One beat. Returns the remote signal popped, if any.
pub async fn beat(rt: &Runtime, info: &str) -> redis::RedisResult<Option<String>> {
    let mut conn = rt.conn.clone();
    let t = Instant::now();
    redis::cmd("PING").query_async::<()>(&mut conn).await?;
    let rtt_us = t.elapsed().as_micros() as u64;

    let id = &rt.identity;
    let snapshot = rt.work.snapshot();
    let busy = snapshot.len();
    rt.metrics.busy.store(busy as i64, Ordering::Relaxed);
    let (processed, failed) = rt.work.take_counts();
    let today = chrono::Utc::now().format("%Y-%m-%d").to_string();

    let mut pipe = redis::pipe();
    pipe.atomic();
    for (name, n) in [("processed", processed), ("failed", failed)] {
        if n > 0 {
            pipe.incr(format!("stat:{name}"), n).ignore();
            pipe.incr(format!("stat:{name}:{today}"), n).ignore();
            pipe.expire(format!("stat:{name}:{today}"), STAT_TTL_SECS)
                .ignore();
        }
    }
    let work_keys = [format!("{id}:workers"), format!("{id}:work")];
    for key in &work_keys {
        pipe.cmd("UNLINK").arg(key).ignore();
        for (tid, e) in &snapshot {
            let mut entry = json!({"queue": e.queue, "payload": &*e.payload, "run_at": e.run_at});
            if let Some(p) = &e.phase {
                entry["phase"] = json!(p);
            }
            pipe.hset(key, tid, entry.to_string()).ignore();
        }
        pipe.expire(key, PROCESS_TTL_SECS).ignore();
    }
    pipe.sadd("processes", id).ignore();
    pipe.hset_multiple(
        id,
        &[
            ("info", info.to_string()),
            ("busy", busy.to_string()),
            ("beat", crate::payload::now_f64().to_string()),
            ("quiet", rt.shutdown.is_quiet().to_string()),
            ("rss", rss_kb().to_string()),
            ("rtt_us", rtt_us.to_string()),
            ("concurrency", rt.config.concurrency.to_string()),
        ],
    )
    .ignore();
    pipe.expire(id, PROCESS_TTL_SECS).ignore();
    if rt.reliable() {
        pipe.set_ex(alive_key(id), 1, ALIVE_TTL_SECS as u64)
            .ignore();
        pipe.hset(
            FETCHERS_KEY,
            id,
            json!(rt.config.queues.names()).to_string(),
        )
        .ignore();
    }
    pipe.rpop(format!("{id}-signals"), None);
    match pipe.query_async::<(Option<String>,)>(&mut conn).await {
        Ok((signal,)) => {
            rt.metrics
                .last_redis_ok_ms
                .store(chrono::Utc::now().timestamp_millis(), Ordering::Relaxed);
            Ok(signal)
        }
        Err(e) => {
            rt.work.restore_counts(processed, failed);
            Err(e)
        }
    }
}

/// Clean stop: leave `processes` and drop the work hashes at once (the identity hash expires by
/// itself, as in Sidekiq), flush the last counters.
pub async fn clear(rt: &Runtime) -> redis::RedisResult<()> {
    let id = &rt.identity;
    let (processed, failed) = rt.work.take_counts();
    let today = chrono::Utc::now().format("%Y-%m-%d").to_string();
    let mut pipe = redis::pipe();
    pipe.atomic();
    for (name, n) in [("processed", processed), ("failed", failed)] {
        if n > 0 {
            pipe.incr(format!("stat:{name}"), n).ignore();
            pipe.incr(format!("stat:{name}:{today}"), n).ignore();
            pipe.expire(format!("stat:{name}:{today}"), STAT_TTL_SECS)
                .ignore();
        }
    }
    pipe.srem("processes", id).ignore();
    pipe.cmd("UNLINK")
        .arg(format!("{id}:workers"))
        .arg(format!("{id}:work"))
        .arg(alive_key(id))
        .ignore();
    // The `playguard:fetchers` entry stays: the orphan sweep sees us dead (no alive key),
    // returns anything left in our working lists, and only then removes the entry.
    let mut conn = rt.conn.clone();
    let r = pipe.query_async::<()>(&mut conn).await;
    if r.is_err() {
        rt.work.restore_counts(processed, failed);
    }
    r
}

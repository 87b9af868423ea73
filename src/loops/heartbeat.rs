//! The heartbeat, as Sidekiq's launcher.rb `❤`: every beat first refreshes our liveness key
//! `playguard:alive:<identity>` on its own (`SET .. GET`, or `EXPIRE` while Redis refuses
//! writes for want of memory), learning whether it had vanished; then one MULTI writes
//! `processes`, the `<identity>` hash (info, busy, beat, quiet, rss, rtt_us, concurrency; TTL
//! 60), the work hash under `<identity>:workers` (read by Sidekiq <= 6.4.1) and
//! `<identity>:work` (6.4.2+), the `stat:processed`/`stat:failed` deltas and their dated keys,
//! the `playguard:fetchers` registry, and pops one remote signal from `<identity>-signals`.
//! Then the read-only checks: each queue's head and type (`queue_heads.rs`, `queue:<q>`) and
//! the eviction policy (`eviction.rs`). `clear` undoes the process entries at a clean stop.
//! The loop itself is `run`; `beat_once` says what a beat means for the liveness lease (the
//! first landed beat after a lapse releases our recorded locks, through `sweeper.rs`); a
//! remote signal a beat pops goes back to the launcher (`launcher/signals.rs`).

use crate::process::identity::{hostname, pid_namespace};
use crate::process::liveness::{alive_key, ALIVE_TTL_SECS, FETCHERS_KEY};
use crate::worker::Worker;
use serde_json::json;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

/// TTL of the identity and work hashes (launcher.rb).
pub const PROCESS_TTL_SECS: i64 = 60;
/// Dated stat keys live five years (`5*365*24*60*60`).
pub const STAT_TTL_SECS: i64 = 157_680_000;

/// The `info` JSON, written once per process as Sidekiq does.
pub fn info_json(worker: &Worker, started_at: f64) -> String {
    let cfg = &worker.config;
    let weights: serde_json::Map<String, serde_json::Value> = cfg
        .queues
        .configured()
        .iter()
        .map(|(q, w)| (q.clone(), json!(w)))
        .collect();
    json!({
        "hostname": hostname(),
        "started_at": started_at,
        "pid": std::process::id(),
        "tag": cfg.tag.clone().unwrap_or_default(),
        "concurrency": cfg.concurrency,
        "capsules": super::capsules::capsules(cfg),
        "queues": cfg.queues.names(),
        "weights": [weights],
        "labels": cfg.labels,
        "identity": worker.identity,
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

/// One work-hash value: `{queue, payload, run_at}` as launcher.rb writes it, the payload the
/// original job string (so readers parse it a second time, exactly as for Ruby-run jobs), plus
/// `phase` for phased jobs. 6.4.1's busy.erb ignores extra keys; the API hands them through.
pub fn work_entry_json(e: &crate::process::slots::SlotEntry) -> String {
    let mut entry = json!({"queue": &*e.queue, "payload": &*e.payload, "run_at": e.run_at});
    if let Some(p) = &e.phase {
        entry["phase"] = json!(p);
    }
    entry.to_string()
}

/// What a beat did to our liveness lease (reliable fetch only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lease {
    /// No lease kept (basic fetch).
    NotKept,
    /// The alive key was refreshed; `existed`: it was still there before (false on a first
    /// beat, or after it vanished: evicted, flushed, a failover to a replica that lacked it).
    Refreshed { existed: bool },
    /// The key was gone and could not be written again (Redis refuses writes: OOM).
    Missing,
}

/// What one beat brought back.
pub struct Beat {
    pub lease: Lease,
    /// The remote signal popped, if any.
    pub signal: Option<String>,
}

/// One beat: the lease first, on its own (it must land even when Redis refuses the Sidekiq
/// writes for want of memory), then one MULTI of the Sidekiq writes, then the read-only checks
/// (queue heads, eviction policy), whose failures never fail the beat.
pub async fn beat(worker: &Worker, info: &str) -> redis::RedisResult<Beat> {
    let mut conn = worker.conn.clone();
    let rtt_us = ping_rtt_us(&mut conn).await?;
    let lease = if worker.liveness.is_kept() {
        refresh_lease(&mut conn, &worker.identity).await?
    } else {
        Lease::NotKept
    };
    let signal = process_writes(worker, &mut conn, info, rtt_us).await?;
    worker
        .metrics
        .last_redis_ok_ms
        .store(chrono::Utc::now().timestamp_millis(), Ordering::Relaxed);
    super::queue_heads::read(worker, &mut conn).await;
    super::eviction::check(worker, &mut conn).await;
    Ok(Beat { lease, signal })
}

/// Refresh `playguard:alive:<identity>` and learn whether it still existed: `SET .. GET`, or,
/// when Redis refuses it for want of memory (SET is denyoom), `EXPIRE`, which it accepts and
/// which keeps an existing key alive just as well.
async fn refresh_lease(
    conn: &mut crate::connections::redis_conn::Conn,
    id: &str,
) -> redis::RedisResult<Lease> {
    let key = alive_key(id);
    let set = redis::cmd("SET")
        .arg(&key)
        .arg(1)
        .arg("EX")
        .arg(ALIVE_TTL_SECS)
        .arg("GET")
        .query_async::<Option<Vec<u8>>>(conn)
        .await;
    match set {
        Ok(old) => Ok(Lease::Refreshed {
            existed: old.is_some(),
        }),
        Err(e) if is_oom(&e) => {
            let n: i64 = redis::cmd("EXPIRE")
                .arg(&key)
                .arg(ALIVE_TTL_SECS)
                .query_async(conn)
                .await?;
            Ok(if n == 1 {
                Lease::Refreshed { existed: true }
            } else {
                Lease::Missing
            })
        }
        Err(e) => Err(e),
    }
}

/// Whether Redis refused a write for want of memory (maxmemory reached, noeviction), also as
/// the reason a MULTI was discarded.
pub fn is_oom(e: &redis::RedisError) -> bool {
    // A discarded MULTI reports each queued command's error inside its own text.
    let text = e.to_string();
    e.code() == Some("OOM") || text.contains("\"OOM\"") || text.contains("OOM command not allowed")
}

/// The Sidekiq process entries, the counters and our fetchers entry, in one MULTI, and the
/// remote signal popped with them. Under OOM Redis refuses the MULTI: the counters are kept
/// for the next beat, the state is marked (fetch pauses, `/health` says why) and the beat
/// still counts, its lease having landed on its own.
async fn process_writes(
    worker: &Worker,
    conn: &mut crate::connections::redis_conn::Conn,
    info: &str,
    rtt_us: u64,
) -> redis::RedisResult<Option<String>> {
    let snapshot = worker.slots.snapshot();
    let (processed, failed) = worker.slots.take_counts();
    let mut pipe = redis::pipe();
    pipe.atomic();
    add_stat_deltas(&mut pipe, processed, failed);
    worker.job_metrics.flush_into(&mut pipe);
    add_work_hashes(&mut pipe, &worker.identity, &snapshot);
    add_process_hash(&mut pipe, worker, info, snapshot.len(), rtt_us);
    if worker.liveness.is_kept() {
        add_fetchers_entry(&mut pipe, worker);
    }
    pipe.rpop(format!("{}-signals", worker.identity), None);
    // Bytes: a signal that is not UTF-8 must not fail the whole beat.
    let r = pipe.query_async::<Vec<Option<Vec<u8>>>>(conn).await;
    let oom = matches!(&r, Err(e) if is_oom(e));
    if worker.metrics.redis.set_oom(oom) {
        if oom {
            tracing::error!("Redis is out of memory (maxmemory reached, writes refused): fetching paused; running jobs go on, their outcomes are retried until they land");
        } else {
            tracing::warn!("Redis accepts writes again: fetching resumes");
        }
    }
    match r {
        Ok(mut replies) => Ok(replies
            .pop()
            .flatten()
            .map(|s| String::from_utf8_lossy(&s).into_owned())),
        Err(e) => {
            worker.slots.restore_counts(processed, failed);
            if oom {
                Ok(None)
            } else {
                Err(e)
            }
        }
    }
}

/// PING Redis: the round trip in microseconds, published as `rtt_us`.
async fn ping_rtt_us(conn: &mut crate::connections::redis_conn::Conn) -> redis::RedisResult<u64> {
    let t = Instant::now();
    redis::cmd("PING").query_async::<()>(conn).await?;
    Ok(t.elapsed().as_micros() as u64)
}

/// Rewrite both work hashes (`<identity>:workers` and `<identity>:work`) from the running
/// jobs, with their TTL.
fn add_work_hashes(
    pipe: &mut redis::Pipeline,
    id: &str,
    snapshot: &[(String, crate::process::slots::SlotEntry)],
) {
    let work_keys = [format!("{id}:workers"), format!("{id}:work")];
    for key in &work_keys {
        pipe.cmd("UNLINK").arg(key).ignore();
        for (tid, e) in snapshot {
            pipe.hset(key, tid, work_entry_json(e)).ignore();
        }
        pipe.expire(key, PROCESS_TTL_SECS).ignore();
    }
}

/// Join `processes` and write the `<identity>` hash (info, busy, beat, quiet, rss, rtt_us,
/// concurrency), with its TTL.
fn add_process_hash(
    pipe: &mut redis::Pipeline,
    worker: &Worker,
    info: &str,
    busy: usize,
    rtt_us: u64,
) {
    let id = &worker.identity;
    pipe.sadd("processes", id).ignore();
    pipe.hset_multiple(
        id,
        &[
            ("info", info.to_string()),
            ("busy", busy.to_string()),
            ("beat", crate::job::payload::now_f64().to_string()),
            ("quiet", worker.shutdown.is_quiet().to_string()),
            ("rss", rss_kb().to_string()),
            ("rtt_us", rtt_us.to_string()),
            ("concurrency", worker.config.concurrency.to_string()),
        ],
    )
    .ignore();
    pipe.expire(id, PROCESS_TTL_SECS).ignore();
}

/// Our `playguard:fetchers` entry (reliable fetch only).
fn add_fetchers_entry(pipe: &mut redis::Pipeline, worker: &Worker) {
    // The queues tell a sweeper which working lists are ours; `ns` says which kernel and
    // pid namespace our pid lives in, so only a process that shares both may judge us
    // dead by our pid (same hostname is not enough across containers).
    pipe.hset(
        FETCHERS_KEY,
        &worker.identity,
        json!({"queues": worker.config.queues.names(), "ns": pid_namespace()}).to_string(),
    )
    .ignore();
}

/// INCRBY the lifetime and dated counters (dated keys kept 5 years), as Sidekiq 7 does:
/// only when there is something to add.
fn add_stat_deltas(pipe: &mut redis::Pipeline, processed: u64, failed: u64) {
    let today = chrono::Utc::now().format("%Y-%m-%d").to_string();
    for (name, n) in [("processed", processed), ("failed", failed)] {
        if n > 0 {
            pipe.incr(format!("stat:{name}"), n).ignore();
            pipe.incr(format!("stat:{name}:{today}"), n).ignore();
            pipe.expire(format!("stat:{name}:{today}"), STAT_TTL_SECS)
                .ignore();
        }
    }
}

/// Clean stop: leave `processes` and drop the work hashes at once (the identity hash expires by
/// itself, as in Sidekiq), our lock record (every cycle has released by now), flush the last
/// counters.
pub async fn clear(worker: &Worker) -> redis::RedisResult<()> {
    let id = &worker.identity;
    let (processed, failed) = worker.slots.take_counts();
    let mut pipe = redis::pipe();
    pipe.atomic();
    add_stat_deltas(&mut pipe, processed, failed);
    worker.job_metrics.flush_into(&mut pipe);
    pipe.srem("processes", id).ignore();
    pipe.cmd("UNLINK")
        .arg(format!("{id}:workers"))
        .arg(format!("{id}:work"))
        .arg(alive_key(id))
        .arg(crate::cycle::lock::locks_record_key(id))
        .ignore();
    // The `playguard:fetchers` entry stays: the orphan sweep sees us dead (no alive key),
    // returns anything left in our working lists, and only then removes the entry.
    let mut conn = worker.conn.clone();
    let r = pipe.query_async::<()>(&mut conn).await;
    if r.is_err() {
        worker.slots.restore_counts(processed, failed);
    }
    r
}

/// One beat, and what it means for the liveness lease: a landed beat extends it; the first
/// one after a lapse treats our past as dead (see `regained`).
pub async fn beat_once(worker: &Worker, info: &str) -> redis::RedisResult<Option<String>> {
    let sent_at = tokio::time::Instant::now();
    let beat = beat(worker, info).await?;
    let existed = match beat.lease {
        Lease::NotKept => return Ok(beat.signal),
        Lease::Refreshed { existed } => existed,
        Lease::Missing => false,
    };
    // Our alive key vanished since the last beat (evicted, flushed, a failover to a replica
    // that lacked it): another process may already have recovered our jobs, so this is a
    // lapse now, and the jobs a lapse stops are stopped. It lasts until the next beat, as a
    // lapse found by its deadline does: nothing is fetched meanwhile, so the stopped jobs go
    // back (by LREM of their bytes) before a copy of one can be fetched into the same list.
    if !existed && worker.liveness.vanished() {
        tracing::warn!(key = %crate::process::liveness::alive_key(&worker.identity),
            "liveness lease lapsed: our alive key had vanished from Redis (evicted, flushed, or a failover to a replica that lacked it); stopping our running jobs");
        return Ok(beat.signal);
    }
    if beat.lease == Lease::Missing {
        return Ok(beat.signal);
    }
    // Still lapsed (nothing is fetched): release first, so no lock taken after the
    // refresh can be among those released.
    if !worker.liveness.is_live() {
        regained(worker).await;
    }
    worker.liveness.refreshed(sent_at);
    worker.fetch.retry_deferred_requeues().await;
    Ok(beat.signal)
}

/// Liveness is back after a lapse. Every job that ran then has been stopped (or is stopping),
/// and the sweep may have judged us dead meanwhile: release the locks we recorded, as the
/// sweep would, so a job handed back is not skipped as "already locked" by our own lease.
async fn regained(worker: &Worker) {
    tracing::warn!("liveness lease regained after a lapse; releasing the locks recorded before it");
    if let Err(e) = super::sweeper::release_locks_of(worker, &worker.identity, true).await {
        tracing::warn!(error = %e, "could not release our recorded locks; they expire by their ttl");
    }
}

/// The heartbeat loop: a beat every `beat_interval`; a remote signal a beat popped goes to
/// `on_signal` (the launcher applies it).
pub async fn run(worker: Arc<Worker>, info: String, on_signal: fn(&Worker, &str)) {
    loop {
        match beat_once(&worker, &info).await {
            Ok(Some(sig)) => on_signal(&worker, &sig),
            Ok(None) => {}
            Err(e) => tracing::warn!(error = %e, "heartbeat: Redis error"),
        }
        tokio::time::sleep(worker.config.beat_interval).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn work_entry_keeps_the_payload_string_and_adds_the_phase() {
        let raw = r#"{"class":"X","args":[1.50,2e3],"jid":"abc"}"#;
        let mut e = crate::process::slots::SlotEntry {
            queue: "default".into(),
            payload: std::sync::Arc::from(raw),
            run_at: 1796095478,
            jid: "abc".into(),
            class: "X".into(),
            phase: None,
            started: std::time::Instant::now(),
        };
        let v: serde_json::Value = serde_json::from_str(&work_entry_json(&e)).unwrap();
        assert_eq!(v["payload"].as_str(), Some(raw));
        assert_eq!(v["run_at"].as_i64(), Some(1796095478));
        assert_eq!(v["queue"], "default");
        assert!(v.get("phase").is_none());
        e.phase = Some("apply".into());
        let v: serde_json::Value = serde_json::from_str(&work_entry_json(&e)).unwrap();
        assert_eq!(v["phase"], "apply");
    }
}

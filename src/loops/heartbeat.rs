//! The heartbeat, as Sidekiq's launcher.rb `❤`: every beat one MULTI writes `processes`,
//! the `<identity>` hash (info, busy, beat, quiet, rss, rtt_us, concurrency; TTL 60), the work
//! hash under `<identity>:workers` (read by Sidekiq <= 6.4.1) and `<identity>:work` (6.4.2+),
//! the `stat:processed`/`stat:failed` deltas and their dated keys, our liveness key
//! `playguard:alive:<identity>` and the `playguard:fetchers` registry, and pops one remote
//! signal from `<identity>-signals`. It also reads the oldest job of each of our queues
//! (`LINDEX queue:<q> -1`, read only) for the queue-latency gauge. `clear` undoes the process
//! entries at a clean stop.

use crate::process::identity::{hostname, pid_namespace};
use crate::process::liveness::{alive_key, ALIVE_TTL_SECS, FETCHERS_KEY};
use crate::worker::Worker;
use serde_json::json;
use std::sync::atomic::Ordering;
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

/// `enqueued_at` of a queued job in epoch seconds. Sidekiq <= 7 writes float seconds, 8.x
/// integer milliseconds; readers tell them apart by JSON type (protocol.md §9). An integer that
/// is too small to be milliseconds is taken as seconds.
pub fn enqueued_at_secs(raw: &str) -> Option<f64> {
    let v: serde_json::Value = serde_json::from_str(raw).ok()?;
    let n = v.get("enqueued_at")?;
    let f = n.as_f64()?;
    if (n.is_i64() || n.is_u64()) && f > 1e11 {
        Some(f / 1000.0)
    } else {
        Some(f)
    }
}

/// Seconds the oldest job of a queue has waited (Sidekiq's `Queue#latency`): 0 when the queue
/// is empty or the job cannot be read, never negative.
pub fn latency_secs(oldest: Option<&str>, now: f64) -> f64 {
    oldest
        .and_then(enqueued_at_secs)
        .map(|t| (now - t).max(0.0))
        .unwrap_or(0.0)
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

/// One beat. Returns the remote signal popped, if any.
pub async fn beat(worker: &Worker, info: &str) -> redis::RedisResult<Option<String>> {
    // The metrics endpoint reads live busy slots from the same table the heartbeat publishes.
    let mut conn = worker.conn.clone();
    let rtt_us = ping_rtt_us(&mut conn).await?;

    let id = &worker.identity;
    let snapshot = worker.slots.snapshot();
    let busy = snapshot.len();
    let (processed, failed) = worker.slots.take_counts();

    let mut pipe = redis::pipe();
    pipe.atomic();
    add_stat_deltas(&mut pipe, processed, failed);
    worker.job_metrics.flush_into(&mut pipe);
    add_work_hashes(&mut pipe, id, &snapshot);
    add_process_hash(&mut pipe, worker, info, busy, rtt_us);
    if worker.fetch.recovers_orphans() {
        add_liveness(&mut pipe, worker);
    }
    let queues = worker.config.queues.names();
    add_latency_reads(&mut pipe, &queues);
    pipe.rpop(format!("{id}-signals"), None);
    // Bytes: a non-UTF-8 job at a queue's tail must not fail the whole beat.
    match pipe.query_async::<Vec<Option<Vec<u8>>>>(&mut conn).await {
        Ok(replies) => Ok(read_replies(worker, &queues, replies)),
        Err(e) => {
            worker.slots.restore_counts(processed, failed);
            Err(e)
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

/// Refresh our liveness key and our `playguard:fetchers` entry (reliable fetch only).
fn add_liveness(pipe: &mut redis::Pipeline, worker: &Worker) {
    let id = &worker.identity;
    pipe.set_ex(alive_key(id), 1, ALIVE_TTL_SECS as u64)
        .ignore();
    // The queues tell a sweeper which working lists are ours; `ns` says which kernel and
    // pid namespace our pid lives in, so only a process that shares both may judge us
    // dead by our pid (same hostname is not enough across containers).
    pipe.hset(
        FETCHERS_KEY,
        id,
        json!({"queues": worker.config.queues.names(), "ns": pid_namespace()}).to_string(),
    )
    .ignore();
}

/// Read the oldest job of each queue, for the queue-latency gauge.
fn add_latency_reads(pipe: &mut redis::Pipeline, queues: &[String]) {
    // Queue latency, cheaply: the oldest job (right end, where BRPOP takes from) of each of
    // our queues, one LINDEX each inside the same MULTI. Replies come back in order, before
    // the signal.
    for q in queues {
        pipe.lindex(crate::job::queues::queue_key(q), -1);
    }
}

/// After a beat that went through: note Redis answered, set each queue's latency from its
/// oldest job, and return the remote signal popped (the last reply), if any.
fn read_replies(
    worker: &Worker,
    queues: &[String],
    mut replies: Vec<Option<Vec<u8>>>,
) -> Option<String> {
    worker
        .metrics
        .last_redis_ok_ms
        .store(chrono::Utc::now().timestamp_millis(), Ordering::Relaxed);
    let signal = replies
        .pop()
        .flatten()
        .map(|s| String::from_utf8_lossy(&s).into_owned());
    let now = crate::job::payload::now_f64();
    for (q, oldest) in queues.iter().zip(replies.iter()) {
        worker.metrics.set_latency(
            q,
            latency_secs(
                oldest.as_deref().and_then(|b| std::str::from_utf8(b).ok()),
                now,
            ),
        );
    }
    signal
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enqueued_at_in_either_unit() {
        assert_eq!(
            enqueued_at_secs(r#"{"enqueued_at":1796095478.5}"#),
            Some(1796095478.5)
        );
        assert_eq!(
            enqueued_at_secs(r#"{"enqueued_at":1796095478500}"#),
            Some(1796095478.5)
        );
        assert_eq!(
            enqueued_at_secs(r#"{"enqueued_at":1796095478}"#),
            Some(1796095478.0)
        );
        assert_eq!(enqueued_at_secs(r#"{"class":"X"}"#), None);
        assert_eq!(enqueued_at_secs("not json"), None);
    }

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

    #[test]
    fn latency_is_zero_for_empty_or_future() {
        assert_eq!(latency_secs(None, 100.0), 0.0);
        assert_eq!(latency_secs(Some(r#"{"enqueued_at":90.0}"#), 100.0), 10.0);
        assert_eq!(latency_secs(Some(r#"{"enqueued_at":200.0}"#), 100.0), 0.0);
    }
}

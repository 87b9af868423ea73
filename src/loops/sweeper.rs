//! Orphan recovery for reliable fetch. Processes register their queues in
//! `playguard:fetchers` and keep `playguard:alive:<identity>` fresh; a process whose alive key
//! has lapsed (or, on this host, whose pid is gone) is dead, and its
//! `playguard:working:<identity>:<q>` lists go back to the heads of `queue:<q>`. One sweep at
//! a time across the fleet (the `playguard:sweep` token lock, held only while sweeping, so a
//! restarted process sweeps at once); a process never sweeps its own lists.
//! A payload recovered `MAX_RECOVERIES` times (counted in the `playguard:recovered` hash, a
//! count forgotten after 7 days without a recovery via `playguard:recovered:at`) is a poison
//! pill: it goes to `dead` with the reason (through `playguard:poison`, so the dead entry is
//! built from the exact string in Rust), or is dropped when its payload says `dead: false`;
//! either way it is reported once (Sentry, `poison` and `death` hooks, as Sidekiq's death
//! handlers run for `dead: false` too).
//! Before its jobs go back, a dead process's token locks are released from the record its
//! cycles keep in `playguard:locks:<identity>` (compare-and-delete on each lock key), so a
//! recovered cycle is not skipped as "already locked" by its own dead holder.

use crate::job::error_class;
use crate::job::report::{Kind, Report, Reporter};
use crate::process::identity::hostname;
use crate::process::liveness::{alive_key, FETCHERS_KEY};
use crate::worker::Worker;
use serde_json::Value;
use std::time::Duration;

/// The third time a job is found orphaned it is not run again.
pub const MAX_RECOVERIES: u32 = 3;
pub const SWEEP_EVERY: Duration = Duration::from_secs(5);
pub const POISON_KEY: &str = "playguard:poison";
/// How many times each payload was recovered (field = sha1 of the payload).
pub const RECOVERED_KEY: &str = "playguard:recovered";
/// When each counted payload was last recovered; a count untouched this long is forgotten.
pub const RECOVERED_AT_KEY: &str = "playguard:recovered:at";
const RECOVERY_MEMORY: Duration = Duration::from_secs(7 * 24 * 3600);

static RECOVER: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("../../lua/recover.lua")));
static RELEASE_LOCKS: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("../../lua/locks_release.lua")));

/// Whether a process on this host with that pid is certainly gone.
fn local_pid_gone(identity: &str, their_ns: &str) -> bool {
    // Only a process in the same kernel boot and pid namespace can read another's pid.
    if their_ns.is_empty() || their_ns != crate::process::identity::pid_namespace() {
        return false;
    }
    let mut parts = identity.rsplitn(3, ':');
    let (_nonce, pid, host) = (parts.next(), parts.next(), parts.next());
    let Some(pid) = pid.and_then(|p| p.parse::<i32>().ok()) else {
        return false;
    };
    if host != Some(hostname().as_str()) || pid as u32 == std::process::id() {
        return false;
    }
    matches!(
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None),
        Err(nix::errno::Errno::ESRCH)
    ) && !guardians_left(pid as u32)
}

/// Whether a command guardian of worker `pid` is still alive. A dead worker's guardians kill
/// their groups on PDEATHSIG, but that takes them a moment: until the last is gone, a command
/// may still run, so the pid alone does not let us recover its job (or free its locks) yet.
fn guardians_left(pid: u32) -> bool {
    let needle = crate::commands::guardian::guardian_arg(pid);
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return true;
    };
    dir.flatten().any(|e| {
        std::fs::read(e.path().join("cmdline"))
            .map(|c| c.split(|b| *b == 0).any(|a| a == needle.as_bytes()))
            .unwrap_or(false)
    })
}

/// Release the locks `identity` recorded, if it is dead (alive key lapsed, or `force`: its
/// pid is gone on this host, or it is ourselves after our own lease lapsed). Returns how
/// many lock keys were deleted; -1 when it turned out to be alive.
pub async fn release_locks_of(
    worker: &Worker,
    identity: &str,
    force: bool,
) -> redis::RedisResult<i64> {
    let mut conn = worker.conn.clone();
    let record = crate::cycle::lock::locks_record_key(identity);
    let held: Vec<(String, String)> = redis::cmd("HGETALL")
        .arg(&record)
        .query_async(&mut conn)
        .await?;
    if held.is_empty() {
        return Ok(0);
    }
    let mut inv = RELEASE_LOCKS.key(alive_key(identity));
    inv.key(&record).arg(if force { "1" } else { "0" });
    for (key, json) in &held {
        // A record we cannot read still goes (its lock then expires by its ttl).
        let token = serde_json::from_str::<Value>(json)
            .ok()
            .and_then(|v| v.get("token").and_then(Value::as_str).map(str::to_string))
            .unwrap_or_default();
        inv.key(key).arg(token);
    }
    let n: i64 = inv.invoke_async(&mut conn).await?;
    if n > 0 {
        tracing::warn!(dead_process = %identity, locks = n,
            "released the locks of a worker that died holding them");
    }
    Ok(n)
}

/// One sweep (if this process wins the lease). Returns how many jobs were recovered.
pub async fn sweep(worker: &Worker) -> redis::RedisResult<i64> {
    // The lock spaces sweeps out fleet-wide (one per SWEEP_EVERY, not one per process); it is
    // left to expire rather than released, so it rate-limits. Each recovery is one atomic
    // script, so two sweeps at once are harmless: that is why a process starting up sweeps
    // without it (see `run`) and recovers its predecessor's jobs at once.
    if crate::cycle::lock::first_in_window(
        &worker.conn,
        SWEEP_LOCK,
        SWEEP_EVERY.saturating_sub(Duration::from_millis(500)),
    )
    .await?
    {
        sweep_all(worker).await
    } else {
        Ok(0)
    }
}

/// The key that spaces sweeps out across the fleet.
pub const SWEEP_LOCK: &str = "playguard:sweep";

/// Recover every dead process's working lists now.
pub async fn sweep_all(worker: &Worker) -> redis::RedisResult<i64> {
    let mut conn = worker.conn.clone();
    let (fetchers, alive) = fetchers_alive(&mut conn).await?;
    let mut total = 0;
    for ((identity, queues), alive) in fetchers.into_iter().zip(alive) {
        if identity == worker.identity {
            continue;
        }
        let Some((queues, force)) = fetcher_entry(&identity, &queues) else {
            continue;
        };
        if alive && !force {
            continue;
        }
        // Locks first: a job recovered before its lock is free would be skipped and acked.
        release_locks_of(worker, &identity, force).await?;
        let Some(reply) = recover(&mut conn, &identity, &queues, force).await else {
            continue;
        };
        total += report_recovered(&identity, &reply);
    }
    bury_poison(worker).await?;
    Ok(total)
}

/// The `playguard:fetchers` entries (identity, entry JSON), and whether each one's alive key
/// exists.
async fn fetchers_alive(
    conn: &mut crate::connections::redis_conn::Conn,
) -> redis::RedisResult<(Vec<(String, String)>, Vec<bool>)> {
    let fetchers: Vec<(String, String)> = redis::cmd("HGETALL")
        .arg(FETCHERS_KEY)
        .query_async(conn)
        .await?;
    // Which of them are alive, in one round trip: a live process is left alone here rather
    // than having its lock record read and the recovery script run only to find it alive
    // (both scripts still check, atomically, for the ones that look dead now).
    let mut pipe = redis::pipe();
    for (identity, _) in &fetchers {
        pipe.exists(alive_key(identity));
    }
    let alive: Vec<bool> = if fetchers.is_empty() {
        Vec::new()
    } else {
        pipe.query_async(conn).await?
    };
    Ok((fetchers, alive))
}

/// A fetcher entry's queues, and whether its pid is certainly gone (`local_pid_gone`); None,
/// with a warning, for an entry without queues.
fn fetcher_entry(identity: &str, queues: &str) -> Option<(Vec<String>, bool)> {
    // {"queues": [...], "ns": "..."}; a bare array of queue names is read too.
    let entry: Value = serde_json::from_str(queues).unwrap_or(Value::Null);
    let list = match &entry {
        Value::Array(_) => Some(&entry),
        _ => entry.get("queues"),
    };
    let queues: Vec<String> = list
        .and_then(|q| serde_json::from_value(q.clone()).ok())
        .unwrap_or_default();
    if queues.is_empty() {
        tracing::warn!(process = %identity, "fetcher entry without queues; leaving it alone");
        return None;
    }
    let ns = entry.get("ns").and_then(Value::as_str).unwrap_or("");
    Some((queues, local_pid_gone(identity, ns)))
}

/// Run the recovery script for one dead process's working lists: its reply (the count, then
/// any queue key that is not a list), or None when there was nothing to do or it failed.
async fn recover(
    conn: &mut crate::connections::redis_conn::Conn,
    identity: &str,
    queues: &[String],
    force: bool,
) -> Option<Vec<redis::Value>> {
    let now = crate::job::payload::now_f64();
    let mut inv = RECOVER.key(FETCHERS_KEY);
    inv.key(alive_key(identity))
        .key(RECOVERED_KEY)
        .key(RECOVERED_AT_KEY)
        .key(POISON_KEY)
        .arg(identity)
        .arg(MAX_RECOVERIES)
        .arg(if force { "1" } else { "0" })
        .arg(now)
        .arg(now - RECOVERY_MEMORY.as_secs_f64());
    for q in queues {
        inv.key(crate::fetch::working_key(identity, q))
            .key(crate::job::queues::queue_key(q));
    }
    // One identity that cannot be recovered (say, a working list of the wrong type) must
    // not stop the sweep for all the others: log it and go on; its entry stays.
    match inv.invoke_async(conn).await {
        Ok(redis::Value::Array(v)) => Some(v),
        Ok(_) => None, // -1 (alive) or -2 (no queues): nothing to do
        Err(e) => {
            tracing::error!(dead_process = %identity, error = %e,
                "orphan sweep: cannot recover this process's jobs; they stay in its working lists");
            None
        }
    }
}

/// Log what the recovery script reported for `identity`; how many jobs it recovered.
fn report_recovered(identity: &str, reply: &[redis::Value]) -> i64 {
    let n: i64 = reply
        .first()
        .and_then(|v| redis::from_redis_value_ref(v).ok())
        .unwrap_or(0);
    for key in &reply[1.min(reply.len())..] {
        let key: String = redis::from_redis_value_ref(key).unwrap_or_default();
        tracing::error!(dead_process = %identity, queue = %key.strip_prefix("queue:").unwrap_or(&key),
            "orphan sweep: {key} is not a list; its jobs stay in the dead process's working list");
    }
    if n > 0 {
        tracing::warn!(dead_process = %identity, jobs = n,
            "recovered jobs of a worker that died without a clean stop");
        n
    } else {
        0
    }
}

/// Turn poison pills into dead-set entries carrying the reason.
async fn bury_poison(worker: &Worker) -> redis::RedisResult<()> {
    let mut conn = worker.conn.clone();
    let pills: Vec<Vec<u8>> = redis::cmd("LRANGE")
        .arg(POISON_KEY)
        .arg(0)
        .arg(-1)
        .query_async(&mut conn)
        .await?;
    let message = format!(
        "recovered {MAX_RECOVERIES} times from workers that died while running it \
         (killed, OOM or lost host); not run again"
    );
    for raw in pills {
        let payload = crate::job::retry::dead_entry(&raw, error_class::POISON_PILL, &message);
        let mut pipe = redis::pipe();
        pipe.atomic();
        if dead_false(&raw) {
            // Sidekiq Pro (8.0+) drops a poison pill whose payload says `dead: false`.
            tracing::error!(payload = %String::from_utf8_lossy(&raw),
                "poison pill with dead: false: dropped, not kept in the dead set");
        } else {
            tracing::error!(payload = %String::from_utf8_lossy(&raw), "poison pill: moved to the dead set");
            crate::job::retry::add_dead(&mut pipe, &payload);
        }
        pipe.cmd("LREM").arg(POISON_KEY).arg(1).arg(&raw);
        let (removed,): (i64,) = pipe.query_async(&mut conn).await?;
        // Reported by the sweep that took it off the poison list: once, however many swept.
        if removed == 1 {
            worker
                .reporter
                .report(poison_report(&raw, payload, &message));
        }
    }
    Ok(())
}

/// Whether a payload is a JSON object with `"dead": false`.
fn dead_false(raw: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Map<String, Value>>(raw)
        .is_ok_and(|m| m.get("dead") == Some(&Value::Bool(false)))
}

/// The report of a buried poison pill (a death too): its dead entry, the queue it came from.
fn poison_report(raw: &[u8], entry: Vec<u8>, message: &str) -> Report {
    let queue = serde_json::from_slice::<Value>(raw)
        .ok()
        .and_then(|v| v.get("queue").and_then(Value::as_str).map(str::to_string))
        .unwrap_or_else(|| "unknown".to_string());
    Report {
        kind: Kind::Poison,
        died: true,
        queue: queue.into(),
        payload: String::from_utf8_lossy(&entry).into_owned(),
        fetched: None,
        error: crate::job::retry::Failure::new(error_class::POISON_PILL, message),
        phase: None,
    }
}

/// Sweep now and every SWEEP_EVERY until stopping.
pub async fn run(worker: std::sync::Arc<Worker>) {
    let mut first = true;
    loop {
        let r = if std::mem::take(&mut first) {
            sweep_all(&worker).await
        } else {
            sweep(&worker).await
        };
        if let Err(e) = r {
            tracing::warn!(error = %e, "orphan sweep: Redis error");
        }
        tokio::select! {
            _ = tokio::time::sleep(SWEEP_EVERY) => {}
            _ = worker.shutdown.stopped() => return,
        }
    }
}

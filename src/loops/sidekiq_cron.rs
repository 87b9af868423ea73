//! sidekiq-cron's poller (`--sidekiq-cron`), for a fleet where playguard processes share the
//! gem's schedule with Ruby processes that run the gem: each poll reads every entry the gem
//! keeps in Redis (`cron_entry.rs`) and enqueues the ones due, as the gem's
//! `Sidekiq::Cron::Poller` does, so either kind of process may fire a tick and the gem's Web UI
//! shows the same `last_enqueue_time` and jid history whoever did.
//!
//! One enqueue per tick: the gem's gate is a ZADD of the tick's member to
//! `cron_job:<name>:enqueued`; only the process whose ZADD adds it pushes. The gem sends its
//! commands one by one; `lua/cron_enqueue.lua` sends the same ones in the same order as one
//! script, so the gate is the same member, the Ruby processes see our ticks as theirs, and a
//! crash cannot land between the ZADD and the push.
//!
//! The jid history keeps the gem's `cron_history_size` (10) entries.
//!
//! Interval: the gem's `cron_poll_interval` (30 s; `cron_poll_interval:` in sidekiq.yml),
//! slept as Sidekiq's poller sleeps it: uniform around it (half to one and a half) while fewer
//! than 10 processes are registered, else up to it.
//!
//! Keys: `cron_jobs` (SMEMBERS), `cron_job:<name>` (HGETALL; `last_enqueue_time`),
//! `cron_job:<name>:enqueued`, `cron_job:<name>:jid_history`, `queues`, `queue:<q>`, and
//! `processes` (SCARD).

use super::cron_entry::{self, CronEntry};
use crate::job::payload::now_f64;
use crate::worker::Worker;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

static ENQUEUE: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("../../lua/cron_enqueue.lua")));

/// The gem forgets an `:enqueued` member a day after the poll that added it.
const REMEMBER_SECS: f64 = 24.0 * 3600.0;

/// Run until quiet. Entries that cannot be read are logged once per reason, not at every poll.
pub async fn run(worker: Arc<Worker>) {
    let average = worker.config.cron_poll_interval;
    if average <= 0.0 {
        tracing::info!("sidekiq-cron: cron_poll_interval is 0, not polling (as the gem)");
        return;
    }
    // Sidekiq's first wait staggers the processes by up to 5 s. Its other 10 s are there for
    // the heartbeat to register before a poll scaled by the process count; this poll is not
    // scaled, and our first beat has landed before any loop starts (launcher/).
    let mut wait = Duration::from_secs_f64(5.0 * rand::random::<f64>());
    let mut logged = HashSet::new();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = worker.shutdown.quieted() => return,
        }
        if let Err(e) = poll(&worker, &mut logged).await {
            tracing::warn!(error = %e, "sidekiq-cron: Redis error; polling again next interval");
        }
        wait = interval(&worker, average).await;
    }
}

/// Sidekiq's random_poll_interval, with the cron poller's unscaled average.
async fn interval(worker: &Worker, average: f64) -> Duration {
    let count = super::scheduled::process_count(worker).await;
    let r = rand::random::<f64>();
    let secs = if count < 10 {
        average * r + average / 2.0
    } else {
        average * r
    };
    // A sidekiq.yml value too large for a Duration waits a year rather than panicking.
    Duration::try_from_secs_f64(secs).unwrap_or(Duration::from_secs(365 * 24 * 3600))
}

/// One poll: every entry of `cron_jobs`, at one `now`, as the gem's `Poller#enqueue`.
async fn poll(worker: &Worker, logged: &mut HashSet<String>) -> redis::RedisResult<()> {
    let mut conn = worker.conn.clone();
    let keys: Vec<String> = redis::cmd("SMEMBERS")
        .arg("cron_jobs")
        .query_async(&mut conn)
        .await?;
    if keys.is_empty() {
        return Ok(());
    }
    let mut pipe = redis::pipe();
    for key in &keys {
        pipe.hgetall(key);
    }
    // One key of another type (or a value that is not text) is that entry's fault alone: the
    // gem's poll would fail whole on it, ours goes on with the others.
    let hashes: Vec<redis::RedisResult<HashMap<String, String>>> =
        pipe.ignore_errors().query_async(&mut conn).await?;
    let now = now_f64();
    for (key, hash) in keys.iter().zip(hashes) {
        let outcome = match hash.map_err(|e| e.to_string()) {
            Ok(hash) if hash.is_empty() => continue,
            // A Redis error ends the poll, as in the gem: the next interval tries again.
            Ok(hash) => match CronEntry::from_hash(&hash) {
                Ok(entry) => fire(worker, &entry, now).await?,
                Err(reason) => Err(reason),
            },
            Err(reason) => Err(reason),
        };
        if let Err(reason) = outcome {
            // The entry stays as it is in Redis; a Ruby process running the gem may still fire it.
            if logged.len() > 1000 {
                logged.clear();
            }
            if logged.insert(format!("{key}\0{reason}")) {
                tracing::error!(key = %key, reason = %reason, "sidekiq-cron: entry not enqueued");
            }
        }
    }
    Ok(())
}

/// Enqueue the entry's due tick unless another process has it. Inner Err: why the entry
/// cannot be pushed (it stays as it is).
async fn fire(
    worker: &Worker,
    entry: &CronEntry,
    now: f64,
) -> redis::RedisResult<Result<(), String>> {
    let Some(tick) = entry.due_tick(now) else {
        return Ok(Ok(()));
    };
    let at = now_f64();
    let (queue, payload, jid) = match entry.payload(at) {
        Ok(p) => p,
        Err(reason) => return Ok(Err(reason)),
    };
    let enqueued = cron_entry::enqueue_time_text(at);
    let name = &entry.name;
    let mut inv = ENQUEUE.prepare_invoke();
    inv.key(format!("cron_job:{name}:enqueued"))
        .key(format!("cron_job:{name}"))
        .key(format!("cron_job:{name}:jid_history"))
        .key("queues")
        .key(crate::job::queues::queue_key(&queue))
        .arg(cron_entry::score(tick))
        .arg(cron_entry::member(tick))
        .arg(&payload)
        .arg(&enqueued)
        .arg(cron_entry::history_entry(&jid, &enqueued))
        // The gem's LTRIM bound, `cron_history_size - 1` (so 0 keeps every entry, as there).
        .arg(worker.config.cron_history_size - 1)
        .arg(format!("({}", at - REMEMBER_SECS))
        .arg(&queue);
    let mut conn = worker.conn.clone();
    let reply: Vec<redis::Value> = inv.invoke_async(&mut conn).await?;
    Ok(match reply.as_slice() {
        [redis::Value::Int(1)] => {
            let tick = cron_entry::member(tick);
            tracing::info!(cron = %name, %jid, %queue, %tick, "sidekiq-cron: enqueued");
            Ok(())
        }
        [redis::Value::Int(-1), key, kind] => Err(format!(
            "{} holds a {} (nothing written)",
            text(key),
            text(kind)
        )),
        _ => Ok(()),
    })
}

fn text(v: &redis::Value) -> String {
    match v {
        redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        redis::Value::SimpleString(s) => s.clone(),
        other => format!("{other:?}"),
    }
}

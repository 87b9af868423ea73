//! The heartbeat's read-only look at each served queue, in one `lua/queue_heads.lua` call
//! outside the beat's MULTI: the oldest job of `queue:<q>` (for the queue-latency gauge) and
//! whether `queue:<q>` and our `playguard:working:<identity>:<q>` hold lists. A queue whose key
//! holds another type is marked broken (logged once, naming the key; fetch then skips it, see
//! `process/redis_state.rs`) and marked fine again once the key is fixed. Nothing here can fail
//! a beat: the beat is judged on its own writes.

use crate::job::queues::queue_key;
use crate::worker::Worker;

static QUEUE_HEADS: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("../../lua/queue_heads.lua")));

/// Read every served queue's head and type; update the latency gauge and the broken queues.
pub async fn read(worker: &Worker, conn: &mut crate::connections::redis_conn::Conn) {
    let queues = worker.config.queues.names();
    let mut inv = QUEUE_HEADS.prepare_invoke();
    for q in &queues {
        inv.key(queue_key(q));
    }
    if worker.liveness.is_kept() {
        for q in &queues {
            inv.key(crate::fetch::working_key(&worker.identity, q));
        }
    }
    inv.arg(queues.len());
    let replies: Vec<redis::Value> = match inv.invoke_async(conn).await {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(error = %e, "heartbeat: could not read the queues' heads");
            return;
        }
    };
    let now = crate::job::payload::now_f64();
    for (q, reply) in queues.iter().zip(replies.iter()) {
        match reply {
            redis::Value::Array(bad) => mark_broken(worker, q, bad),
            head => {
                if worker.metrics.redis.mark_fine(q) {
                    tracing::warn!(queue = %q, "queue {q}'s keys hold lists again: fetching from it resumes");
                }
                let oldest = match head {
                    redis::Value::BulkString(b) => std::str::from_utf8(b).ok(),
                    _ => None,
                };
                worker.metrics.set_latency(q, latency_secs(oldest, now));
            }
        }
    }
}

/// `bad` is `[key, type]`: mark the queue broken, logging it the first time.
fn mark_broken(worker: &Worker, queue: &str, bad: &[redis::Value]) {
    let text = |v: Option<&redis::Value>| match v {
        Some(redis::Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
        _ => "?".to_string(),
    };
    let (key, kind) = (text(bad.first()), text(bad.get(1)));
    let why = format!("{key} holds a {kind}, not a list");
    if worker.metrics.redis.mark_broken(queue, why.clone()) {
        tracing::error!(queue, key = %key,
            "{why}: queue {queue} is skipped by fetch and the heartbeat until the key is fixed (deleted or made a list)");
    }
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
    fn latency_is_zero_for_empty_or_future() {
        assert_eq!(latency_secs(None, 100.0), 0.0);
        assert_eq!(latency_secs(Some(r#"{"enqueued_at":90.0}"#), 100.0), 10.0);
        assert_eq!(latency_secs(Some(r#"{"enqueued_at":200.0}"#), 100.0), 0.0);
    }
}

//! Periodic dispatch without a leader: every process computes the wall-clock tick
//! (floor(now / every)) and tries `SET playguard:periodic:<name>:<tick> <identity> NX EX`;
//! only the winner enqueues that tick's jobs (one per member of the Rails app's set, or one
//! with fixed args) in one pipeline. Missed ticks are skipped, never replayed in a burst.
//! Keys: `playguard:periodic:<name>:<tick>`, the member set, `queues`, `queue:<q>`.

use crate::enqueue::{add_push, NewJob};
use crate::manifest::PeriodicSpec;
use crate::runtime::Runtime;
use serde_json::Value;
use std::sync::Arc;
use std::time::Duration;

/// A member becomes the single argument: JSON when it parses (`42` stays a number), else a string.
pub fn member_arg(member: &str) -> Value {
    serde_json::from_str(member).unwrap_or_else(|_| Value::from(member))
}

fn toml_to_json(v: &toml::Value) -> Value {
    serde_json::to_value(v).unwrap_or(Value::Null)
}

/// Try to own `tick`; if we win, enqueue its jobs. Returns Some(count) when we enqueued.
pub async fn fire(
    rt: &Runtime,
    spec: &PeriodicSpec,
    tick: u64,
) -> redis::RedisResult<Option<usize>> {
    let mut conn = rt.conn.clone();
    let key = format!("playguard:periodic:{}:{tick}", spec.name);
    // Kept past the tick so a slow peer still sees it was taken.
    let ttl = spec.every_secs.saturating_mul(2).max(60);
    let won: Option<String> = redis::cmd("SET")
        .arg(&key)
        .arg(&rt.identity)
        .arg("NX")
        .arg("EX")
        .arg(ttl)
        .query_async(&mut conn)
        .await?;
    if won.is_none() {
        return Ok(None);
    }
    let arg_lists: Vec<Vec<Value>> = match &spec.for_each_member_of {
        Some(set) => {
            let mut members: Vec<String> = redis::cmd("SMEMBERS")
                .arg(set)
                .query_async(&mut conn)
                .await?;
            members.sort();
            members.iter().map(|m| vec![member_arg(m)]).collect()
        }
        None => vec![spec.args.iter().map(toml_to_json).collect()],
    };
    let retry = spec
        .retry
        .as_ref()
        .map(toml_to_json)
        .unwrap_or(Value::Bool(true));
    let now = crate::payload::now_f64();
    let mut pipe = redis::pipe();
    for args in &arg_lists {
        let job = NewJob {
            class: spec.class.clone(),
            args: args.clone(),
            queue: spec.queue.clone(),
            retry: retry.clone(),
            at: None,
        };
        add_push(&mut pipe, &job, now);
    }
    if !arg_lists.is_empty() {
        pipe.query_async::<()>(&mut conn).await?;
    }
    Ok(Some(arg_lists.len()))
}

/// Fire at every wall-clock multiple of `every_secs` until quiet.
pub async fn run(rt: Arc<Runtime>, spec: PeriodicSpec) {
    let every = spec.every_secs;
    loop {
        let now = crate::payload::now_f64();
        let tick = (now / every as f64).floor() as u64;
        match fire(&rt, &spec, tick).await {
            Ok(Some(n)) => {
                tracing::info!(periodic = %spec.name, tick, enqueued = n, class = %spec.class,
                queue = %spec.queue, "periodic tick")
            }
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(periodic = %spec.name, tick, error = %e, "periodic tick failed")
            }
        }
        let next = ((tick + 1) * every) as f64;
        let wait = Duration::from_secs_f64((next - crate::payload::now_f64()).max(0.0) + 0.005);
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = rt.shutdown.quieted() => return,
        }
    }
}

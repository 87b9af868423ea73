//! Periodic dispatch without a leader: every process computes the wall-clock tick
//! (floor(now / every), or the epoch second of a cron line's run time, `manifest/cron.rs`)
//! and tries `SET playguard:periodic:<name>:<tick> <identity> NX EX`;
//! only the winner enqueues that tick's jobs (one per member of the Rails app's set, or one
//! with fixed args). Missed ticks are skipped, never replayed in a burst.
//!
//! The claim and the pushes run in one Lua script (`lua/periodic_dispatch.lua`), so a tick is
//! never claimed without its jobs (a Redis error after a bare SET NX would otherwise lose the
//! tick for every process) and a failed attempt can simply be retried until the tick ends: a
//! retry after an attempt that did land finds the fingerprint taken and pushes nothing.
//!
//! Every job of one tick carries the same `created_at`/`enqueued_at`, the instant the tick was
//! computed from, so `floor(created_at / every)` is that tick (for `every_secs`).
//!
//! Keys: `playguard:periodic:<name>:<tick>`, the member set (read), `queues`, `queue:<q>`.

use crate::job::client::NewJob;
use crate::job::payload::{new_jid, now_f64};
use crate::manifest::PeriodicSpec;
use crate::worker::Worker;
use serde_json::Value;
use std::sync::Arc;
use std::time::Duration;

/// After a failed attempt, try again this soon (while the tick lasts).
const RETRY_DELAY: Duration = Duration::from_secs(1);
/// Wake this long after the boundary, so a timer that fires on the dot still reads the new tick.
const PAST_BOUNDARY: Duration = Duration::from_millis(5);

/// Claim the fingerprint and push every payload, atomically (`lua/periodic_dispatch.lua`).
/// Returns the number pushed, or -1 when the tick was already taken.
static SCRIPT: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    redis::Script::new(include_str!("../../lua/periodic_dispatch.lua"))
});

/// A member becomes the single argument: JSON when it parses (`42` stays a number), else a string.
pub fn member_arg(member: &str) -> Value {
    serde_json::from_str(member).unwrap_or_else(|_| Value::from(member))
}

/// Fixed manifest args as JSON. TOML datetimes have no JSON form and become their RFC 3339 text.
fn toml_to_json(v: &toml::Value) -> Value {
    match v {
        toml::Value::Datetime(d) => Value::from(d.to_string()),
        toml::Value::Array(a) => Value::Array(a.iter().map(toml_to_json).collect()),
        toml::Value::Table(t) => Value::Object(
            t.iter()
                .map(|(k, v)| (k.clone(), toml_to_json(v)))
                .collect(),
        ),
        other => serde_json::to_value(other).unwrap_or(Value::Null),
    }
}

/// The wall-clock tick `now` (epoch seconds) falls in.
pub fn tick_of(now: f64, every_secs: u64) -> u64 {
    (now / every_secs as f64).floor() as u64
}

/// How long the fingerprint lives: past its tick, so a peer whose clock lags (by less than one
/// period, or less than a minute for short periods) still finds it taken.
pub fn fingerprint_ttl(every_secs: u64) -> u64 {
    every_secs.saturating_mul(2).max(60)
}

pub fn fingerprint_key(name: &str, tick: u64) -> String {
    format!("playguard:periodic:{name}:{tick}")
}

/// One tick: its number (the fingerprint's suffix) and how long its fingerprint lives.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tick {
    pub n: u64,
    pub ttl: u64,
}

/// A cron tick stays due this long after its run time (sidekiq-cron's 60 s look-back): a
/// process that starts, or gets Redis back, within it still enqueues the tick; later, it is
/// skipped, never replayed.
const CRON_LOOKBACK_SECS: i64 = 60;

/// The tick due at `now` (None: a cron schedule between run times), and when the next one
/// starts. `every_secs` ticks are numbered floor(now / every); a cron tick by the epoch second
/// of its run time.
pub fn due(spec: &PeriodicSpec, now: f64) -> (Option<Tick>, f64) {
    if let Some(schedule) = &spec.schedule {
        let t = now.floor() as i64;
        let next = schedule.next_after(t);
        let tick = schedule.due(t, CRON_LOOKBACK_SECS).map(|at| Tick {
            n: at as u64,
            ttl: fingerprint_ttl(schedule.next_after(at).map_or(86_400, |n| n - at) as u64),
        });
        // A schedule with no run time in five years looks again in a day.
        return (tick, next.map_or(now + 86_400.0, |n| n as f64));
    }
    let every = spec.every_secs.unwrap_or(60).max(1);
    let n = tick_of(now, every);
    let tick = Tick {
        n,
        ttl: fingerprint_ttl(every),
    };
    (Some(tick), ((n + 1) * every) as f64)
}

/// Try to own `tick`; if we win, its jobs are pushed in the same script.
/// Returns Some(count) when we enqueued, None when a peer (or an earlier attempt of ours) had.
pub async fn fire(
    conn: &mut crate::connections::redis_conn::Conn,
    identity: &str,
    spec: &PeriodicSpec,
    tick: Tick,
    now: f64,
) -> redis::RedisResult<Option<usize>> {
    let arg_lists: Vec<Vec<Value>> = match &spec.for_each_member_of {
        Some(set) => {
            // Bytes, then lossy text: one odd member must not cost every Marquee its tick.
            let members: Vec<Vec<u8>> = redis::cmd("SMEMBERS").arg(set).query_async(conn).await?;
            let mut members: Vec<String> = members
                .iter()
                .map(|m| String::from_utf8_lossy(m).into_owned())
                .collect();
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
    let mut inv = SCRIPT.prepare_invoke();
    inv.key(fingerprint_key(&spec.name, tick.n))
        .key("queues")
        .key(crate::job::queues::queue_key(&spec.queue))
        .arg(identity)
        .arg(tick.ttl)
        .arg(&spec.queue);
    for args in arg_lists {
        let job = NewJob {
            class: spec.class.clone(),
            args,
            queue: spec.queue.clone(),
            retry: retry.clone(),
            at: None,
        };
        inv.arg(job.payload(&new_jid(), now));
    }
    let pushed: i64 = inv.invoke_async(conn).await?;
    Ok(usize::try_from(pushed).ok())
}

/// Fire every tick until quiet. A process starting mid-tick fires that tick at once unless a
/// peer already has (a cron tick: within its look-back); earlier ticks are never replayed.
pub async fn run(worker: Arc<Worker>, spec: PeriodicSpec) {
    // The last tick settled (enqueued by us or a peer): never attempted again, even if the
    // wall clock steps back.
    let mut settled: Option<u64> = None;
    loop {
        let now = now_f64();
        let (tick, next) = due(&spec, now);
        let mut retry_soon = false;
        if let Some(tick) = tick.filter(|t| settled.is_none_or(|s| t.n > s)) {
            let mut conn = worker.conn.clone();
            match fire(&mut conn, &worker.identity, &spec, tick, now).await {
                Ok(Some(n)) => {
                    settled = Some(tick.n);
                    tracing::info!(periodic = %spec.name, tick = tick.n, enqueued = n, class = %spec.class,
                        queue = %spec.queue, "periodic tick");
                }
                Ok(None) => {
                    settled = Some(tick.n);
                    tracing::debug!(periodic = %spec.name, tick = tick.n, "periodic tick taken by a peer");
                }
                Err(e) => {
                    // Nothing was claimed unless the jobs were pushed too: retry while the tick lasts.
                    retry_soon = true;
                    tracing::warn!(periodic = %spec.name, tick = tick.n, error = %e,
                        "periodic tick failed; retrying while the tick lasts");
                }
            }
        }
        let mut wait = Duration::from_secs_f64((next - now_f64()).max(0.0)) + PAST_BOUNDARY;
        if retry_soon {
            wait = wait.min(RETRY_DELAY);
        }
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = worker.shutdown.quieted() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn member_arg_keeps_json_and_falls_back_to_string() {
        assert_eq!(member_arg("42"), serde_json::json!(42));
        assert!(member_arg("42").is_number());
        assert_eq!(member_arg("-7"), serde_json::json!(-7));
        assert_eq!(member_arg("2.5"), serde_json::json!(2.5));
        assert_eq!(member_arg("true"), Value::Bool(true));
        assert_eq!(member_arg("null"), Value::Null);
        assert_eq!(member_arg("\"quoted\""), Value::from("quoted"));
        assert_eq!(
            member_arg(r#"{"id":7,"host":"a"}"#),
            serde_json::json!({"id": 7, "host": "a"})
        );
        assert_eq!(member_arg("[1,\"x\"]"), serde_json::json!([1, "x"]));
        // Not JSON: kept verbatim as a string.
        for s in [
            "marquee-7",
            "gid://app/Marquee/7",
            "007",
            "",
            "NaN",
            "{broken",
            "42abc",
            "ünïcødé ✓",
        ] {
            assert_eq!(member_arg(s), Value::from(s), "{s:?}");
        }
    }

    #[test]
    fn member_arg_keeps_big_numbers_exact() {
        let v = member_arg("1180591620717411303424");
        assert_eq!(serde_json::to_string(&v).unwrap(), "1180591620717411303424");
        let v = member_arg("3.14159");
        assert_eq!(serde_json::to_string(&v).unwrap(), "3.14159");
    }

    #[test]
    fn ticks_align_to_wall_clock_multiples() {
        assert_eq!(tick_of(0.0, 60), 0);
        assert_eq!(tick_of(59.999, 60), 0);
        assert_eq!(tick_of(60.0, 60), 1);
        assert_eq!(tick_of(1_700_000_001.5, 2), 850_000_000);
        assert_eq!(tick_of(1_700_000_000.0, 60) * 60, 1_699_999_980);
    }

    #[test]
    fn fingerprint_outlives_its_tick() {
        assert_eq!(fingerprint_ttl(2), 60);
        assert_eq!(fingerprint_ttl(60), 120);
        assert_eq!(fingerprint_ttl(u64::MAX), u64::MAX);
        assert_eq!(
            fingerprint_key("playguard-dispatch", 42),
            "playguard:periodic:playguard-dispatch:42"
        );
    }

    #[test]
    fn fixed_args_convert_to_json() {
        let t: toml::Table =
            toml::from_str("a = [1, \"x\", 2.5, true, { k = [3] }, 1979-05-27T07:32:00Z]\nr = 3")
                .unwrap();
        assert_eq!(
            toml_to_json(&t["a"]),
            serde_json::json!([1, "x", 2.5, true, {"k": [3]}, "1979-05-27T07:32:00Z"])
        );
        assert_eq!(toml_to_json(&t["r"]), serde_json::json!(3));
    }
}

//! Periodic dispatch without a leader: every process computes the wall-clock tick
//! (floor(now / every), or the epoch second of a cron line's run time, `manifest/cron.rs`)
//! and tries to claim it (`SET playguard:periodic:<name>:<tick> <identity> NX EX`); only the
//! winner enqueues that tick's jobs (one per member of the Rails app's set, or one with fixed
//! args). Missed ticks are skipped, never replayed in a burst.
//!
//! The claim goes with the tick's first batch of pushes, and the rest follows in bounded steps
//! that a peer takes over if the winner stops (`periodic_tick.rs`, `lua/periodic_batch.lua`):
//! a tick is never claimed without its jobs, and a failed step is retried with the same batch.
//!
//! Every job of one tick carries the same `created_at`/`enqueued_at`, the instant the tick was
//! computed from, so `floor(created_at / every)` is that tick (for `every_secs`).
//!
//! Keys: `playguard:periodic:<name>:<tick>`, `playguard:periodic-progress:<name>:<tick>`, the
//! member set (read), `queues`, `queue:<q>` (all through `periodic_tick.rs`).

use super::periodic_tick::{Fanout, Outcome, Tick};
use crate::job::payload::now_f64;
use crate::manifest::PeriodicSpec;
use crate::worker::Worker;
use std::sync::Arc;
use std::time::Duration;

/// After a failed attempt, try again this soon (while the tick lasts).
const RETRY_DELAY: Duration = Duration::from_secs(1);
/// Wake this long after the boundary, so a timer that fires on the dot still reads the new tick.
const PAST_BOUNDARY: Duration = Duration::from_millis(5);

/// The wall-clock tick `now` (epoch seconds) falls in.
pub fn tick_of(now: f64, every_secs: u64) -> u64 {
    (now / every_secs as f64).floor() as u64
}

/// How long the fingerprint lives: past its tick, so a peer whose clock lags (by less than one
/// period, or less than a minute for short periods) still finds it taken.
pub fn fingerprint_ttl(every_secs: u64) -> u64 {
    every_secs.saturating_mul(2).max(60)
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
            let fanout = Fanout {
                worker: &worker,
                spec: &spec,
                tick,
                now,
                tick_end: next,
            };
            // One producer span per tick: its jobs carry it (`traces/job.rs`, `publish`).
            match crate::traces::publish(&spec.queue, fanout.fire()).await {
                Ok(outcome) => {
                    settled = Some(tick.n);
                    log_outcome(&spec, tick.n, outcome);
                }
                Err(e) => {
                    // Nothing was claimed unless its jobs were pushed too: retry while the tick
                    // lasts (a tick claimed and then left is a peer's to finish).
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

/// The one "periodic tick" line with `enqueued = n` (the tick's total) comes from the process
/// that pushed its last batch.
fn log_outcome(spec: &PeriodicSpec, tick: u64, outcome: Outcome) {
    match outcome {
        Outcome::Finished {
            total,
            ours,
            took_over,
        } => {
            tracing::info!(periodic = %spec.name, tick, enqueued = total, pushed_here = ours,
                took_over, class = %spec.class, queue = %spec.queue, "periodic tick");
        }
        Outcome::Peer => {
            tracing::debug!(periodic = %spec.name, tick, "periodic tick taken by a peer")
        }
        Outcome::Left { ours, why } => {
            tracing::warn!(periodic = %spec.name, tick, pushed_here = ours, "periodic tick {why}")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::periodic_tick::{fingerprint_key, member_arg, toml_to_json};
    use super::*;
    use serde_json::Value;

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

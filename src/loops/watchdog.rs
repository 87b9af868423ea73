//! What systemd hears while the worker runs (through process/notify.rs, only with
//! NOTIFY_SOCKET): READY=1 once the first heartbeat landed, then a STATUS= line (busy/concurrency
//! and the Redis primary in use) and, when WATCHDOG_USEC asks for it, WATCHDOG=1 at half that
//! interval, but only while the liveness lease is healthy. The lease is what the heartbeat's
//! landed beats keep alive (process/liveness.rs), so a worker whose beats stop landing stops
//! feeding the watchdog and systemd restarts it. Touches no Redis keys.

use crate::process::notify;
use crate::worker::Worker;
use std::sync::Arc;
use std::time::Duration;

/// READY=1 with the first status line (the first heartbeat has landed).
pub fn ready(worker: &Worker) {
    notify::ready(&status_line(worker));
}

/// The status and watchdog loop; returns at once without NOTIFY_SOCKET. Its own loop, not the
/// heartbeat's, because WATCHDOG_USEC may ask for a ping more often than a beat.
pub async fn run(worker: Arc<Worker>) {
    if !notify::enabled() {
        return;
    }
    let watchdog = notify::watchdog_interval();
    let beat = worker.config.beat_interval;
    let every = watchdog
        .map_or(beat, |w| w.min(beat))
        .max(Duration::from_millis(10));
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let line = status_line(&worker);
        match health(&worker) {
            Ok(()) if watchdog.is_some() => notify::watchdog(&line),
            Ok(()) => notify::status(&line),
            Err(why) => notify::status(&format!("{why}: watchdog withheld; {line}")),
        }
    }
}

/// Healthy: the liveness lease holds (reliable fetch); with basic fetch, which has no lease,
/// a beat answered within two intervals (the same test as /health).
fn health(worker: &Worker) -> Result<(), &'static str> {
    if !worker.liveness.is_live() {
        return Err("liveness lease lapsed");
    }
    let two_beats = worker.config.beat_interval.as_millis() as i64 * 2;
    if !worker.liveness.is_kept() && !worker.metrics.healthy(two_beats) {
        return Err("Redis unanswered for two beats");
    }
    Ok(())
}

/// `running: busy 2/5, Redis redis://127.0.0.1:6379/0` (the primary, behind sentinels).
fn status_line(worker: &Worker) -> String {
    let state = worker.shutdown.state();
    let mode = match (state.stopping, state.quiet) {
        (true, _) => "stopping",
        (false, true) => "quiet",
        _ => "running",
    };
    let redis = worker
        .conn
        .primary()
        .unwrap_or_else(|| crate::connections::redact::url(&worker.config.redis_url));
    format!(
        "{mode}: busy {}/{}, Redis {redis}",
        worker.slots.busy(),
        worker.config.concurrency
    )
}

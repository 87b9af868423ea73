//! OpenTelemetry traces, on when an OTLP endpoint is set (`export.rs`; docs/deploy.md,
//! "Traces"): a consumer span per job, child of its payload's `traceparent` (`job.rs`), a span
//! per phase of a cycle with the lock's acquire, renew and release as events (`cycle.rs`), the
//! current span handed to a command in `TRACEPARENT`/`TRACESTATE` and to a pushed job in its
//! `traceparent`/`tracestate` (`carrier.rs`). Off, the one cost on a job's path is `on()`, a
//! load of a static. Touches no Redis keys.

mod carrier;
mod cycle;
mod export;
mod gate;
mod http;
mod job;

pub(crate) use carrier::{command_env, inject};
pub(crate) use cycle::{carry, lock_event, phase, PhaseNames};
pub(crate) use gate::{dropped, failed_exports};
pub(crate) use job::{job_outcome, job_span, publish, within, JobNames};

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};
use std::sync::OnceLock;
use std::time::Duration;

static PROVIDER: OnceLock<(SdkTracerProvider, SdkTracer)> = OnceLock::new();

/// Start exporting if the environment asks for it (once per process; later calls do
/// nothing). `service`: the service name unless `OTEL_SERVICE_NAME` gives one.
pub(crate) fn start(service: &str) {
    if PROVIDER.get().is_some() {
        return;
    }
    if let Some(p) = export::provider(service) {
        let tracer = p.tracer("playguard");
        let _ = PROVIDER.set((p, tracer));
    }
}

/// Whether spans are made at all.
#[inline]
pub(crate) fn on() -> bool {
    PROVIDER.get().is_some()
}

fn tracer() -> Option<&'static SdkTracer> {
    PROVIDER.get().map(|(_, t)| t)
}

/// Send what is still queued, for at most `bound` (a dead collector must not hold up a stop).
/// Blocking: the SDK's shutdown waits for its batch thread, so it runs on a thread of its own.
pub(crate) fn stop(bound: Duration) {
    let Some((p, _)) = PROVIDER.get() else { return };
    let p = p.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    let _ = std::thread::Builder::new()
        .name("trace-flush".into())
        .spawn(move || {
            let _ = tx.send(p.shutdown_with_timeout(bound));
        });
    match rx.recv_timeout(bound + Duration::from_millis(200)) {
        Ok(Err(e)) => tracing::debug!(error = %e, "traces: the last spans were not all sent"),
        Ok(Ok(())) => {}
        Err(_) => tracing::debug!("traces: the flush at stop ran out of time"),
    }
}

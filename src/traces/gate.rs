//! The bound between the jobs and the exporter: at most `max` finished spans wait for export;
//! past it a span is dropped and counted (`dropped`, the `playguard_trace_spans_dropped_total`
//! series of `metrics/prometheus.rs`). The SDK's batch processor does the batching and keeps
//! a bound of its own, but its drop count is private: this gate counts first, holding no more
//! spans than the processor's queue takes, so the processor itself never drops one. A span's
//! end is a counter increment and a channel send: no job waits on a collector. Failed exports
//! are counted too (`playguard_trace_exports_failed_total`) and said in a line when exports
//! start or stop failing. Touches no Redis keys.

use opentelemetry::Context;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{BatchSpanProcessor, Span, SpanData, SpanExporter, SpanProcessor};
use opentelemetry_sdk::Resource;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Spans dropped because the export queue was full, since the start.
static DROPPED: AtomicU64 = AtomicU64::new(0);
/// Export requests that failed (refused, timed out, answered with an error), since the start.
static FAILED: AtomicU64 = AtomicU64::new(0);
/// Whether the last export failed: a line when that changes, not one per batch.
static FAILING: AtomicBool = AtomicBool::new(false);

pub(crate) fn dropped() -> u64 {
    DROPPED.load(Ordering::Relaxed)
}

pub(crate) fn failed_exports() -> u64 {
    FAILED.load(Ordering::Relaxed)
}

/// One export's result, said once per change between failing and working. The SDK's own
/// diagnostics are off (no `internal-logs`), so this is the only word of a dead collector.
fn note(r: &OTelSdkResult, spans: usize) {
    match r {
        Err(e) => {
            FAILED.fetch_add(1, Ordering::Relaxed);
            if !FAILING.swap(true, Ordering::Relaxed) {
                // The error may name the endpoint: passwords in it are hidden.
                let error = crate::connections::redact::url(&e.to_string());
                tracing::warn!(%error, spans, "traces: export failed (the spans of a failed export are lost; said again only once it works)");
            }
        }
        Ok(()) => {
            if FAILING.swap(false, Ordering::Relaxed) {
                tracing::info!("traces: export works again");
            }
        }
    }
}

#[derive(Debug)]
pub(super) struct Gate {
    inner: BatchSpanProcessor,
    waiting: Arc<AtomicUsize>,
    max: usize,
}

impl Gate {
    /// `build` makes the batch processor around the counting exporter it is handed.
    pub(super) fn new<E: SpanExporter + 'static>(
        exporter: E,
        max: usize,
        build: impl FnOnce(Counted<E>) -> BatchSpanProcessor,
    ) -> Gate {
        let waiting = Arc::new(AtomicUsize::new(0));
        let counted = Counted {
            inner: exporter,
            waiting: waiting.clone(),
        };
        Gate {
            inner: build(counted),
            waiting,
            max,
        }
    }
}

impl SpanProcessor for Gate {
    fn on_start(&self, span: &mut Span, cx: &Context) {
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        if self.waiting.fetch_add(1, Ordering::Relaxed) >= self.max {
            self.waiting.fetch_sub(1, Ordering::Relaxed);
            DROPPED.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.inner.on_end(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// The exporter, telling the gate how many spans left the queue with each batch (sent or
/// not: a failed batch is gone too).
#[derive(Debug)]
pub(super) struct Counted<E> {
    inner: E,
    waiting: Arc<AtomicUsize>,
}

impl<E: SpanExporter> SpanExporter for Counted<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let n = batch.len();
        let r = self.inner.export(batch).await;
        self.waiting.fetch_sub(n, Ordering::Relaxed);
        note(&r, n);
        r
    }

    fn shutdown_with_timeout(&mut self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&mut self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

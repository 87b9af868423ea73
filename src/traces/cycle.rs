//! A cycle in the trace: one span per phase, child of the job's span, and the lock's
//! acquire, renew and release as events (with the fence) on the span current when they
//! happen (the job's). A command a phase runs gets the phase's span (`carrier.rs`). Touches
//! no Redis keys.

use opentelemetry::context::FutureExt as _;
use opentelemetry::trace::{Status, TraceContextExt, Tracer as _};
use opentelemetry::{Context, KeyValue};
use std::future::Future;

/// Where a phase stands in its cycle, as its span carries it.
pub(crate) struct PhaseNames<'a> {
    pub phase: &'a str,
    pub lock_key: &'a str,
    pub fence: i64,
    /// 1-based step, and the number of phases.
    pub step: (usize, usize),
}

/// `fut` (the phase's run) inside a span of its own; `failed` says what went wrong from its
/// end (None: it went well). Without tracing, `fut` as it is.
pub(crate) async fn phase<F: Future>(
    names: PhaseNames<'_>,
    fut: F,
    failed: impl FnOnce(&F::Output) -> Option<String>,
) -> F::Output {
    let Some(tracer) = super::tracer() else {
        return fut.await;
    };
    let parent = Context::current();
    let span = tracer
        .span_builder(format!("phase {}", names.phase))
        .with_attributes(vec![
            KeyValue::new("playguard.phase", names.phase.to_string()),
            KeyValue::new("playguard.lock.key", names.lock_key.to_string()),
            KeyValue::new("playguard.lock.fence", names.fence),
            KeyValue::new("playguard.phase.step", names.step.0 as i64),
            KeyValue::new("playguard.phase.of", names.step.1 as i64),
        ])
        .start_with_context(tracer, &parent);
    let cx = parent.with_span(span);
    let out = fut.with_context(cx.clone()).await;
    if let Some(why) = failed(&out) {
        cx.span().set_status(Status::error(why));
    }
    cx.span().end();
    out
}

/// A future a phase hands to a task of its own, with the current context (the phase's span).
pub(crate) fn carry<F: Future>(fut: F) -> opentelemetry::context::WithContext<F> {
    fut.with_current_context()
}

/// A lock event (`lock acquired`, `lock renewed`, `lock released`, ...) on the current span.
pub(crate) fn lock_event(name: &'static str, lock_key: &str, fence: i64) {
    if !super::on() {
        return;
    }
    Context::current().span().add_event(
        name,
        vec![
            KeyValue::new("playguard.lock.key", lock_key.to_string()),
            KeyValue::new("playguard.lock.fence", fence),
        ],
    );
}

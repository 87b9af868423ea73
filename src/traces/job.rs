//! A job's span, named and attributed as opentelemetry-instrumentation-sidekiq's server
//! middleware names its own (`<queue> process`, kind consumer, `messaging.*`), with the
//! payload's retry count, and the error recorded as that middleware records an exception.
//! Touches no Redis keys.

use opentelemetry::context::FutureExt as _;
use opentelemetry::trace::{SpanKind, Status, TraceContextExt, Tracer as _};
use opentelemetry::{Context, KeyValue};

/// The job's names as its span carries them.
pub(crate) struct JobNames<'a> {
    pub queue: &'a str,
    pub jid: &'a str,
    /// `wrapped`, else `class` (the middleware's `messaging.sidekiq.job_class`).
    pub class: &'a str,
    pub retry_count: Option<i64>,
}

/// The job's span started, as the context its run is polled in; None with tracing off.
/// `raw`: the payload, where the parent's `traceparent` is read.
pub(crate) fn job_span(names: JobNames<'_>, raw: &str) -> Option<Context> {
    let tracer = super::tracer()?;
    let parent = super::carrier::parent_of(raw);
    let mut attributes = vec![
        KeyValue::new("messaging.system", "sidekiq"),
        KeyValue::new("messaging.operation", "process"),
        KeyValue::new("messaging.message_id", names.jid.to_string()),
        KeyValue::new("messaging.destination.name", names.queue.to_string()),
        KeyValue::new("messaging.sidekiq.job_class", names.class.to_string()),
    ];
    if let Some(n) = names.retry_count {
        attributes.push(KeyValue::new("messaging.sidekiq.retry_count", n));
    }
    let span = tracer
        .span_builder(format!("{} process", names.queue))
        .with_kind(SpanKind::Consumer)
        .with_attributes(attributes)
        .start_with_context(tracer, &parent);
    Some(parent.with_span(span))
}

/// `fut` polled with `cx` as the current context (its phases and commands see the span).
pub(crate) fn within<F: std::future::Future>(
    cx: Context,
    fut: F,
) -> opentelemetry::context::WithContext<F> {
    fut.with_context(cx)
}

/// The run's end on the current span: the failure as an exception event and an error status
/// (None: done, or handed back). Ends the span, as the middleware's does when perform returns.
pub(crate) fn job_outcome(failure: Option<(&str, &str)>) {
    let cx = Context::current();
    let span = cx.span();
    if let Some((class, message)) = failure {
        span.add_event(
            "exception",
            vec![
                KeyValue::new("exception.type", class.to_string()),
                KeyValue::new("exception.message", message.to_string()),
            ],
        );
        span.set_status(Status::error(format!(
            "Unhandled exception of type: {class}"
        )));
    }
    span.end();
}

/// `fut` (a push: `playguard enqueue`, a periodic tick) inside a producer span, as the Ruby
/// client middleware's `<queue> publish`, so what it pushes carries that span (`inject`).
/// Without tracing, `fut` as it is.
pub(crate) async fn publish<F: std::future::Future>(queue: &str, fut: F) -> F::Output {
    let Some(tracer) = super::tracer() else {
        return fut.await;
    };
    let span = tracer
        .span_builder(format!("{queue} publish"))
        .with_kind(SpanKind::Producer)
        .with_attributes(vec![
            KeyValue::new("messaging.system", "sidekiq"),
            KeyValue::new("messaging.operation", "publish"),
            KeyValue::new("messaging.destination.name", queue.to_string()),
        ])
        .start(tracer);
    let cx = Context::current_with_span(span);
    let out = fut.with_context(cx.clone()).await;
    cx.span().end();
    out
}

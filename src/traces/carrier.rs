//! W3C trace context in and out: read from a payload's top-level `traceparent`/`tracestate`
//! (where the Ruby client middleware of opentelemetry-instrumentation-sidekiq writes them),
//! written into a payload playguard pushes, and into a command's environment as
//! `TRACEPARENT`/`TRACESTATE` (OpenTelemetry's environment-variable carrier), always from the
//! current span. A malformed `traceparent` is a debug line and a root span, never a failure.
//! Touches no Redis keys.

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::TraceContextExt;
use opentelemetry::Context;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use serde_json::{Map, Value};
use std::collections::HashMap;

const FIELDS: [&str; 2] = ["traceparent", "tracestate"];

/// The two fields, read from the payload's top level (nothing else is kept).
#[derive(serde::Deserialize)]
struct Fields {
    traceparent: Option<Value>,
    tracestate: Option<Value>,
}

/// The parent a job's span gets from its payload (`raw`, a JSON object): its `traceparent`,
/// or none (a root span). A payload that never names the key is not parsed again: the
/// whole-object parse cost some 10,000 instructions per job (bench/profile.sh).
pub(super) fn parent_of(raw: &str) -> Context {
    if !raw.contains("\"traceparent\"") {
        return Context::new();
    }
    let Ok(fields) = serde_json::from_str::<Fields>(raw) else {
        return Context::new();
    };
    let mut carrier = HashMap::new();
    for (k, v) in [
        ("traceparent", fields.traceparent),
        ("tracestate", fields.tracestate),
    ] {
        match v {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => {
                carrier.insert(k.to_string(), s);
            }
            Some(v) => tracing::debug!("ignoring the payload's {k}: {v} is not a string"),
        }
    }
    let Some(tp) = carrier.get("traceparent").cloned() else {
        return Context::new();
    };
    let cx = TraceContextPropagator::new().extract(&carrier);
    if !cx.span().span_context().is_valid() {
        tracing::debug!(traceparent = %tp, "ignoring the payload's malformed traceparent: the job's span is a root");
        return Context::new();
    }
    cx
}

/// The current span's `traceparent` and `tracestate` (none outside a span, or with tracing off).
fn current() -> HashMap<String, String> {
    let mut out = HashMap::new();
    if super::on() {
        let cx = Context::current();
        if cx.span().span_context().is_valid() {
            TraceContextPropagator::new().inject_context(&cx, &mut out);
        }
    }
    out
}

/// A payload being built carries the current span as the Ruby client's middleware would
/// write it (nothing with tracing off).
pub(crate) fn inject(msg: &mut Map<String, Value>) {
    if !super::on() {
        return;
    }
    let mut fields = current();
    for k in FIELDS {
        if let Some(v) = fields.remove(k).filter(|v| !v.is_empty()) {
            msg.insert(k.to_string(), Value::String(v));
        }
    }
}

/// A command's environment gets the current span (the job's, or the phase's in a cycle), so
/// the command's own spans join the trace. Any TRACEPARENT of the worker's own environment
/// is replaced (ours are set on top of the inherited ones).
pub(crate) fn command_env(env: &mut Vec<(String, String)>) {
    if !super::on() {
        return;
    }
    let mut fields = current();
    for k in FIELDS {
        if let Some(v) = fields.remove(k).filter(|v| !v.is_empty()) {
            env.push((k.to_ascii_uppercase(), v));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(v: Value) -> String {
        v.to_string()
    }

    #[test]
    fn a_valid_traceparent_is_the_parent() {
        let m = msg(serde_json::json!({
            "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "tracestate": "congo=t61rcWkgMzE",
        }));
        let cx = parent_of(&m);
        let sc = cx.span().span_context().clone();
        assert_eq!(
            sc.trace_id().to_string(),
            "0af7651916cd43dd8448eb211c80319c"
        );
        assert_eq!(sc.span_id().to_string(), "b7ad6b7169203331");
        assert!(sc.is_remote() && sc.is_sampled());
        assert_eq!(sc.trace_state().get("congo"), Some("t61rcWkgMzE"));
    }

    #[test]
    fn a_malformed_or_odd_traceparent_gives_a_root() {
        for v in [
            serde_json::json!({"traceparent": "00-not-a-trace-01"}),
            serde_json::json!({"traceparent": "00-00000000000000000000000000000000-b7ad6b7169203331-01"}),
            serde_json::json!({"traceparent": 42}),
            serde_json::json!({"tracestate": "a=b"}),
            serde_json::json!({}),
        ] {
            let cx = parent_of(&msg(v.clone()));
            assert!(!cx.span().span_context().is_valid(), "{v}");
        }
    }
}

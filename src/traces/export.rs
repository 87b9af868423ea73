//! Whether traces leave at all, and the exporter behind them: OTLP over HTTP/protobuf to
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (`/v1/traces` appended) or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`
//! (as is), with the crate reading `OTEL_EXPORTER_OTLP_HEADERS`, the SDK `OTEL_TRACES_SAMPLER`
//! (and `_ARG`), `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES` and `OTEL_BSP_*`. Header values
//! (API keys) are never logged. Touches no Redis keys.

use super::gate::Gate;
use super::http::Ureq;
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::trace::{BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider};
use opentelemetry_sdk::Resource;
use std::time::Duration;

/// The OTLP variable that turns tracing on, and the endpoint it names.
fn endpoint() -> Option<(&'static str, String)> {
    [
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
    ]
    .into_iter()
    .find_map(|k| Some((k, var(k)?)))
}

fn var(k: &str) -> Option<String> {
    std::env::var(k).ok().filter(|v| !v.trim().is_empty())
}

/// The provider, or None: no endpoint, tracing switched off, or a protocol we do not speak
/// (said once, at start; the worker runs on without traces).
pub(super) fn provider(service: &str) -> Option<SdkTracerProvider> {
    let (name, url) = endpoint()?;
    if var("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true"))
        || var("OTEL_TRACES_EXPORTER").is_some_and(|v| v.eq_ignore_ascii_case("none"))
    {
        return None;
    }
    let protocol = [
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ]
    .into_iter()
    .find_map(var);
    if let Some(p) = protocol.filter(|p| p != "http/protobuf") {
        tracing::warn!(protocol = %p, "traces not exported: playguard speaks OTLP over http/protobuf only (set OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf and the collector's HTTP port, 4318)");
        return None;
    }
    let timeout = [
        "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
        "OTEL_EXPORTER_OTLP_TIMEOUT",
    ]
    .into_iter()
    .find_map(|k| var(k)?.parse().ok())
    .map_or(Duration::from_secs(10), Duration::from_millis);
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(Ureq::new(timeout))
        .with_timeout(timeout)
        .build();
    let exporter = match exporter {
        Ok(e) => e,
        Err(e) => {
            let url = crate::connections::redact::url(&url);
            tracing::warn!(error = %e, %url, "traces not exported: {name} is not usable");
            return None;
        }
    };
    let config = BatchConfigBuilder::default().build();
    let max = queue_size();
    let gate = Gate::new(exporter, max, |counted| {
        BatchSpanProcessor::builder(counted)
            .with_batch_config(config)
            .build()
    });
    let resource = match var("OTEL_SERVICE_NAME") {
        Some(_) => Resource::builder().build(),
        None if var("OTEL_RESOURCE_ATTRIBUTES").is_some_and(|a| a.contains("service.name=")) => {
            Resource::builder().build()
        }
        None => Resource::builder()
            .with_service_name(service.to_string())
            .build(),
    };
    tracing::info!(endpoint = %crate::connections::redact::url(&url), queue = max, "traces exported over OTLP/HTTP");
    Some(
        SdkTracerProvider::builder()
            .with_span_processor(gate)
            .with_resource(resource)
            .build(),
    )
}

/// `OTEL_BSP_MAX_QUEUE_SIZE` (the SDK reads the same variable for its own queue), 2,048 by
/// default as there.
fn queue_size() -> usize {
    var("OTEL_BSP_MAX_QUEUE_SIZE")
        .and_then(|v| v.parse().ok())
        .filter(|n| *n > 0)
        .unwrap_or(2048)
}

//! Log setup: one line per event on stdout, UTC timestamps, the pid on every line;
//! `--log-format json` for log shippers, with every field (the span fields pid, jid, class,
//! queue, phase included) at the top level of one flat object. RUST_LOG filters as usual
//! (default `info`). Touches no Redis keys.

use serde_json::{Map, Value};
use std::fmt;
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::{JsonFields, Writer};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::EnvFilter;

/// One flat JSON object per event: timestamp, level, the fields of every enclosing span
/// (outermost first), then the event's own fields, `message` included.
struct FlatJson;

struct JsonVisitor<'a>(&'a mut Map<String, Value>);

impl Visit for JsonVisitor<'_> {
    fn record_f64(&mut self, f: &Field, v: f64) {
        self.0.insert(
            f.name().into(),
            serde_json::Number::from_f64(v)
                .map(Value::Number)
                .unwrap_or(Value::Null),
        );
    }
    fn record_i64(&mut self, f: &Field, v: i64) {
        self.0.insert(f.name().into(), Value::from(v));
    }
    fn record_u64(&mut self, f: &Field, v: u64) {
        self.0.insert(f.name().into(), Value::from(v));
    }
    fn record_bool(&mut self, f: &Field, v: bool) {
        self.0.insert(f.name().into(), Value::from(v));
    }
    fn record_str(&mut self, f: &Field, v: &str) {
        self.0.insert(f.name().into(), Value::from(v));
    }
    fn record_debug(&mut self, f: &Field, v: &dyn fmt::Debug) {
        self.0
            .insert(f.name().into(), Value::from(format!("{v:?}")));
    }
}

impl<S, N> FormatEvent<S, N> for FlatJson
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut w: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let mut map = Map::new();
        let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
        map.insert("timestamp".into(), Value::from(now));
        map.insert(
            "level".into(),
            Value::from(event.metadata().level().as_str()),
        );
        if let Some(scope) = ctx.event_scope() {
            for span in scope.from_root() {
                let ext = span.extensions();
                // With JsonFields, a span's recorded fields are kept as a JSON object string.
                if let Some(f) = ext.get::<FormattedFields<N>>() {
                    if let Ok(Value::Object(fields)) = serde_json::from_str::<Value>(&f.fields) {
                        map.extend(fields);
                    }
                }
            }
        }
        event.record(&mut JsonVisitor(&mut map));
        writeln!(w, "{}", Value::Object(map))
    }
}

/// Install the subscriber. Keep the returned guard alive until exit: dropping it flushes the
/// lines still queued for the writer thread.
pub fn init(json: bool) -> tracing_appender::non_blocking::WorkerGuard {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    // The writer thread flushes whenever its queue runs dry, so lines still appear at once
    // when idle. Not lossy: a full queue makes the logger wait rather than drop lines.
    let (writer, guard) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .lossy(false)
        .finish(std::io::BufWriter::with_capacity(
            64 * 1024,
            std::io::stdout(),
        ));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        // The default timer prints RFC 3339 in UTC.
        .with_writer(writer);
    let r = if json {
        builder
            .fmt_fields(JsonFields::new())
            .event_format(FlatJson)
            .try_init()
    } else {
        builder.with_ansi(false).try_init()
    };
    let _ = r;
    guard
}

static ROOT: std::sync::OnceLock<tracing::Span> = std::sync::OnceLock::new();

/// The root span every line carries, so each shows `pid=`. Spawned tasks are instrumented
/// with it (or with a job span under it), since tokio tasks do not inherit spans.
pub fn root() -> &'static tracing::Span {
    ROOT.get_or_init(|| tracing::info_span!("playguard", pid = std::process::id()))
}

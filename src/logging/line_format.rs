//! The two line formats: flat JSON (every span's fields and the event's at the top level of
//! one object) and the fast text layout (tracing-subscriber's default, at a fraction of its
//! cost). Touches no Redis keys.

use super::{journal, timestamp, ROOT_NAME};
use serde_json::{Map, Value};
use std::fmt;
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields};
use tracing_subscriber::registry::{LookupSpan, SpanRef};

/// How each log line is written.
pub(super) enum LineFormat {
    /// One flat JSON object per event: timestamp, level, the fields of every enclosing span
    /// (outermost first), then the event's own fields, `message` included.
    FlatJson,
    /// Plain text, the same layout as tracing-subscriber's default (`Full`, no ANSI, no
    /// target): `2026-01-02T03:04:05.678901Z  INFO playguard{pid=7}:job{jid=… class=…
    /// queue=…}: done elapsed_ms=0.1`, at a fraction of its cost per line: the date and time
    /// up to the second are formatted once per second per thread, and no styling wrappers are
    /// formatted at all. Two lines per job are the price of Sidekiq's start/done lines, so
    /// every line counts.
    FastText,
}

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

/// Both line formats through one `FormatEvent`: the span fields are read the same way, only
/// the writing differs.
impl<S, N> FormatEvent<S, N> for LineFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        w: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        match self {
            LineFormat::FlatJson => write_json_line(ctx, w, event),
            LineFormat::FastText => write_text_line(ctx, w, event),
        }
    }
}

/// `LineFormat::FlatJson`: the event as one flat JSON object on a line.
fn write_json_line<S, N>(
    ctx: &FmtContext<'_, S, N>,
    mut w: Writer<'_>,
    event: &Event<'_>,
) -> fmt::Result
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    w.write_str(journal::prefix(*event.metadata().level()))?;
    let mut map = Map::new();
    let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
    map.insert("timestamp".into(), Value::from(now));
    map.insert(
        "level".into(),
        Value::from(event.metadata().level().as_str()),
    );
    let mut spans = spans_from_root(ctx);
    let root = spans.next_if(|s| s.metadata().name() == ROOT_NAME);
    // With JsonFields, a span's recorded fields are kept as a JSON object string.
    let add = |map: &mut Map<String, Value>, span: &SpanRef<'_, S>| {
        if let Some(f) = span.extensions().get::<FormattedFields<N>>() {
            if let Ok(Value::Object(fields)) = serde_json::from_str::<Value>(&f.fields) {
                map.extend(fields);
            }
        }
    };
    if let Some(root) = &root {
        add(&mut map, root);
    }
    crate::logging::scope::with_current(|t| {
        if let Some(t) = t {
            for (k, v) in [("jid", &t.jid), ("class", &t.class), ("queue", &t.queue)] {
                map.insert(k.into(), Value::from(&**v));
            }
        }
    });
    for span in spans {
        add(&mut map, &span);
    }
    event.record(&mut JsonVisitor(&mut map));
    writeln!(w, "{}", Value::Object(map))
}

/// `LineFormat::FastText`: the event as tracing-subscriber's default text line.
fn write_text_line<S, N>(
    ctx: &FmtContext<'_, S, N>,
    mut w: Writer<'_>,
    event: &Event<'_>,
) -> fmt::Result
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    w.write_str(journal::prefix(*event.metadata().level()))?;
    timestamp::write_timestamp(&mut w)?;
    w.write_str(match *event.metadata().level() {
        tracing::Level::ERROR => " ERROR ",
        tracing::Level::WARN => "  WARN ",
        tracing::Level::INFO => "  INFO ",
        tracing::Level::DEBUG => " DEBUG ",
        tracing::Level::TRACE => " TRACE ",
    })?;
    let mut spans = spans_from_root(ctx);
    let root = spans.next_if(|s| s.metadata().name() == ROOT_NAME);
    let write = |w: &mut Writer<'_>, span: &SpanRef<'_, S>| -> fmt::Result {
        w.write_str(span.metadata().name())?;
        if let Some(f) = span.extensions().get::<FormattedFields<N>>() {
            if !f.fields.is_empty() {
                w.write_char('{')?;
                w.write_str(&f.fields)?;
                w.write_char('}')?;
            }
        }
        w.write_char(':')
    };
    let mut seen = root.is_some();
    if let Some(root) = &root {
        write(&mut w, root)?;
    }
    crate::logging::scope::with_current(|t| -> fmt::Result {
        if let Some(t) = t {
            seen = true;
            for part in [
                "job{jid=", &t.jid, " class=", &t.class, " queue=", &t.queue, "}:",
            ] {
                w.write_str(part)?;
            }
        }
        Ok(())
    })?;
    for span in spans {
        write(&mut w, &span)?;
        seen = true;
    }
    if seen {
        w.write_char(' ')?;
    }
    ctx.format_fields(w.by_ref(), event)?;
    w.write_char('\n')
}

/// The event's spans, outermost first. Both formats write the job's context (scope.rs)
/// where a `job` span under the root would be: after the root span, before any inner one.
fn spans_from_root<'a, S, N>(
    ctx: &'a FmtContext<'_, S, N>,
) -> std::iter::Peekable<impl Iterator<Item = SpanRef<'a, S>>>
where
    S: Subscriber + for<'l> LookupSpan<'l>,
    N: for<'w> FormatFields<'w> + 'static,
{
    ctx.event_scope()
        .into_iter()
        .flat_map(|scope| scope.from_root())
        .peekable()
}

/// Text fields as tracing-subscriber's default visitor writes them (`message` bare, the others
/// `name=value` with the value's Debug, separated by spaces, an error with its sources), minus
/// the styling wrappers it formats even with ANSI off. Span fields are formatted with it once,
/// when the span opens.
pub(super) struct FastFields;

impl<'w> FormatFields<'w> for FastFields {
    fn format_fields<R: tracing_subscriber::field::RecordFields>(
        &self,
        w: Writer<'w>,
        fields: R,
    ) -> fmt::Result {
        let mut v = TextVisitor {
            w,
            first: true,
            result: Ok(()),
        };
        fields.record(&mut v);
        v.result
    }
}

struct TextVisitor<'w> {
    w: Writer<'w>,
    first: bool,
    result: fmt::Result,
}

impl Visit for TextVisitor<'_> {
    fn record_str(&mut self, f: &Field, v: &str) {
        self.record_debug(f, &v)
    }

    fn record_error(&mut self, f: &Field, v: &(dyn std::error::Error + 'static)) {
        match v.source() {
            Some(_) => {
                let mut sources = Vec::new();
                let mut s = v.source();
                while let Some(e) = s {
                    sources.push(e.to_string());
                    s = e.source();
                }
                self.record_debug(
                    f,
                    &format_args!("{v} {}.sources=[{}]", f.name(), sources.join(", ")),
                )
            }
            None => self.record_debug(f, &format_args!("{v}")),
        }
    }

    fn record_debug(&mut self, f: &Field, v: &dyn fmt::Debug) {
        if self.result.is_err() {
            return;
        }
        // The fixed parts go in as plain strings: only the value needs the formatter.
        let w = &mut self.w;
        let pad = if self.first { "" } else { " " };
        self.first = false;
        let name = f.name();
        self.result = (|| {
            w.write_str(pad)?;
            if name != "message" {
                w.write_str(name.strip_prefix("r#").unwrap_or(name))?;
                w.write_char('=')?;
            }
            write!(w, "{v:?}")
        })();
    }
}

//! Log setup: one line per event on stdout, UTC timestamps, the pid on every line;
//! `--log-format json` for log shippers, with every field (the span fields pid, jid, class,
//! queue, phase included) at the top level of one flat object. RUST_LOG filters as usual
//! (default `info`). Touches no Redis keys.

pub mod job_lines;
pub mod journal;
pub mod scope;
#[cfg(test)]
pub mod test_lines;
pub mod timestamp;
pub mod writer;

mod line_format;

use line_format::{FastFields, LineFormat};
use tracing_subscriber::fmt::format::JsonFields;
use tracing_subscriber::EnvFilter;

/// `--log-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// One line per event: timestamp, level, pid, fields, message.
    #[default]
    Text,
    /// One flat JSON object per line, for log shippers.
    Json,
}

/// Install the subscriber. Keep the returned guard alive until exit: dropping it flushes the
/// lines still buffered for the writer thread.
pub fn init(format: LogFormat) -> crate::logging::writer::Guard {
    let json = format == LogFormat::Json;
    journal::detect();
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let (writer, guard) = crate::logging::writer::start(std::io::stdout());
    if !json {
        crate::logging::job_lines::write_to(writer.clone());
    }
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        // The default timer prints RFC 3339 in UTC.
        .with_writer(writer);
    let r = if json {
        builder
            .fmt_fields(JsonFields::new())
            .event_format(LineFormat::FlatJson)
            .try_init()
    } else {
        builder
            .with_ansi(false)
            .fmt_fields(FastFields)
            .event_format(LineFormat::FastText)
            .try_init()
    };
    let _ = r;
    guard
}

static ROOT: std::sync::OnceLock<tracing::Span> = std::sync::OnceLock::new();
/// The root span's name: a job's context is written right after it.
const ROOT_NAME: &str = "playguard";

/// The root span every line carries, so each shows `pid=`. Spawned tasks are instrumented
/// with it (a job's context is its scope, `scope.rs`), since tokio tasks do not inherit spans.
/// At ERROR level: a span is kept only where its level passes the filter, and the pid must
/// be on a quiet worker's warnings too.
pub fn root() -> &'static tracing::Span {
    ROOT.get_or_init(|| tracing::error_span!(ROOT_NAME, pid = std::process::id()))
}

#[cfg(test)]
mod format_tests;

//! Log setup: one line per event on stdout, UTC timestamps, the pid on every line;
//! `--log-format json` for log shippers. RUST_LOG filters as usual (default `info`).

use tracing_subscriber::EnvFilter;

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
            .json()
            .flatten_event(true)
            // The span list carries pid, jid, class, queue and phase; one copy is enough.
            .with_current_span(false)
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

//! Log setup: one line per event on stdout, UTC timestamps, the pid on every line;
//! `--log-format json` for log shippers. RUST_LOG filters as usual (default `info`).

use tracing_subscriber::EnvFilter;

pub fn init(json: bool) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        // The default timer prints RFC 3339 in UTC.
        .with_writer(std::io::stdout);
    let r = if json {
        builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .try_init()
    } else {
        builder.with_ansi(false).try_init()
    };
    let _ = r;
}

static ROOT: std::sync::OnceLock<tracing::Span> = std::sync::OnceLock::new();

/// The root span every line carries, so each shows `pid=`. Spawned tasks are instrumented
/// with it (or with a job span under it), since tokio tasks do not inherit spans.
pub fn root() -> &'static tracing::Span {
    ROOT.get_or_init(|| tracing::info_span!("playguard", pid = std::process::id()))
}

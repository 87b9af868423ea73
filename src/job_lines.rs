//! A job's `start` and `done` lines, the two lines every job logs at INFO (as Sidekiq's
//! JobLogger does), written straight to the log writer in the text format, byte for byte the
//! line tracing's formatter would write inside a `job` span. Why: through tracing each such
//! event is dispatched, its span scope looked up and its fields visited and formatted, which
//! cost a quarter of a no-op job's instructions; here the context is formatted once per job
//! and each line is a timestamp plus two copies. With `--log-format json`, or when INFO is
//! filtered out for the processor, the lines go through tracing as any other. Touches no
//! Redis keys.

use std::fmt::Write as _;

static WRITER: std::sync::OnceLock<crate::log_writer::LineWriter> = std::sync::OnceLock::new();

/// Text format on: job lines go to this writer directly.
pub(crate) fn write_to(w: crate::log_writer::LineWriter) {
    let _ = WRITER.set(w);
}

/// One job's lines, its context (`playguard{pid=…}:job{jid=… class=… queue=…}: `) formatted
/// once for both.
pub(crate) struct JobLines {
    /// The prefix and the writer, in the text format with INFO on.
    direct: Option<(String, &'static crate::log_writer::LineWriter)>,
}

impl JobLines {
    /// Direct lines in the text format with INFO on; through tracing otherwise (JSON), or
    /// nothing to prepare (INFO filtered out). Either way the job's scope (`job_scope.rs`)
    /// gives other lines its context.
    pub fn open(tag: &crate::job_scope::JobTag) -> JobLines {
        let direct = match WRITER.get() {
            Some(w) if tracing::enabled!(target: "playguard::processor", tracing::Level::INFO) => {
                Some((prefix(tag), w))
            }
            _ => None,
        };
        JobLines { direct }
    }

    pub fn start(&self) {
        match &self.direct {
            Some((p, w)) => write_line(|b| w.append(b), p, "start", None),
            None => tracing::info!(target: "playguard::processor", "start"),
        }
    }

    pub fn done(&self, elapsed_ms: f64) {
        match &self.direct {
            Some((p, w)) => write_line(|b| w.append(b), p, "done", Some(elapsed_ms)),
            None => tracing::info!(target: "playguard::processor", elapsed_ms, "done"),
        }
    }
}

/// Built by appending, not with `format!`: the formatting machinery cost more per job than
/// the rest of both lines.
fn prefix(t: &crate::job_scope::JobTag) -> String {
    // Our pid never changes: formatted once.
    static PID: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let pid = PID.get_or_init(|| std::process::id().to_string());
    let parts = [
        "playguard{pid=",
        pid,
        "}:job{jid=",
        &t.jid,
        " class=",
        &t.class,
        " queue=",
        &t.queue,
        "}: ",
    ];
    let mut s = String::with_capacity(parts.iter().map(|p| p.len()).sum());
    for part in parts {
        s.push_str(part);
    }
    s
}

thread_local! {
    static LINE: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
}

/// One text line: timestamp, level, the job's prefix, the message and its field, as
/// `logging::LineFormat::FastText` lays them out (an f64 field as its Debug).
fn write_line(out: impl FnOnce(&[u8]), prefix: &str, msg: &str, elapsed_ms: Option<f64>) {
    LINE.with(|l| {
        let mut l = l.borrow_mut();
        l.clear();
        let _ = crate::logging::write_timestamp(&mut *l);
        l.push_str("  INFO ");
        l.push_str(prefix);
        l.push_str(msg);
        if let Some(ms) = elapsed_ms {
            let _ = write!(l, " elapsed_ms={ms:?}");
        }
        l.push('\n');
        out(l.as_bytes());
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_lines::{same_after_time, Buf};

    /// The direct lines are the lines tracing's default formatter writes in the job span,
    /// byte for byte after the timestamp.
    #[test]
    fn direct_lines_match_tracing_s_lines() {
        let theirs = Buf::default();
        let w = theirs.clone();
        let sub = tracing_subscriber::fmt()
            .with_target(false)
            .with_ansi(false)
            .with_writer(move || w.clone())
            .finish();
        tracing::subscriber::with_default(sub, || {
            let root = tracing::info_span!("playguard", pid = std::process::id());
            let _r = root.enter();
            let job = tracing::info_span!("job", jid = %"a1b2", class = %"Hard::Job", queue = %"q");
            let _j = job.enter();
            tracing::info!("start");
            tracing::info!(elapsed_ms = 0.1, "done");
            tracing::info!(elapsed_ms = 12.0, "done");
        });
        let ours = Buf::default();
        let add = |b: &[u8]| ours.0.lock().unwrap().extend_from_slice(b);
        let p = prefix(&crate::job_scope::JobTag {
            jid: "a1b2".into(),
            class: "Hard::Job".into(),
            queue: "q".into(),
        });
        write_line(add, &p, "start", None);
        write_line(add, &p, "done", Some(0.1));
        write_line(add, &p, "done", Some(12.0));
        let (ours, theirs) = (ours.text(), theirs.text());
        assert_eq!(ours.lines().count(), 3, "{ours}");
        same_after_time(&ours, &theirs);
    }
}

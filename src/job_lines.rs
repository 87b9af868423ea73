//! A job's `start` and `done` lines, the two lines every job logs at INFO (as Sidekiq's
//! JobLogger does), written straight to the log writer in the text format, byte for byte the
//! line tracing's formatter would write inside the job's span. Why: through tracing each such
//! event is dispatched, its span scope looked up and its fields visited and formatted, which
//! cost a quarter of a no-op job's instructions; here the span part is formatted once per job
//! and each line is a timestamp plus two copies. With `--log-format json`, or when INFO is
//! filtered out for the processor, the lines go through tracing as any other. Touches no
//! Redis keys.

use std::fmt::Write as _;

static WRITER: std::sync::OnceLock<crate::log_writer::LineWriter> = std::sync::OnceLock::new();

/// Text format on: job lines go to this writer directly.
pub(crate) fn write_to(w: crate::log_writer::LineWriter) {
    let _ = WRITER.set(w);
}

/// One job's context, formatted once: `playguard{pid=…}:job{jid=… class=… queue=…}: `.
pub(crate) struct JobLines {
    /// The prefix and the writer, in the text format with INFO on.
    direct: Option<(String, &'static crate::log_writer::LineWriter)>,
}

impl JobLines {
    /// The job's span (under the root span) and its lines. In the text format the span holds
    /// its three fields as one text field, written as is (`logging::JOB_FIELDS`), formatted
    /// here once for both; JSON keeps them as three fields.
    pub fn open(jid: &str, class: &str, queue: &str) -> (tracing::Span, JobLines) {
        let root = crate::logging::root();
        let Some(writer) = WRITER.get() else {
            let span = tracing::info_span!(target: "playguard::processor", parent: root, "job",
                jid = %jid, class = %class, queue = %queue);
            return (span, JobLines { direct: None });
        };
        // Quiet (INFO filtered out): nothing to format, no span.
        if !tracing::enabled!(target: "playguard::processor", tracing::Level::INFO) {
            return (tracing::Span::none(), JobLines { direct: None });
        }
        let fields = fields(jid, class, queue);
        let span = tracing::info_span!(target: "playguard::processor", parent: root, "job",
            playguard_job_fields = %fields);
        let direct = Some((prefix(&fields), writer));
        (span, JobLines { direct })
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
fn fields(jid: &str, class: &str, queue: &str) -> String {
    let mut s = String::with_capacity(24 + jid.len() + class.len() + queue.len());
    for part in ["jid=", jid, " class=", class, " queue=", queue] {
        s.push_str(part);
    }
    s
}

fn prefix(fields: &str) -> String {
    // Our pid never changes: formatted once.
    static PID: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let pid = PID.get_or_init(|| std::process::id().to_string());
    let mut s = String::with_capacity(24 + pid.len() + fields.len());
    for part in ["playguard{pid=", pid, "}:job{", fields, "}: "] {
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
        let p = prefix(&fields("a1b2", "Hard::Job", "q"));
        write_line(add, &p, "start", None);
        write_line(add, &p, "done", Some(0.1));
        write_line(add, &p, "done", Some(12.0));
        let (ours, theirs) = (ours.text(), theirs.text());
        assert_eq!(ours.lines().count(), 3, "{ours}");
        same_after_time(&ours, &theirs);
    }
}

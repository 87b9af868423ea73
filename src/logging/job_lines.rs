//! A job's `start` and `done` lines, the two lines every job logs at INFO (as Sidekiq's
//! JobLogger does), written straight to the log writer in the text format, byte for byte the
//! line tracing's formatter would write inside a `job` span. Why: through tracing each such
//! event is dispatched, its span scope looked up and its fields visited and formatted, which
//! cost a quarter of a no-op job's instructions; here the context is formatted once per job
//! and each line is a timestamp plus two copies. With `--log-format json`, or when INFO is
//! filtered out for the processor, the lines go through tracing as any other. Touches no
//! Redis keys.

use std::fmt::Write as _;

static WRITER: std::sync::OnceLock<crate::logging::writer::LineWriter> = std::sync::OnceLock::new();

/// Text format on: job lines go to this writer directly.
pub(crate) fn write_to(w: crate::logging::writer::LineWriter) {
    let _ = WRITER.set(w);
}

/// One job's lines, its context (`playguard{pid=…}:job{jid=… class=… queue=…}: `) formatted
/// once for both.
pub(crate) struct JobLines {
    /// The prefix and the writer, in the text format with INFO on.
    direct: Option<(String, &'static crate::logging::writer::LineWriter)>,
}

impl JobLines {
    /// Direct lines in the text format with INFO on; through tracing otherwise (JSON), or
    /// nothing to prepare (INFO filtered out). Either way the job's scope (`scope.rs`)
    /// gives other lines its context.
    pub fn open(tag: &crate::logging::scope::JobTag) -> JobLines {
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
fn prefix(t: &crate::logging::scope::JobTag) -> String {
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
        l.push_str(crate::logging::journal::prefix(tracing::Level::INFO));
        let _ = crate::logging::timestamp::write_timestamp(&mut *l);
        l.push_str("  INFO ");
        l.push_str(prefix);
        l.push_str(msg);
        if let Some(ms) = elapsed_ms {
            l.push_str(" elapsed_ms=");
            push_debug_f64(&mut l, ms);
        }
        l.push('\n');
        out(l.as_bytes());
    });
}

/// `ms` as its Debug (`{:?}`) writes it, without the float formatter for the value every job
/// has: a whole number of tenths (the processor rounds to 0.1 ms) below 2^53 tenths is its
/// integer part, a point and one digit, exactly the shortest spelling Debug picks (no other
/// decimal that short lies within half a unit of the last place). Anything else goes to Debug.
fn push_debug_f64(l: &mut String, ms: f64) {
    const EXACT_TENTHS: f64 = 9_007_199_254_740_992.0; // 2^53
    let tenths = (ms * 10.0).round();
    if ms.is_sign_negative() || !(0.0..EXACT_TENTHS).contains(&tenths) || tenths / 10.0 != ms {
        let _ = write!(l, "{ms:?}");
        return;
    }
    let tenths = tenths as u64;
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    let mut n = tenths / 10;
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    l.push_str(std::str::from_utf8(&digits[at..]).unwrap_or("0"));
    l.push('.');
    l.push(char::from(b'0' + (tenths % 10) as u8));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elapsed_ms_is_spelled_as_debug_spells_it() {
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut values = vec![0.0, 0.1, 0.5, 1.0, 9.9, 10.0, 12.3, 99.9, 100.0, 1e6 + 0.1];
        values.extend([
            -0.0,
            -1.5,
            0.05,
            0.123,
            1e16,
            1e300,
            f64::NAN,
            f64::INFINITY,
        ]);
        for _ in 0..100_000 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            // As the processor rounds: whole tenths of a millisecond, up to days.
            let secs = (rng % 10_000_000_000) as f64 / 1e6;
            values.push((secs * 10_000.0).round() / 10.0);
        }
        for ms in values {
            let mut ours = String::new();
            push_debug_f64(&mut ours, ms);
            assert_eq!(ours, format!("{ms:?}"), "{ms}");
        }
    }
    use crate::logging::test_lines::{same_after_time, Buf};

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
        let p = prefix(&crate::logging::scope::JobTag {
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

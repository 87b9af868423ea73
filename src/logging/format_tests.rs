//! The two line formats read back: fast text matches tracing's default format, and JSON lines
//! carry the job's fields at the top level in span order. Touches no Redis keys.

use super::*;
use crate::logging::test_lines::{same_after_time, Buf};
use serde_json::{Map, Value};

/// `scoped`: the job's context as ours is set (scope.rs); else as a `job` span, the
/// way tracing's own formatter is given it.
fn emit(scoped: bool) {
    let root = tracing::info_span!("playguard", pid = 7);
    let _r = root.enter();
    tracing::info!(queues = "default", "playguard starting");
    let (_scope, _span) = if scoped {
        (
            Some(crate::logging::scope::enter("a1b2", "Hard", "q")),
            None,
        )
    } else {
        let job = tracing::info_span!("job", jid = %"a1b2", class = %"Hard", queue = %"q");
        (None, Some(job.entered()))
    };
    tracing::info!("start");
    tracing::info!(elapsed_ms = 0.1, "done");
    tracing::warn!(error = %"boom", jobs = 3usize, ok = true, "acking failed; retrying");
    let e = std::io::Error::other("disk full");
    tracing::error!(
        error = &e as &(dyn std::error::Error + 'static),
        "could not write"
    );
    let phase = tracing::info_span!("phase", phase = "one");
    let _p = phase.enter();
    tracing::info!(stream = "stdout", "working \"quoted\"");
}

/// The text lines are tracing-subscriber's default layout, byte for byte after the time,
/// the job's context where a job span's fields would be (after the root's, before the
/// phase's).
#[test]
fn fast_text_matches_the_default_format() {
    let ours = Buf::default();
    let theirs = Buf::default();
    let w = ours.clone();
    let sub = tracing_subscriber::fmt()
        .with_target(false)
        .with_ansi(false)
        .fmt_fields(FastFields)
        .event_format(LineFormat::FastText)
        .with_writer(move || w.clone())
        .finish();
    tracing::subscriber::with_default(sub, || emit(true));
    let w = theirs.clone();
    let sub = tracing_subscriber::fmt()
        .with_target(false)
        .with_ansi(false)
        .with_writer(move || w.clone())
        .finish();
    tracing::subscriber::with_default(sub, || emit(false));
    let (ours, theirs) = (ours.text(), theirs.text());
    assert_eq!(ours.lines().count(), 6, "{ours}");
    assert!(
        ours.contains(
            "playguard{pid=7}:job{jid=a1b2 class=Hard queue=q}:phase{phase=\"one\"}: working"
        ),
        "{ours}"
    );
    for ta in same_after_time(&ours, &theirs) {
        assert!(chrono::DateTime::parse_from_rfc3339(ta).is_ok(), "{ta}");
        assert!(ta.ends_with('Z'));
    }
}

/// In JSON the job's fields sit with the span fields, in the same order as a job span's.
#[test]
fn json_lines_carry_the_job_fields_in_span_order() {
    let buf = Buf::default();
    let w = buf.clone();
    let sub = tracing_subscriber::fmt()
        .fmt_fields(JsonFields::new())
        .event_format(LineFormat::FlatJson)
        .with_writer(move || w.clone())
        .finish();
    tracing::subscriber::with_default(sub, || emit(true));
    let lines: Vec<Map<String, Value>> = buf
        .text()
        .lines()
        .map(|l| match serde_json::from_str(l).unwrap() {
            Value::Object(m) => m,
            v => panic!("{v}"),
        })
        .collect();
    assert_eq!(lines.len(), 6);
    assert!(!lines[0].contains_key("jid"), "{:?}", lines[0]);
    let keys: Vec<&str> = lines[5].keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        [
            "timestamp",
            "level",
            "pid",
            "jid",
            "class",
            "queue",
            "phase",
            "message",
            "stream"
        ]
    );
    assert_eq!(lines[5]["jid"], "a1b2");
}

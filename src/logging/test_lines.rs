//! Test helpers for the log line tests: a shared in-memory sink and the comparison of two
//! sets of lines after their timestamps. Touches no Redis keys.

use std::sync::{Arc, Mutex};

/// An in-memory writer; clones share the bytes.
#[derive(Clone, Default)]
pub(crate) struct Buf(pub Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Buf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Buf {
    pub fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }
}

/// Line by line, `ours` reads as `theirs` after the timestamp, and the timestamps have the
/// same length. Returns our timestamps.
pub(crate) fn same_after_time<'a>(ours: &'a str, theirs: &str) -> Vec<&'a str> {
    let mut times = Vec::new();
    for (a, b) in ours.lines().zip(theirs.lines()) {
        let (ta, ra) = a.split_once(' ').unwrap();
        let (tb, rb) = b.split_once(' ').unwrap();
        assert_eq!(ra, rb);
        assert_eq!(ta.len(), tb.len(), "{ta} vs {tb}");
        times.push(ta);
    }
    times
}

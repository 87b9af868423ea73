//! The journal's level prefix. Under systemd, stdout is often a stream socket to journald,
//! which reads a leading `<N>` (sd-daemon's syslog level) as the line's PRIORITY; without it
//! every line is PRIORITY=6 and `journalctl -p warning` finds nothing. systemd names the
//! stream it connected in JOURNAL_STREAM (`<device>:<inode>`), so the prefix is written only
//! when stdout is that very stream: a pipe or file the service redirected stdout to (a log
//! shipper reading our lines) gets them unchanged. Touches no Redis keys.

use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicBool, Ordering};

static ON: AtomicBool = AtomicBool::new(false);

/// Decide once, at log setup, from JOURNAL_STREAM and stdout's own device and inode.
pub fn detect() {
    let named = std::env::var("JOURNAL_STREAM").ok();
    let stdout = std::fs::metadata("/proc/self/fd/1").ok();
    let on = match (named, stdout) {
        (Some(n), Some(m)) => names(&n, m.dev(), m.ino()),
        _ => false,
    };
    ON.store(on, Ordering::Relaxed);
}

/// `JOURNAL_STREAM`'s value names this device and inode (both in decimal, as systemd writes).
fn names(value: &str, dev: u64, ino: u64) -> bool {
    match value.trim().split_once(':') {
        Some((d, i)) => d.parse() == Ok(dev) && i.parse() == Ok(ino),
        None => false,
    }
}

/// The prefix a line at `level` starts with: `<3>` error, `<4>` warning, `<6>` info, `<7>`
/// debug; empty unless stdout is the journal's stream.
pub fn prefix(level: tracing::Level) -> &'static str {
    if !ON.load(Ordering::Relaxed) {
        return "";
    }
    match level {
        tracing::Level::ERROR => "<3>",
        tracing::Level::WARN => "<4>",
        tracing::Level::INFO => "<6>",
        tracing::Level::DEBUG | tracing::Level::TRACE => "<7>",
    }
}

#[cfg(test)]
mod tests {
    use super::names;

    #[test]
    fn only_the_same_device_and_inode_match() {
        assert!(names("64769:123456", 64769, 123456));
        assert!(names("64769:123456\n", 64769, 123456));
        assert!(!names("64769:123457", 64769, 123456));
        assert!(!names("1:123456", 64769, 123456));
        assert!(!names("garbage", 64769, 123456));
        assert!(!names("", 64769, 123456));
    }
}

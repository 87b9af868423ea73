//! The UTC timestamp every log line opens with (`2026-12-03T14:05:09.123456Z`), in both
//! formats and in a job's start/done lines: the seconds part is formatted once per second
//! per thread, the microseconds by hand. Touches no Redis keys.

use std::fmt;

thread_local! {
    /// (epoch second, "YYYY-MM-DDTHH:MM:SS.") of the last line this thread wrote.
    static SECOND: std::cell::RefCell<(u64, String)> = const { std::cell::RefCell::new((u64::MAX, String::new())) };
}

pub(crate) fn write_timestamp(w: &mut impl fmt::Write) -> fmt::Result {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let secs = now.as_secs();
    SECOND.with(|c| {
        let mut c = c.borrow_mut();
        if c.0 != secs {
            let at = chrono::DateTime::from_timestamp(secs as i64, 0).unwrap_or_default();
            c.1 = at.format("%Y-%m-%dT%H:%M:%S.").to_string();
            c.0 = secs;
        }
        w.write_str(&c.1)
    })?;
    let micros = now.subsec_micros();
    let mut digits = [b'0'; 7];
    let mut n = micros;
    for d in digits[..6].iter_mut().rev() {
        *d = b'0' + (n % 10) as u8;
        n /= 10;
    }
    digits[6] = b'Z';
    w.write_str(std::str::from_utf8(&digits).unwrap_or("000000Z"))
}

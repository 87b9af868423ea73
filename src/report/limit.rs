//! The rate limit in front of Sentry: one event per (event, class, error class) per
//! interval, the rest counted, so a broken deploy that fails every job sends one event a
//! minute per kind of failure, not one per job. The count of those held back rides on the
//! next event that goes (`extra.suppressed`). Touches no Redis keys.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One event per key per this long.
pub const INTERVAL: Duration = Duration::from_secs(60);
/// Keys remembered at most; past this, windows that ended are forgotten first (their counts
/// were already logged when they began suppressing).
const MAX_KEYS: usize = 1000;

/// What grouping a report falls in: its event tag, the job's class, the error's class.
pub type Key = (&'static str, String, String);

/// Whether a report goes out now.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Send it; `suppressed` events of its key were held back since the last one sent.
    Send { suppressed: u64 },
    /// Hold it back; `first`: the first one held back in this window (worth a log line).
    Suppress { first: bool },
}

struct Window {
    started: Instant,
    suppressed: u64,
}

pub struct Limiter {
    interval: Duration,
    windows: Mutex<HashMap<Key, Window>>,
}

impl Limiter {
    pub fn new(interval: Duration) -> Limiter {
        Limiter {
            interval,
            windows: Mutex::new(HashMap::new()),
        }
    }

    pub fn check(&self, key: Key, now: Instant) -> Verdict {
        let mut windows = self.windows.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(w) = windows.get_mut(&key) {
            if now.duration_since(w.started) < self.interval {
                w.suppressed += 1;
                return Verdict::Suppress {
                    first: w.suppressed == 1,
                };
            }
            let suppressed = std::mem::take(&mut w.suppressed);
            w.started = now;
            return Verdict::Send { suppressed };
        }
        if windows.len() >= MAX_KEYS {
            let interval = self.interval;
            windows.retain(|_, w| now.duration_since(w.started) < interval);
        }
        windows.insert(
            key,
            Window {
                started: now,
                suppressed: 0,
            },
        );
        Verdict::Send { suppressed: 0 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(class: &str) -> Key {
        ("failure", class.to_string(), "E".to_string())
    }

    #[test]
    fn one_per_key_per_interval_and_the_rest_counted() {
        let l = Limiter::new(Duration::from_secs(60));
        let t0 = Instant::now();
        assert_eq!(l.check(key("A"), t0), Verdict::Send { suppressed: 0 });
        assert_eq!(l.check(key("A"), t0), Verdict::Suppress { first: true });
        assert_eq!(l.check(key("A"), t0), Verdict::Suppress { first: false });
        assert_eq!(l.check(key("B"), t0), Verdict::Send { suppressed: 0 });
        let later = t0 + Duration::from_secs(61);
        assert_eq!(l.check(key("A"), later), Verdict::Send { suppressed: 2 });
        assert_eq!(l.check(key("A"), later), Verdict::Suppress { first: true });
    }
}

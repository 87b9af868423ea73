//! The Sidekiq 7.x/8.x Metrics tab's per-minute keys, written as their `ExecutionTracker`
//! (metrics/tracking.rb, metrics/shared.rb at v7.3.10 and v8.0.10) writes them:
//!
//! | | 7.3 | 8.0 |
//! |---|---|---|
//! | minute hash (TTL 8 h) | `j\|%Y%m%d\|%-H:%-M` | `j\|%y%m%d\|%-H:%M` |
//! | 10-minute rollup hash (TTL 72 h) | — | the 8.0 minute key minus its last character |
//! | histogram string (BITFIELD, TTL 8 h) | `<Class>-%d-%H:%-M` | `h\|<Class>-%-d-%-H:%-M` |
//!
//! Hash fields are `<Class>|p` (every run), `<Class>|f` (failed runs) and `<Class>|ms` (run
//! time of the runs that did not fail); the histogram holds 26 `u16` counters of the successful
//! runs' times. `<Class>` is `wrapped`, else `class`. The two versions' keys never collide
//! (`%Y` vs `%y` dates, `h|` prefix), so both can be written; Sidekiq 6.4 reads none of them.
//!
//! A finished job only bumps counters in memory, folded by the UTC minute it finished in; the
//! heartbeat adds the folded minutes to its pipeline (as Sidekiq flushes from its beat). As in
//! Sidekiq, counts taken for a beat whose write fails are dropped, so memory stays bounded.

use chrono::{DateTime, TimeZone, Utc};
use std::collections::BTreeMap;
use std::sync::Mutex;

/// Minute hashes and histograms live 8 hours (`SHORT_TERM`, `HISTOGRAM_TTL`).
pub const SHORT_TERM_SECS: i64 = 8 * 60 * 60;
/// 8.0's 10-minute rollups live 3 days (`MID_TERM`).
pub const MID_TERM_SECS: i64 = 3 * 24 * 60 * 60;

/// Upper bounds (exclusive, ms) of the histogram buckets, shared.rb's `BUCKET_INTERVALS`; the
/// last bucket takes everything slower.
pub const BUCKET_INTERVALS: [u64; 25] = [
    20, 30, 45, 65, 100, 150, 225, 335, 500, 750, 1100, 1700, 2500, 3800, 5750, 8500, 13000, 20000,
    30000, 45000, 65000, 100000, 150000, 225000, 335000,
];
pub const BUCKETS: usize = BUCKET_INTERVALS.len() + 1;

/// Which versions' keys to write (`--sidekiq-metrics`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Mode {
    #[value(name = "off")]
    Off,
    #[value(name = "7")]
    V7,
    #[value(name = "8")]
    V8,
    /// Both formats (the default: a fleet on 7.x or 8.x sees its Metrics tab unconfigured).
    #[default]
    Both,
}

impl Mode {
    fn v7(self) -> bool {
        matches!(self, Mode::V7 | Mode::Both)
    }
    fn v8(self) -> bool {
        matches!(self, Mode::V8 | Mode::Both)
    }
}

/// One class in one minute.
#[derive(Debug, Default, Clone, PartialEq)]
struct Fold {
    processed: u64,
    failed: u64,
    /// Runs that did not fail: they alone add to `ms` and the histogram.
    succeeded: u64,
    ms: u64,
    buckets: [u64; BUCKETS],
}

/// Unix minute -> class -> counters.
type Minutes = BTreeMap<i64, crate::FastMap<String, Fold>>;

pub struct JobMetrics {
    mode: Mode,
    minutes: Mutex<Minutes>,
}

/// The bucket a run of `ms` milliseconds falls in (`ms < BUCKET_INTERVALS[idx]`).
pub fn bucket(ms: u64) -> usize {
    BUCKET_INTERVALS
        .iter()
        .position(|b| ms < *b)
        .unwrap_or(BUCKETS - 1)
}

impl JobMetrics {
    pub fn new(mode: Mode) -> JobMetrics {
        JobMetrics {
            mode,
            minutes: Mutex::new(BTreeMap::new()),
        }
    }

    /// Count one finished run of `class` that ended at `secs` (Unix seconds).
    pub fn record(&self, secs: i64, class: &str, failed: bool, ms: u64) {
        if self.mode == Mode::Off {
            return;
        }
        let minute = secs.div_euclid(60);
        let mut minutes = self.minutes.lock().unwrap();
        let classes = minutes.entry(minute).or_default();
        // No allocation for a class already seen this minute.
        let fold = match classes.get_mut(class) {
            Some(f) => f,
            None => classes.entry(class.to_string()).or_default(),
        };
        fold.processed += 1;
        if failed {
            fold.failed += 1;
        } else {
            fold.succeeded += 1;
            fold.ms += ms;
            fold.buckets[bucket(ms)] += 1;
        }
    }

    pub fn record_at(&self, at: DateTime<Utc>, class: &str, failed: bool, ms: u64) {
        self.record(at.timestamp(), class, failed, ms);
    }

    /// Move everything folded so far into `pipe` (each command's reply ignored). Called by the
    /// heartbeat, inside its own pipeline.
    pub fn flush_into(&self, pipe: &mut redis::Pipeline) {
        let minutes = std::mem::take(&mut *self.minutes.lock().unwrap());
        for (minute, classes) in &minutes {
            let at = Utc
                .timestamp_opt(minute * 60, 0)
                .single()
                .unwrap_or_else(Utc::now);
            if self.mode.v7() {
                write_minute(pipe, classes, &[(v7_hash_key(at), SHORT_TERM_SECS)]);
                for (class, fold) in classes {
                    write_histogram(pipe, &v7_histogram_key(class, at), fold);
                }
            }
            if self.mode.v8() {
                let short = v8_hash_key(at);
                let mid = v8_rollup_key(&short);
                write_minute(
                    pipe,
                    classes,
                    &[(mid, MID_TERM_SECS), (short, SHORT_TERM_SECS)],
                );
                for (class, fold) in classes {
                    write_histogram(pipe, &v8_histogram_key(class, at), fold);
                }
            }
        }
    }
}

/// 7.3: `j|20250204|8:3`.
pub fn v7_hash_key(at: DateTime<Utc>) -> String {
    at.format("j|%Y%m%d|%-H:%-M").to_string()
}

/// 7.3: `<Class>-04-08:3` (day and hour padded, minute not).
pub fn v7_histogram_key(class: &str, at: DateTime<Utc>) -> String {
    format!("{class}-{}", at.format("%d-%H:%-M"))
}

/// 8.0: `j|250204|8:03`.
pub fn v8_hash_key(at: DateTime<Utc>) -> String {
    at.format("j|%y%m%d|%-H:%M").to_string()
}

/// 8.0's 10-minute rollup: the minute key minus its last character (`j|250204|8:0`).
pub fn v8_rollup_key(minute_key: &str) -> String {
    let mut k = minute_key.to_string();
    k.pop();
    k
}

/// 8.0: `h|<Class>-4-8:3` (nothing padded).
pub fn v8_histogram_key(class: &str, at: DateTime<Utc>) -> String {
    format!("h|{class}-{}", at.format("%-d-%-H:%-M"))
}

/// HINCRBY the fields Sidekiq's tracker touches (`|f` only after a failure, `|ms` only after a
/// success, even when it adds 0), then EXPIRE each hash.
fn write_minute(
    pipe: &mut redis::Pipeline,
    classes: &crate::FastMap<String, Fold>,
    keys: &[(String, i64)],
) {
    for (key, ttl) in keys {
        for (class, f) in classes {
            pipe.hincr(key, format!("{class}|p"), f.processed).ignore();
            if f.failed > 0 {
                pipe.hincr(key, format!("{class}|f"), f.failed).ignore();
            }
            if f.succeeded > 0 {
                pipe.hincr(key, format!("{class}|ms"), f.ms).ignore();
            }
        }
        pipe.expire(key, *ttl).ignore();
    }
}

/// `BITFIELD key OVERFLOW SAT INCRBY u16 #i n …` for the non-empty buckets, then EXPIRE 8 h.
fn write_histogram(pipe: &mut redis::Pipeline, key: &str, f: &Fold) {
    if f.succeeded == 0 {
        return;
    }
    let cmd = pipe.cmd("BITFIELD").arg(key).arg("OVERFLOW").arg("SAT");
    for (i, n) in f.buckets.iter().enumerate() {
        if *n > 0 {
            cmd.arg("INCRBY").arg("u16").arg(format!("#{i}")).arg(*n);
        }
    }
    cmd.ignore();
    pipe.expire(key, SHORT_TERM_SECS).ignore();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    #[test]
    fn key_formats_of_each_version() {
        let t = at("2025-02-04T08:03:27Z");
        assert_eq!(v7_hash_key(t), "j|20250204|8:3");
        assert_eq!(v7_histogram_key("A", t), "A-04-08:3");
        assert_eq!(v8_hash_key(t), "j|250204|8:03");
        assert_eq!(v8_rollup_key(&v8_hash_key(t)), "j|250204|8:0");
        assert_eq!(v8_histogram_key("A", t), "h|A-4-8:3");
        let t = at("2025-12-24T17:46:00Z");
        assert_eq!(v7_hash_key(t), "j|20251224|17:46");
        assert_eq!(v8_rollup_key(&v8_hash_key(t)), "j|251224|17:4");
    }

    #[test]
    fn buckets_are_exclusive_upper_bounds() {
        assert_eq!(bucket(0), 0);
        assert_eq!(bucket(19), 0);
        assert_eq!(bucket(20), 1);
        assert_eq!(bucket(334_999), 24);
        assert_eq!(bucket(335_000), 25);
        assert_eq!(bucket(u64::MAX), 25);
    }

    #[test]
    fn off_records_nothing_and_a_flush_empties_the_fold() {
        let m = JobMetrics::new(Mode::Off);
        m.record(1_796_095_478, "A", false, 3);
        assert!(m.minutes.lock().unwrap().is_empty());
        let m = JobMetrics::new(Mode::Both);
        m.record(1_796_095_478, "A", false, 3);
        let mut pipe = redis::pipe();
        m.flush_into(&mut pipe);
        assert!(pipe.cmd_iter().next().is_some());
        let mut again = redis::pipe();
        m.flush_into(&mut again);
        assert!(again.cmd_iter().next().is_none());
    }
}

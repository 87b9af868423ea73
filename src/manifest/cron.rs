//! A `[[periodic]]` cron line and its time zone: parsed with `croner` (5 fields, or 6 with
//! seconds first; day of month and day of week ORed, as Vixie cron and fugit do), zones from
//! `chrono-tz`. Its run times are the instants whose wall-clock time in the zone matches the
//! line, as sidekiq-cron (fugit) finds them: a time that a spring-forward gap skips does not
//! run that day, and a time that a fall-back repeats runs at both instants. Touches no Redis
//! keys.

use chrono::{DateTime, Datelike, TimeZone, Timelike, Utc};
use chrono_tz::Tz;

/// A parsed cron schedule in its zone.
#[derive(Debug, Clone)]
pub struct CronSchedule {
    line: String,
    cron: croner::Cron,
    tz: Tz,
    seconds: bool,
}

/// How far ahead a search goes before it gives up (a line such as `0 0 30 2 *` never matches).
const HORIZON_SECS: i64 = 5 * 366 * 24 * 3600;

impl CronSchedule {
    /// Parse `line` in zone `tz` (an IANA name such as `Europe/Paris`; default `UTC`).
    pub fn parse(line: &str, tz: Option<&str>) -> Result<CronSchedule, String> {
        let tz: Tz = match tz {
            None => Tz::UTC,
            Some(name) => name.parse().map_err(|_| {
                format!("tz {name:?} is not an IANA time zone (like \"Europe/Paris\")")
            })?,
        };
        let fields = line.split_whitespace().count();
        if !(fields == 5 || fields == 6) {
            return Err(format!(
                "cron {line:?}: a cron line has 5 fields (minute hour day month weekday), or 6 with seconds first"
            ));
        }
        let cron = croner::parser::CronParser::builder()
            .seconds(croner::parser::Seconds::Optional)
            .year(croner::parser::Year::Disallowed)
            .build()
            .parse(line)
            .map_err(|e| format!("cron {line:?}: {e}"))?;
        let schedule = CronSchedule {
            line: line.to_string(),
            cron,
            tz,
            seconds: fields == 6,
        };
        if schedule.next_after(Utc::now().timestamp()).is_none() {
            return Err(format!("cron {line:?} never matches"));
        }
        Ok(schedule)
    }

    /// The line as written in the manifest.
    pub fn line(&self) -> &str {
        &self.line
    }

    /// The zone its wall-clock times are read in.
    pub fn tz(&self) -> Tz {
        self.tz
    }

    /// The wall-clock time of the instant `t` (epoch seconds) in the zone.
    fn local(&self, t: i64) -> DateTime<Tz> {
        let at = DateTime::from_timestamp(t, 0).unwrap_or_default();
        self.tz.from_utc_datetime(&at.naive_utc())
    }

    /// The first run time strictly after `t` (epoch seconds), None past five years.
    pub fn next_after(&self, t: i64) -> Option<i64> {
        let step = if self.seconds { 1 } else { 60 };
        let mut at = (t + step).div_euclid(step) * step;
        while at <= t + HORIZON_SECS {
            let local = self.local(at);
            if self.cron.is_time_matching(&local).unwrap_or(false) {
                return Some(at);
            }
            at += self.skip(&local, step);
        }
        None
    }

    /// The latest run time in `(t - within, t]`: the tick due now, if any.
    pub fn due(&self, t: i64, within: i64) -> Option<i64> {
        let mut last = None;
        let mut from = t - within;
        while let Some(at) = self.next_after(from).filter(|&at| at <= t) {
            last = Some(at);
            from = at;
        }
        last
    }

    /// The next `n` run times after `t`.
    pub fn upcoming(&self, t: i64, n: usize) -> Vec<DateTime<Tz>> {
        let mut out = Vec::new();
        let mut from = t;
        while out.len() < n {
            let Some(at) = self.next_after(from) else {
                break;
            };
            out.push(self.local(at));
            from = at;
        }
        out
    }

    /// How far the next candidate can be from `local`, a time that does not match: to the
    /// next wall-clock hour when the month, hour or day is wrong, else to the next minute (or
    /// second). Moving on the instant time line, an hour's skip lands on the next instant whose
    /// wall clock shows minute 0 (or inside a gap, which no time matches), so it never passes
    /// a time that could match, a fall-back's repeated hour included.
    fn skip(&self, local: &DateTime<Tz>, step: i64) -> i64 {
        let p = &self.cron.pattern;
        let yes = |r: Result<bool, croner::errors::CronError>| r.unwrap_or(false);
        let to_next_minute = 60 - i64::from(local.second());
        let to_next_hour = (59 - i64::from(local.minute())) * 60 + to_next_minute;
        if !(yes(p.month_match(local.month())) && yes(p.hour_match(local.hour()))) {
            return to_next_hour;
        }
        if !yes(p.minute_match(local.minute())) {
            return to_next_minute;
        }
        if step == 1 && !yes(p.second_match(local.second())) {
            return 1;
        }
        // Month, hour, minute and second fit, yet the whole does not: the day is wrong.
        to_next_hour
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> i64 {
        DateTime::parse_from_rfc3339(s).unwrap().timestamp()
    }

    fn next3(line: &str, tz: &str, from: &str) -> Vec<String> {
        let c = CronSchedule::parse(line, Some(tz)).unwrap();
        c.upcoming(at(from), 3)
            .iter()
            .map(|t| t.to_rfc3339())
            .collect()
    }

    /// fugit's answers (ruby-fugit, `next_time` from a UTC time), as sidekiq-cron enqueues.
    #[test]
    fn dst_gap_skips_and_repeat_runs_twice() {
        assert_eq!(
            next3("30 2 * * *", "Europe/Paris", "2026-03-27T12:00:00Z"),
            [
                "2026-03-28T02:30:00+01:00",
                "2026-03-30T02:30:00+02:00",
                "2026-03-31T02:30:00+02:00"
            ]
        );
        assert_eq!(
            next3("30 2 * * *", "Europe/Paris", "2026-10-23T12:00:00Z"),
            [
                "2026-10-24T02:30:00+02:00",
                "2026-10-25T02:30:00+02:00",
                "2026-10-25T02:30:00+01:00"
            ]
        );
        assert_eq!(
            next3("0 * * * *", "Europe/Paris", "2026-03-29T00:30:00Z"),
            [
                "2026-03-29T03:00:00+02:00",
                "2026-03-29T04:00:00+02:00",
                "2026-03-29T05:00:00+02:00"
            ]
        );
    }

    #[test]
    fn fields_and_errors() {
        // Day of month OR day of week, as Vixie cron and fugit.
        assert_eq!(
            next3("0 9 1 * 1", "UTC", "2026-12-01T10:00:00Z"),
            [
                "2026-12-07T09:00:00+00:00",
                "2026-12-14T09:00:00+00:00",
                "2026-12-21T09:00:00+00:00"
            ]
        );
        let c = CronSchedule::parse("*/2 * * * * *", None).unwrap();
        assert_eq!(
            c.next_after(at("2026-12-01T10:00:01Z")),
            Some(at("2026-12-01T10:00:02Z"))
        );
        assert!(CronSchedule::parse("0 3 * *", None).is_err());
        assert!(CronSchedule::parse("0 3 * * *", Some("Europe/Nowhere")).is_err());
        assert!(CronSchedule::parse("61 3 * * *", None).is_err());
        let c = CronSchedule::parse("0 3 * * *", None).unwrap();
        assert_eq!(
            c.due(at("2026-12-01T03:00:30Z"), 60),
            Some(at("2026-12-01T03:00:00Z"))
        );
        assert_eq!(c.due(at("2026-12-01T03:01:30Z"), 60), None);
    }
}

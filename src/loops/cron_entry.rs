//! One sidekiq-cron entry, a `cron_job:<name>` hash read as the gem's `Sidekiq::Cron::Job.new`
//! reads it (docs/rails.md, "Plugins"), and what the gem's poller writes for it: the tick due
//! now, that tick's member and score in `cron_job:<name>:enqueued`, the `last_enqueue_time` and
//! jid-history texts, and the payload Sidekiq's client would push. Touches no Redis keys (the
//! loop, `sidekiq_cron.rs`, does).

use crate::job::payload::{dump, float_value, new_jid};
use crate::manifest::cron::CronSchedule;
use chrono::DateTime;
use serde_json::{Map, Value};
use std::collections::HashMap;

/// The gem's window: a tick older than this many seconds is skipped, not caught up.
const DUE_WITHIN_SECS: i64 = 60;

/// The class ActiveJob's Sidekiq adapter runs, with the ActiveJob job as its one argument.
const JOB_WRAPPER: &str = "ActiveJob::QueueAdapters::SidekiqAdapter::JobWrapper";

/// An entry, checked as the gem's `valid?` checks it.
#[derive(Debug)]
pub struct CronEntry {
    pub name: String,
    schedule: CronSchedule,
    enabled: bool,
    /// `last_enqueue_time`, epoch seconds.
    last_enqueue: Option<i64>,
    args: Vec<Value>,
    date_as_argument: bool,
    shape: Shape,
}

#[derive(Debug)]
enum Shape {
    /// The stored `message`, whose `args` each enqueue replaces.
    Worker(Map<String, Value>),
    /// ActiveJob's wrapper around `class`, on the queue with its prefix.
    ActiveJob {
        class: String,
        queue: String,
        description: Value,
    },
}

/// The gem's reading of a flag: `true`, `t`, `yes`, `y` or `1`, any case.
fn truthy(v: Option<&String>) -> bool {
    v.is_some_and(|s| ["true", "t", "yes", "y", "1"].contains(&s.to_ascii_lowercase().as_str()))
}

fn present(h: &HashMap<String, String>, key: &str) -> Option<String> {
    h.get(key).filter(|s| !s.is_empty()).cloned()
}

impl CronEntry {
    /// Read an entry's hash; Err says why the gem would not enqueue it either (or, for a cron
    /// line fugit reads and we do not, why we leave it to the Ruby processes).
    pub fn from_hash(h: &HashMap<String, String>) -> Result<CronEntry, String> {
        let name = present(h, "name").ok_or("'name' must be set")?;
        let line = present(h, "cron").ok_or("'cron' must be set")?;
        let schedule = schedule_of(&line)?;
        let class = present(h, "klass")
            .or_else(|| present(h, "class"))
            .ok_or("'klass' (or class) must be set")?;
        let args = match h.get("args") {
            None => Vec::new(),
            Some(text) => match serde_json::from_str::<Value>(text) {
                Ok(Value::Array(a)) => a,
                Ok(_) => return Err("'args' is JSON but not an array".into()),
                // The gem takes text that is not JSON as one string argument.
                Err(_) => vec![Value::from(text.clone())],
            },
        };
        let message = match h.get("message") {
            Some(text) => match serde_json::from_str::<Value>(text) {
                Ok(Value::Object(m)) => m,
                _ => return Err("'message' is not a JSON object".into()),
            },
            None => default_message(&class, h.get("queue"), &args),
        };
        let queue = message
            .get("queue")
            .and_then(Value::as_str)
            .unwrap_or("default")
            .to_string();
        let shape = if truthy(h.get("active_job")) {
            Shape::ActiveJob {
                queue: with_prefix(h, queue),
                class,
                description: h
                    .get("description")
                    .map_or(Value::Null, |d| d.as_str().into()),
            }
        } else {
            Shape::Worker(message)
        };
        Ok(CronEntry {
            name,
            schedule,
            enabled: h.get("status").is_none_or(|s| s == "enabled"),
            last_enqueue: h
                .get("last_enqueue_time")
                .and_then(|t| parse_enqueue_time(t)),
            args,
            date_as_argument: truthy(h.get("date_as_argument")),
            shape,
        })
    }

    /// The tick to enqueue at `now`, as the gem's `should_enque?` decides before its ZADD: the
    /// entry is enabled, its latest run time before this second is at most 60 s old, and no
    /// enqueue was recorded at or after it.
    pub fn due_tick(&self, now: f64) -> Option<i64> {
        if !self.enabled {
            return None;
        }
        // fugit's previous_time: the latest run time strictly before the current whole second.
        let tick = self.schedule.due(now.floor() as i64 - 1, DUE_WITHIN_SECS)?;
        self.last_enqueue.is_none_or(|t| t < tick).then_some(tick)
    }

    /// The payload Sidekiq's client pushes for this entry at `now`, its queue and its jid.
    pub fn payload(&self, now: f64) -> Result<(String, String, String), String> {
        let mut args = self.args.clone();
        if self.date_as_argument {
            args.push(float_value(now));
        }
        let item = match &self.shape {
            Shape::Worker(message) => {
                let mut m = message.clone();
                m.insert("args".into(), Value::Array(args));
                m
            }
            Shape::ActiveJob {
                class,
                queue,
                description,
            } => active_job_message(class, queue, description, args),
        };
        normalize(item, now)
    }
}

/// The message the gem keeps when none was stored: the class unknown to it, so queue `default`
/// unless the entry names one.
fn default_message(class: &str, queue: Option<&String>, args: &[Value]) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert(
        "queue".into(),
        Value::from(queue.map_or("default", String::as_str)),
    );
    m.insert("class".into(), Value::from(class));
    m.insert("args".into(), Value::Array(args.to_vec()));
    m
}

/// An ActiveJob entry's queue: the entry's `queue_name_prefix` and delimiter (`_` by default)
/// before it. The Rails app's own ActiveJob prefix is not in Redis: set it on the entry.
fn with_prefix(h: &HashMap<String, String>, queue: String) -> String {
    match present(h, "queue_name_prefix") {
        Some(prefix) => {
            let delimiter = present(h, "queue_name_delimiter").unwrap_or_else(|| "_".into());
            format!("{prefix}{delimiter}{queue}")
        }
        None => queue,
    }
}

fn active_job_message(
    class: &str,
    queue: &str,
    description: &Value,
    args: Vec<Value>,
) -> Map<String, Value> {
    let mut job = Map::new();
    job.insert("job_class".into(), Value::from(class));
    job.insert(
        "job_id".into(),
        Value::from(uuid::Uuid::new_v4().to_string()),
    );
    job.insert("queue_name".into(), Value::from(queue));
    job.insert("arguments".into(), Value::Array(args));
    let mut m = Map::new();
    m.insert("class".into(), Value::from(JOB_WRAPPER));
    m.insert("wrapped".into(), Value::from(class));
    m.insert("queue".into(), Value::from(queue));
    m.insert("description".into(), description.clone());
    m.insert("args".into(), Value::Array(vec![Value::Object(job)]));
    m
}

/// Sidekiq's client on a hash whose class it does not know: its default options first
/// (`retry`, `queue`), the item over them, a jid and `created_at` unless given, `enqueued_at`.
fn normalize(item: Map<String, Value>, now: f64) -> Result<(String, String, String), String> {
    if !item.get("class").is_some_and(Value::is_string) {
        return Err("the message's 'class' must be a string".into());
    }
    if item.contains_key("at") {
        return Err("the message has 'at': a cron entry's job is pushed now".into());
    }
    let mut m = Map::new();
    m.insert("retry".into(), Value::Bool(true));
    m.insert("queue".into(), Value::from("default"));
    m.extend(item);
    let queue = match m.get("queue") {
        Some(Value::String(q)) if !q.is_empty() => q.clone(),
        _ => return Err("the message's 'queue' must be a queue name".into()),
    };
    if !m.get("jid").is_some_and(Value::is_string) {
        m.insert("jid".into(), Value::from(new_jid()));
    }
    let jid = m["jid"].as_str().unwrap_or_default().to_string();
    if m.get("created_at").is_none_or(Value::is_null) {
        m.insert("created_at".into(), float_value(now));
    }
    m.insert("enqueued_at".into(), float_value(now));
    Ok((queue, dump(&m), jid))
}

/// A cron line as fugit reads it: `@hourly` and its kin, and an IANA zone as its last field.
fn schedule_of(line: &str) -> Result<CronSchedule, String> {
    let special = match line.trim() {
        "@yearly" | "@annually" => Some("0 0 1 1 *"),
        "@monthly" => Some("0 0 1 * *"),
        "@weekly" => Some("0 0 * * 0"),
        "@daily" | "@midnight" => Some("0 0 * * *"),
        "@hourly" => Some("0 * * * *"),
        _ => None,
    };
    if let Some(s) = special {
        return CronSchedule::parse(s, None);
    }
    let fields: Vec<&str> = line.split_whitespace().collect();
    match fields.split_last() {
        Some((zone, rest)) if rest.len() >= 5 && zone.parse::<chrono_tz::Tz>().is_ok() => {
            CronSchedule::parse(&rest.join(" "), Some(zone))
        }
        _ => CronSchedule::parse(line, None),
    }
}

/// The tick's member in `:enqueued`: Ruby's `Time#iso8601` of the UTC time. Processes agree on
/// a tick only through this text, so it must be the gem's to the byte.
pub fn member(tick: i64) -> String {
    utc(tick).format("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// The tick's score: Ruby's `Float#to_s` of a whole number of seconds.
pub fn score(tick: i64) -> String {
    format!("{tick}.0")
}

/// `last_enqueue_time` (and the history's `enqueued`): the gem's '%Y-%m-%d %H:%M:%S %z' in UTC.
pub fn enqueue_time_text(now: f64) -> String {
    utc(now.floor() as i64)
        .format("%Y-%m-%d %H:%M:%S +0000")
        .to_string()
}

/// One `cron_job:<name>:jid_history` entry, as the gem's `add_jid_history` writes it.
pub fn history_entry(jid: &str, enqueued: &str) -> String {
    let mut m = Map::new();
    m.insert("jid".into(), Value::from(jid));
    m.insert("enqueued".into(), Value::from(enqueued));
    dump(&m)
}

fn utc(t: i64) -> DateTime<chrono::Utc> {
    DateTime::from_timestamp(t, 0).unwrap_or_default()
}

/// The gem's format first, then RFC 3339 (a hand-edited hash); None when neither reads.
fn parse_enqueue_time(text: &str) -> Option<i64> {
    DateTime::parse_from_str(text, "%Y-%m-%d %H:%M:%S %z")
        .or_else(|_| DateTime::parse_from_rfc3339(text))
        .ok()
        .map(|t| t.timestamp())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(fields: &[(&str, &str)]) -> Result<CronEntry, String> {
        CronEntry::from_hash(
            &fields
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    fn keys(payload: &str) -> Vec<String> {
        let v: Map<String, Value> = serde_json::from_str(payload).unwrap();
        v.keys().cloned().collect()
    }

    /// Ruby's answers: `Time.at(1765123200).utc.iso8601`, `.to_f.to_s`, and the gem's
    /// strftime of `Time.at(1765123200.5).utc`.
    #[test]
    fn texts_are_rubys() {
        assert_eq!(member(1765123200), "2025-12-07T16:00:00Z");
        assert_eq!(score(1765123200), "1765123200.0");
        assert_eq!(enqueue_time_text(1765123200.5), "2025-12-07 16:00:00 +0000");
        assert_eq!(
            parse_enqueue_time("2025-12-07 16:00:00 +0000"),
            Some(1765123200)
        );
        assert_eq!(
            history_entry("ab", "2025-12-07 16:00:00 +0000"),
            r#"{"jid":"ab","enqueued":"2025-12-07 16:00:00 +0000"}"#
        );
    }

    /// fugit's `previous_time` is strictly before the whole second; the gem skips a tick more
    /// than 60 s old, and one already enqueued.
    #[test]
    fn due_window_status_and_last_enqueue() {
        let every = entry(&[("name", "a"), ("cron", "* * * * *"), ("klass", "K")]).unwrap();
        assert_eq!(every.due_tick(1765123230.5), Some(1765123200));
        assert_eq!(every.due_tick(1765123200.0), Some(1765123140));
        let hourly = entry(&[("name", "a"), ("cron", "0 * * * *"), ("klass", "K")]).unwrap();
        assert_eq!(hourly.due_tick(1765123260.9), Some(1765123200));
        assert_eq!(hourly.due_tick(1765123261.0), None);
        let off = [
            ("name", "a"),
            ("cron", "* * * * *"),
            ("klass", "K"),
            ("status", "disabled"),
        ];
        assert_eq!(entry(&off).unwrap().due_tick(1765123230.0), None);
        let done = [
            ("name", "a"),
            ("cron", "* * * * *"),
            ("klass", "K"),
            ("last_enqueue_time", "2025-12-07 16:00:03 +0000"),
        ];
        assert_eq!(entry(&done).unwrap().due_tick(1765123230.0), None);
        assert_eq!(
            entry(&done).unwrap().due_tick(1765123262.0),
            Some(1765123260)
        );
    }

    #[test]
    fn worker_payload_is_the_clients() {
        let e = entry(&[
            ("name", "a"),
            ("cron", "* * * * *"),
            ("klass", "K"),
            ("args", "[1,\"two\"]"),
            ("date_as_argument", "true"),
            (
                "message",
                r#"{"retry":3,"queue":"cron","class":"K","args":[]}"#,
            ),
        ])
        .unwrap();
        let (queue, payload, jid) = e.payload(1765123200.25).unwrap();
        assert_eq!(queue, "cron");
        assert_eq!(
            keys(&payload),
            [
                "retry",
                "queue",
                "class",
                "args",
                "jid",
                "created_at",
                "enqueued_at"
            ]
        );
        let v: Value = serde_json::from_str(&payload).unwrap();
        assert_eq!(v["retry"], 3);
        assert_eq!(v["jid"], jid.as_str());
        assert_eq!(v["args"], serde_json::json!([1, "two", 1765123200.25]));
    }

    #[test]
    fn active_job_payload_is_the_wrapper() {
        let e = entry(&[
            ("name", "a"),
            ("cron", "* * * * *"),
            ("klass", "ReportJob"),
            ("active_job", "true"),
            ("queue_name_prefix", "prod"),
            ("description", ""),
            (
                "message",
                r#"{"queue":"reports","class":"ReportJob","args":[]}"#,
            ),
        ])
        .unwrap();
        let (queue, payload, _) = e.payload(1765123200.0).unwrap();
        assert_eq!(queue, "prod_reports");
        assert_eq!(
            keys(&payload),
            [
                "retry",
                "queue",
                "class",
                "wrapped",
                "description",
                "args",
                "jid",
                "created_at",
                "enqueued_at"
            ]
        );
        let v: Value = serde_json::from_str(&payload).unwrap();
        assert_eq!(v["class"], JOB_WRAPPER);
        assert_eq!(v["args"][0]["job_class"], "ReportJob");
        assert_eq!(v["args"][0]["queue_name"], "prod_reports");
        assert_eq!(v["args"][0]["arguments"], serde_json::json!([]));
    }

    /// fugit's `previous_time` from 2025-12-07T16:00:00Z (a Sunday), and from half a second
    /// past it: zones as the line's last field, the current second never counted.
    #[test]
    fn previous_times_are_fugits() {
        for (line, now, fugit) in [
            ("0 12 * * * Europe/Berlin", 1765123200.0, 1765105200),
            ("30 9 * * 1-5 America/New_York", 1765123200.0, 1764945000),
            ("*/15 * * * *", 1765123200.5, 1765122300),
        ] {
            let s = schedule_of(line).unwrap();
            assert_eq!(s.due(now as i64 - 1, 7 * 86400), Some(fugit), "{line}");
        }
        let e = entry(&[("name", "a"), ("cron", "*/15 * * * *"), ("klass", "K")]).unwrap();
        assert_eq!(e.due_tick(1765123200.5), None);
        assert_eq!(e.due_tick(1765123201.0), Some(1765123200));
    }

    #[test]
    fn lines_and_errors() {
        let zoned = schedule_of("0 12 * * * Europe/Berlin").unwrap();
        assert_eq!(zoned.tz(), chrono_tz::Tz::Europe__Berlin);
        assert_eq!(schedule_of("@hourly").unwrap().line(), "0 * * * *");
        assert!(schedule_of("every day at noon").is_err());
        assert!(entry(&[("cron", "* * * * *"), ("klass", "K")]).is_err());
        assert!(entry(&[("name", "a"), ("cron", "* * * * *")]).is_err());
        assert!(entry(&[
            ("name", "a"),
            ("cron", "* * * * *"),
            ("klass", "K"),
            ("args", "{}")
        ])
        .is_err());
        let bad_queue = [
            ("name", "a"),
            ("cron", "* * * * *"),
            ("klass", "K"),
            ("message", r#"{"queue":"","class":"K","args":[]}"#),
        ];
        assert!(entry(&bad_queue).unwrap().payload(1.0).is_err());
    }
}

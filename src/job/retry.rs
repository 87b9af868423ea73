//! Failure handling as Sidekiq's `job_retry.rb` does it: rebuild the job from the popped string,
//! add the error fields, then schedule a retry (`retry` zset), kill it (`dead` zset, trimmed to
//! 10,000 entries / 180 days) or drop it. The write is handed to the fetch strategy as a [`Record`], which lands it
//! together with the ack (guarded by the working list with reliable fetch, `lua/settle.lua`).

use crate::job::error_class;
use crate::job::payload::{dump, float_value, now_f64, now_value, uses_millis, Job};
pub use crate::job::retry_policy::Verdict;
use crate::job::retry_policy::{self, Policy};
use base64::Engine;
use serde_json::{Map, Value};
use std::io::Write;

/// Sidekiq's default maximum when `retry` is `true`.
pub const DEFAULT_MAX_RETRIES: i64 = 25;
/// `dead_max_jobs` and `dead_timeout_in_seconds` defaults (api.rb DeadSet).
pub const DEAD_MAX_JOBS: isize = 10_000;
pub const DEAD_TIMEOUT_SECS: f64 = 180.0 * 24.0 * 60.0 * 60.0;
/// error_message is cut to this many characters (job_retry.rb).
const MAX_MESSAGE_CHARS: usize = 10_000;

/// Failures no retry can fix (the payload itself is the problem): such a job goes to `dead` at
/// once, or is dropped under `retry: false` / `dead: false` as Sidekiq drops.
const NEVER_RETRIED: [&str; 2] = [error_class::BAD_LOCK_KEY, error_class::BAD_ARGUMENTS];

/// What went wrong, in the shape Sidekiq records it.
#[derive(Debug, Clone)]
pub struct Failure {
    pub class: String,
    pub message: String,
    /// Lines offered as a backtrace; stored only when the payload asks (`backtrace`).
    pub backtrace: Vec<String>,
    /// The phase a cycle failed in, for failure reports (`report/`); not written to Redis.
    pub phase: Option<String>,
    /// What the command's exit code asked for (discard, kill, snooze), if anything.
    pub verdict: Option<Verdict>,
}

impl Failure {
    pub fn new(class: impl Into<String>, message: impl Into<String>) -> Failure {
        Failure {
            class: class.into(),
            message: message.into(),
            backtrace: Vec::new(),
            phase: None,
            verdict: None,
        }
    }
}

/// Sidekiq's failure fields, written as job_retry.rb writes them, for every failure playguard
/// records (a run that failed, a payload that is not a job, a poison pill): `error_message`
/// (cut to 10,000 characters), `error_class`, then `retried_at` when the job has a
/// `retry_count` (a later failure) or `failed_at` and `retry_count: 0` (its first). Returns
/// the count it had before, None for a first failure.
pub fn stamp_failure(msg: &mut Map<String, Value>, class: &str, message: &str) -> Option<i64> {
    let millis = uses_millis(msg);
    let message: String = message.chars().take(MAX_MESSAGE_CHARS).collect();
    msg.insert("error_message".into(), Value::from(message));
    msg.insert("error_class".into(), Value::from(class));
    // Ruby: `if msg["retry_count"]` -- a later failure; otherwise the first one.
    match msg.get("retry_count").and_then(Value::as_i64) {
        Some(prev) => {
            msg.insert("retried_at".into(), now_value(millis));
            Some(prev)
        }
        None => {
            msg.insert("failed_at".into(), now_value(millis));
            msg.insert("retry_count".into(), Value::from(0));
            None
        }
    }
}

/// A dead-set entry for a job that cannot run (or be run again): a JSON object gets the
/// failure fields (`stamp_failure`; kept keys, order and numbers otherwise); anything else is
/// kept byte for byte.
pub fn dead_entry(raw: &[u8], class: &str, message: &str) -> Vec<u8> {
    match serde_json::from_slice::<Value>(raw) {
        Ok(Value::Object(mut msg)) => {
            stamp_failure(&mut msg, class, message);
            dump(&msg).into_bytes()
        }
        _ => raw.to_vec(),
    }
}

/// What to do with a failed job.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// ZADD retry <at> <payload>
    Retry { payload: String, at: f64 },
    /// ZADD dead <now> <payload>, then trim.
    Dead { payload: String },
    /// `retry: false`, or exhausted with `dead: false`: nothing is kept.
    Discard,
    /// A snooze: ZADD schedule <at> <payload>, its snooze count raised, no retry counted.
    Schedule { payload: String, at: f64 },
}

/// A failure of a class nobody registered. job_retry.rb `global` retries it only when the
/// payload itself says `retry` (there is no class to ask for a default); otherwise it is
/// dropped after the death handlers, as Ruby does.
pub fn decide_unknown_class(job: &Job, failure: &Failure) -> Decision {
    match job.msg().get("retry") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => Decision::Discard,
        _ => decide(job, failure),
    }
}

/// The retry limit a payload asks for; None = `retry: false` (no retry, no dead).
pub fn max_retries(msg: &Map<String, Value>) -> Option<i64> {
    match msg.get("retry") {
        Some(Value::Bool(false)) => None,
        Some(Value::Number(n)) if n.is_i64() => Some(n.as_i64().unwrap_or(0)),
        // true, missing or anything else counts as true (job_retry.rb).
        _ => Some(DEFAULT_MAX_RETRIES),
    }
}

/// Sidekiq's backoff: count**4 + 15 + rand(10) * (count + 1) seconds.
pub fn delay_secs(count: i64) -> f64 {
    delay_with(count, None)
}

/// job_retry.rb `delay_for`: the class's own delay when it is > 0 (`retry_in`), else
/// count**4 + 15; plus the jitter rand(10) * (count + 1) either way.
fn delay_with(count: i64, own: Option<i64>) -> f64 {
    let jitter: i64 = rand::random_range(0..10);
    let base = own.unwrap_or_else(|| count.saturating_pow(4).saturating_add(15));
    base.saturating_add(jitter.saturating_mul(count + 1)) as f64
}

/// Apply Sidekiq's failure bookkeeping to the job and decide its fate.
pub fn decide(job: &Job, failure: &Failure) -> Decision {
    decide_with(job, failure, None)
}

/// [`decide`] under a manifest job's policy, and the verdict its exit code gave.
pub fn decide_with(job: &Job, failure: &Failure, policy: Option<&Policy>) -> Decision {
    match failure.verdict {
        Some(Verdict::Discard) => return Decision::Discard,
        Some(Verdict::Snooze(secs))
            if retry_policy::snoozes(job.msg()) < retry_policy::MAX_SNOOZES =>
        {
            let mut msg = job.msg().clone();
            let n = retry_policy::snoozes(&msg) + 1;
            msg.insert(retry_policy::SNOOZES_KEY.into(), Value::from(n));
            return Decision::Schedule {
                payload: dump(&msg),
                at: now_f64() + secs as f64,
            };
        }
        _ => {}
    }
    // sidekiq-unique-jobs' reject kills into the dead set whatever `retry` says
    // (job/unique_jobs.rs); any other failure of a `retry: false` job is dropped.
    let rejected =
        failure.verdict == Some(Verdict::Kill) && failure.class == error_class::UNIQUE_CONFLICT;
    let mut max = match max_retries(job.msg()) {
        Some(m) => m,
        None if rejected => 0,
        None => return Decision::Discard,
    };
    if let Some(m) = policy.and_then(|p| p.max_retries) {
        max = m;
    }
    let max = if NEVER_RETRIED.contains(&failure.class.as_str()) {
        0
    } else {
        max
    };
    // Start from the original popped payload, never from a modified copy.
    let mut msg = job.msg().clone();
    // job_retry.rb `local`: a payload without `retry` gets the class default (true) written in.
    if matches!(msg.get("retry"), None | Some(Value::Null)) {
        let class_default = match policy.and_then(|p| p.max_retries) {
            Some(m) => Value::from(m),
            None => Value::Bool(true),
        };
        msg.insert("retry".into(), class_default);
    }
    let queue = match msg.get("retry_queue").and_then(Value::as_str) {
        Some(q) => q.to_string(),
        None => job.queue.to_string(),
    };
    msg.insert("queue".into(), Value::from(queue));
    let count = match stamp_failure(&mut msg, &failure.class, &failure.message) {
        Some(prev) => prev + 1,
        None => 0,
    };
    msg.insert("retry_count".into(), Value::from(count));
    if let Some(lines) = backtrace_lines(&msg, &failure.backtrace) {
        msg.insert(
            "error_backtrace".into(),
            Value::from(compress_backtrace(&lines)),
        );
    }
    let own = policy
        .and_then(|p| p.retry_in.as_ref())
        .and_then(|r| r.delay(count));
    let killed = failure.verdict == Some(Verdict::Kill);
    if !killed && !exhausted(&msg, count, max) {
        Decision::Retry {
            at: now_f64() + delay_with(count, own),
            payload: dump(&msg),
        }
    } else if !killed && msg.get("dead") == Some(&Value::Bool(false)) {
        Decision::Discard
    } else {
        Decision::Dead {
            payload: dump(&msg),
        }
    }
}

/// Whether a failed job (its `count`, already stamped) has used up its retries. With a numeric
/// `retry_for` the window is `failed_at + retry_for` against now, as job_retry.rb 7.3, 8.0 and
/// 8.1 compare it (`failed_at` float seconds, or integer milliseconds since 8.0). With `retry`
/// left at `true` the count still ends it at 25 (7.3 and 8.0); with an explicit `retry: N`
/// beside `retry_for`, 8.1's rule applies: the two are exclusive and the window alone decides.
fn exhausted(msg: &Map<String, Value>, count: i64, max: i64) -> bool {
    let Some(window) = msg.get("retry_for").and_then(Value::as_f64) else {
        return count >= max;
    };
    if max == 0 {
        return true; // NEVER_RETRIED, or `retry: 0`: no retry can help.
    }
    let failed_at = match msg.get("failed_at") {
        Some(Value::Number(n)) if n.is_i64() || n.is_u64() => n.as_f64().unwrap_or(0.0) / 1000.0,
        Some(v) => v.as_f64().unwrap_or(0.0),
        None => 0.0,
    };
    let past_window = failed_at + window < now_f64();
    let counted = matches!(msg.get("retry"), Some(Value::Bool(true))) && count >= max;
    past_window || counted
}

/// `backtrace: true` keeps all lines, `backtrace: N` the first N; otherwise none.
fn backtrace_lines(msg: &Map<String, Value>, lines: &[String]) -> Option<Vec<String>> {
    match msg.get("backtrace") {
        Some(Value::Bool(true)) => Some(lines.to_vec()),
        Some(Value::Number(n)) => {
            let n = n.as_u64().unwrap_or(0) as usize;
            (n > 0).then(|| lines.iter().take(n).cloned().collect())
        }
        _ => None,
    }
}

/// JSON array -> zlib (RFC 1950) -> strict base64, the one form every Sidekiq reader accepts.
pub fn compress_backtrace(lines: &[String]) -> String {
    let json = serde_json::to_vec(lines).expect("strings serialize");
    let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
    z.write_all(&json).expect("in-memory write");
    base64::engine::general_purpose::STANDARD.encode(z.finish().expect("in-memory finish"))
}

/// The write a failed job's outcome needs, recorded with its acknowledgement by the fetch
/// strategy (`fetch/mod.rs`, `settle`).
#[derive(Debug, Clone, Copy)]
pub enum Record<'a> {
    /// ZADD retry at payload.
    Retry { payload: &'a [u8], at: f64 },
    /// Into `dead` (trimmed), as [`add_dead`].
    Dead(&'a [u8]),
    /// Only the acknowledgement (a discarded job).
    Nothing,
    /// ZADD schedule at payload (a snoozed job).
    Schedule { payload: &'a [u8], at: f64 },
}

impl Decision {
    pub fn record(&self) -> Record<'_> {
        match self {
            Decision::Retry { payload, at } => Record::Retry {
                payload: payload.as_bytes(),
                at: *at,
            },
            Decision::Dead { payload } => Record::Dead(payload.as_bytes()),
            Decision::Discard => Record::Nothing,
            Decision::Schedule { payload, at } => Record::Schedule {
                payload: payload.as_bytes(),
                at: *at,
            },
        }
    }
}

impl Record<'_> {
    /// Add the writes to a pipeline (basic fetch: there is no working list to guard them).
    pub fn add_to_pipeline(&self, pipe: &mut redis::Pipeline) {
        match self {
            Record::Retry { payload, at } => {
                pipe.zadd("retry", *payload, float_value(*at).to_string())
                    .ignore();
            }
            Record::Dead(payload) => add_dead(pipe, payload),
            Record::Schedule { payload, at } => {
                pipe.zadd("schedule", *payload, float_value(*at).to_string())
                    .ignore();
            }
            Record::Nothing => {}
        }
    }

    /// The arguments of `lua/settle.lua` after the payload: kind, score, entry, and the dead
    /// set's trim bounds.
    pub fn script_args(&self) -> (&'static str, String, &[u8], String, isize) {
        let now = now_f64();
        let (oldest, rank) = dead_trim_bounds(now);
        match self {
            Record::Retry { payload, at } => {
                ("retry", float_value(*at).to_string(), payload, oldest, rank)
            }
            Record::Dead(payload) => ("dead", float_value(now).to_string(), payload, oldest, rank),
            Record::Schedule { payload, at } => (
                "schedule",
                float_value(*at).to_string(),
                payload,
                oldest,
                rank,
            ),
            Record::Nothing => ("none", String::new(), &[], oldest, rank),
        }
    }
}

/// ZADD dead now payload, then trim by age and size, as api.rb's DeadSet#kill. The one way a
/// job enters `dead`; `lua/schedule_push.lua` buries inside its script with the same bounds
/// (`dead_trim_bounds`).
pub fn add_dead(pipe: &mut redis::Pipeline, payload: &[u8]) {
    let now = now_f64();
    let (oldest, rank) = dead_trim_bounds(now);
    pipe.zadd("dead", payload, float_value(now).to_string())
        .ignore()
        .cmd("ZREMRANGEBYSCORE")
        .arg("dead")
        .arg("-inf")
        .arg(oldest)
        .ignore()
        .cmd("ZREMRANGEBYRANK")
        .arg("dead")
        .arg(0)
        .arg(rank)
        .ignore();
}

/// What a dead-set trim at `now` removes: scores up to the first value, ranks 0 up to the
/// second. api.rb: `zremrangebyrank(name, 0, -max_jobs)`, which keeps max_jobs - 1.
pub fn dead_trim_bounds(now: f64) -> (String, isize) {
    (
        float_value(now - DEAD_TIMEOUT_SECS).to_string(),
        -DEAD_MAX_JOBS,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(raw: &str) -> Job {
        Job::parse("low", raw.to_string()).unwrap()
    }

    fn parsed(d: &Decision) -> Map<String, Value> {
        match d {
            Decision::Retry { payload, .. } | Decision::Dead { payload } => {
                serde_json::from_str(payload).unwrap()
            }
            Decision::Discard | Decision::Schedule { .. } => panic!("not retried or dead"),
        }
    }

    #[test]
    fn first_failure_sets_failed_at_and_count_zero() {
        let j = job(
            r#"{"class":"X","args":[],"jid":"a","retry":true,"custom":{"k":1},"created_at":1.5}"#,
        );
        let d = decide(&j, &Failure::new("RuntimeError", "boom"));
        let m = parsed(&d);
        assert_eq!(m["retry_count"], 0);
        assert!(m.contains_key("failed_at") && !m.contains_key("retried_at"));
        assert_eq!(m["queue"], "low");
        assert_eq!(m["custom"]["k"], 1);
        assert!(matches!(d, Decision::Retry { .. }));
    }

    #[test]
    fn later_failure_sets_retried_at() {
        let j =
            job(r#"{"class":"X","retry":2,"retry_count":0,"failed_at":1.0,"retry_queue":"slow"}"#);
        let m = parsed(&decide(&j, &Failure::new("E", "m")));
        assert_eq!(m["retry_count"], 1);
        assert_eq!(m["failed_at"].to_string(), "1.0");
        assert_eq!(m["queue"], "slow");
        assert!(m.contains_key("retried_at"));
    }

    #[test]
    fn exhaustion_and_flags() {
        assert!(matches!(
            decide(&job(r#"{"retry":0}"#), &Failure::new("E", "m")),
            Decision::Dead { .. }
        ));
        assert_eq!(
            decide(&job(r#"{"retry":false}"#), &Failure::new("E", "m")),
            Decision::Discard
        );
        assert_eq!(
            decide(&job(r#"{"retry":0,"dead":false}"#), &Failure::new("E", "m")),
            Decision::Discard
        );
        let d = decide(
            &job(r#"{"retry":1,"retry_count":0}"#),
            &Failure::new("E", "m"),
        );
        assert!(matches!(d, Decision::Dead { .. }));
    }

    #[test]
    fn retry_for_window() {
        let f = Failure::new("E", "m");
        let now_ms = chrono::Utc::now().timestamp_millis();
        let past = |failed_at: String, extra: &str| {
            job(&format!(
                r#"{{"retry_count":3,"failed_at":{failed_at},"retry_for":3600{extra}}}"#
            ))
        };
        // Float seconds (7.3) and integer milliseconds (8.0+), one hour and a bit ago: dead.
        let secs = format!("{:.3}", now_f64() - 3700.0);
        assert!(matches!(
            decide(&past(secs, r#","retry":true"#), &f),
            Decision::Dead { .. }
        ));
        let ms = (now_ms - 3_700_000).to_string();
        assert!(matches!(
            decide(&past(ms.clone(), ""), &f),
            Decision::Dead { .. }
        ));
        // ... and `dead: false` drops it instead.
        assert_eq!(decide(&past(ms, r#","dead":false"#), &f), Decision::Discard);
        // Inside the window: retried, even past an explicit `retry: 2` (8.1: exclusive).
        let recent = (now_ms - 60_000).to_string();
        assert!(matches!(
            decide(&past(recent.clone(), r#","retry":2"#), &f),
            Decision::Retry { .. }
        ));
        // With `retry: true` the count of 25 still ends it (7.3, 8.0).
        let j = job(&format!(
            r#"{{"retry":true,"retry_count":24,"failed_at":{recent},"retry_for":3600}}"#
        ));
        assert!(matches!(decide(&j, &f), Decision::Dead { .. }));
        // A first failure starts the window now.
        let first = job(r#"{"retry":true,"retry_for":0.5}"#);
        assert!(matches!(decide(&first, &f), Decision::Retry { .. }));
    }

    #[test]
    fn missing_retry_key_follows_ruby() {
        let f = Failure::new("NameError", "uninitialized constant X");
        // Known class: retried, and the entry says retry: true.
        let m = parsed(&decide(&job(r#"{"class":"X","args":[]}"#), &f));
        assert_eq!(m["retry"], true);
        // Unknown class without `retry`: dropped, as job_retry.rb's global handler does.
        assert_eq!(
            decide_unknown_class(&job(r#"{"class":"X"}"#), &f),
            Decision::Discard
        );
        assert!(matches!(
            decide_unknown_class(&job(r#"{"class":"X","retry":true}"#), &f),
            Decision::Retry { .. }
        ));
    }

    #[test]
    fn millis_jobs_get_millis_timestamps() {
        let m = parsed(&decide(
            &job(r#"{"created_at":1796095478843}"#),
            &Failure::new("E", "m"),
        ));
        assert!(m["failed_at"].is_i64());
    }

    #[test]
    fn backtrace_is_zlib_strict_base64() {
        let j = job(r#"{"backtrace":1}"#);
        let mut f = Failure::new("E", "m");
        f.backtrace = vec!["a".into(), "b".into()];
        let m = parsed(&decide(&j, &f));
        let b64 = m["error_backtrace"].as_str().unwrap();
        assert!(!b64.contains('\n'));
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .unwrap();
        assert_eq!(&bytes[..2], &[0x78, 0x9c]);
        let mut out = String::new();
        std::io::Read::read_to_string(&mut flate2::read::ZlibDecoder::new(&bytes[..]), &mut out)
            .unwrap();
        assert_eq!(out, r#"["a"]"#);
    }

    #[test]
    fn backoff_formula() {
        for c in 0..5 {
            let d = delay_secs(c);
            let base = (c.pow(4) + 15) as f64;
            assert!(d >= base && d <= base + 9.0 * (c + 1) as f64);
        }
    }
}

//! The sidekiq-unique-jobs fields a payload carries (`lock`, `lock_digest`, `lock_ttl`,
//! `lock_limit`, `on_conflict`, `at`), read as the gem's server middleware reads them. A field
//! that does not parse makes the job run as if unlocked, with one WARN naming its jid.
//! Touches no Redis keys (`job/unique_jobs.rs` does).

use crate::job::payload::Job;
use serde_json::Value;

/// The gem's lock types (its `lock` option).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockType {
    UntilExecuted,
    UntilExecuting,
    WhileExecuting,
    UntilAndWhileExecuting,
    UntilExpired,
}

impl LockType {
    fn parse(s: &str) -> Option<(LockType, Option<OnConflict>)> {
        Some(match s {
            "until_executed" => (LockType::UntilExecuted, None),
            "until_executing" => (LockType::UntilExecuting, None),
            "while_executing" => (LockType::WhileExecuting, None),
            // The gem's shorthand for while_executing with on_conflict: reject.
            "while_executing_reject" => (LockType::WhileExecuting, Some(OnConflict::Reject)),
            "until_and_while_executing" => (LockType::UntilAndWhileExecuting, None),
            "until_expired" => (LockType::UntilExpired, None),
            _ => return None,
        })
    }

    /// The name the gem's scripts take (`until_expired` is the one they treat apart).
    pub fn name(self) -> &'static str {
        match self {
            LockType::UntilExecuted => "until_executed",
            LockType::UntilExecuting => "until_executing",
            LockType::WhileExecuting => "while_executing",
            LockType::UntilAndWhileExecuting => "until_and_while_executing",
            LockType::UntilExpired => "until_expired",
        }
    }
}

/// What the server side does when the runtime lock is held by another job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnConflict {
    /// No strategy (or `log`, or one not played here): the job is dropped with a log line.
    Drop,
    /// To the dead set.
    Reject,
    /// Pushed again to `schedule`, 5 s from now (the gem's `schedule_in` default).
    Reschedule,
    /// A failure, retried as any other.
    Raise,
}

impl OnConflict {
    fn parse(v: Option<&Value>) -> Result<OnConflict, String> {
        let name = match v {
            None | Some(Value::Null) => return Ok(OnConflict::Drop),
            Some(Value::String(s)) => s.as_str(),
            // `{client: ..., server: ...}`: only the server's half is ours.
            Some(Value::Object(m)) => match m.get("server") {
                None | Some(Value::Null) => return Ok(OnConflict::Drop),
                Some(Value::String(s)) => s.as_str(),
                Some(other) => return Err(format!("on_conflict.server is {other}")),
            },
            Some(other) => return Err(format!("on_conflict is {other}")),
        };
        Ok(match name {
            "reject" => OnConflict::Reject,
            "reschedule" => OnConflict::Reschedule,
            "raise" => OnConflict::Raise,
            _ => OnConflict::Drop,
        })
    }
}

/// A job's unique-lock settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Unique {
    pub lock: LockType,
    /// `uniquejobs:<hash>` as the gem's client computed it.
    pub digest: String,
    pub jid: String,
    /// `lock_ttl` in ms (0: no expiry).
    pub pttl: i64,
    /// `lock_limit`: how many jobs may hold the lock at once (at least 1).
    pub limit: i64,
    pub on_conflict: OnConflict,
    /// The digests zset's score when set (`at` of a scheduled job), else "" (now).
    pub score: String,
}

impl Unique {
    /// The job's lock, None when it has none, or when a field does not parse (then one WARN
    /// naming the jid, and the job runs as if unlocked).
    pub fn of(job: &Job) -> Option<Box<Unique>> {
        // Most payloads have no lock: they are not parsed as a whole for it.
        if !job.raw.contains("\"lock\"") {
            return None;
        }
        let msg = job.msg();
        let lock = msg.get("lock")?;
        if lock.is_null() {
            return None;
        }
        match read(job, lock) {
            Ok(u) => Some(Box::new(u)),
            Err(why) => {
                tracing::warn!(
                    "job {}: sidekiq-unique-jobs fields do not parse ({why}): run as if unlocked",
                    job.jid()
                );
                None
            }
        }
    }
}

fn read(job: &Job, lock: &Value) -> Result<Unique, String> {
    let msg = job.msg();
    let (lock, forced) = match lock.as_str().and_then(LockType::parse) {
        Some(l) => l,
        None => return Err(format!("lock is {lock}, not a lock type")),
    };
    let digest = match msg.get("lock_digest").or_else(|| msg.get("unique_digest")) {
        Some(Value::String(d)) if !d.is_empty() => d.clone(),
        Some(other) => return Err(format!("lock_digest is {other}")),
        None => return Err("lock_digest is missing".into()),
    };
    let jid = job.jid();
    if jid.is_empty() {
        return Err("jid is missing".into());
    }
    let ttl = whole(
        msg.get("lock_ttl").or_else(|| msg.get("lock_expiration")),
        "lock_ttl",
    )?;
    let limit = whole(msg.get("lock_limit"), "lock_limit")?
        .unwrap_or(1)
        .max(1);
    let on_conflict = match forced {
        Some(c) => c,
        None => OnConflict::parse(msg.get("on_conflict"))?,
    };
    let score = match msg.get("at") {
        Some(Value::Number(n)) => n.to_string(),
        _ => String::new(),
    };
    Ok(Unique {
        lock,
        digest,
        jid: jid.to_string(),
        pttl: ttl.unwrap_or(0).max(0).saturating_mul(1000),
        limit,
        on_conflict,
        score,
    })
}

/// A whole number field (a number, or a string of digits, as Ruby's `to_i` takes from a
/// client that sent one); None when absent or null.
fn whole(v: Option<&Value>, name: &str) -> Result<Option<i64>, String> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => match n.as_i64().or_else(|| n.as_f64().map(|f| f as i64)) {
            Some(i) => Ok(Some(i)),
            None => Err(format!("{name} is {n}")),
        },
        Some(Value::String(s)) => s
            .parse::<i64>()
            .map(Some)
            .map_err(|_| format!("{name} is {s:?}, not a number")),
        Some(other) => Err(format!("{name} is {other}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(json: &str) -> Job {
        Job::parse("default", json).expect("job")
    }

    #[test]
    fn reads_the_gems_fields() {
        let j = job(
            r#"{"class":"A","args":[],"jid":"j1","lock":"while_executing_reject",
            "lock_digest":"uniquejobs:abc","lock_ttl":60,"at":1700000000.5}"#,
        );
        let u = Unique::of(&j).expect("locked");
        assert_eq!(u.lock, LockType::WhileExecuting);
        assert_eq!(u.on_conflict, OnConflict::Reject);
        assert_eq!((u.pttl, u.limit), (60_000, 1));
        assert_eq!(u.score, "1700000000.5");
        let j = job(
            r#"{"class":"A","jid":"j1","lock":"until_executed","lock_digest":"d",
            "on_conflict":{"client":"log","server":"reschedule"}}"#,
        );
        assert_eq!(Unique::of(&j).unwrap().on_conflict, OnConflict::Reschedule);
    }

    #[test]
    fn a_field_that_does_not_parse_means_unlocked() {
        for bad in [
            r#""lock":"forever","lock_digest":"d""#,
            r#""lock":"until_executed""#,
            r#""lock":"until_executed","lock_digest":7"#,
            r#""lock":"until_executed","lock_digest":"d","lock_ttl":"soon""#,
            r#""lock":"while_executing","lock_digest":"d","on_conflict":[1]"#,
        ] {
            let j = job(&format!(r#"{{"class":"A","jid":"j1",{bad}}}"#));
            assert_eq!(Unique::of(&j), None, "{bad}");
        }
        assert_eq!(Unique::of(&job(r#"{"class":"A","jid":"j1"}"#)), None);
    }
}

//! Sidekiq Pro and Enterprise options a payload may carry, decided before a run. Pro's
//! `expires_at` (from `expires_in`) is honoured: an expired job is not run. Enterprise unique
//! jobs (`unique_for`, `unique_until`), Pro batches (`bid`) and Enterprise encrypted arguments
//! (`encrypt`) each need a server side whose Redis keys and formats are not publicly specified
//! (the unique lock's digest, the batch's `b-<bid>` bookkeeping, the cipher's key scheme), so
//! playguard cannot honour them exactly: such a job is refused, not run silently wrong. Touches
//! no Redis keys (the processor writes the outcome).

use crate::job::payload::Job;
use serde_json::Value;

/// The refused options, the product that sets each, and what running it here would break.
const REFUSED: [(&str, &str, &str); 4] = [
    (
        "unique_for",
        "Sidekiq Enterprise",
        "its unique lock would never be released",
    ),
    (
        "unique_until",
        "Sidekiq Enterprise",
        "its unique lock would never be released",
    ),
    (
        "bid",
        "Sidekiq Pro",
        "its batch would never be updated, so its callbacks would never fire",
    ),
    (
        "encrypt",
        "Sidekiq Enterprise",
        "its last argument would reach the command as ciphertext",
    ),
];

/// Why a job is not run.
#[derive(Debug, Clone, PartialEq)]
pub enum NotRun {
    /// Expired at this epoch second: dropped.
    Expired(f64),
    /// Carries a refused option: dead as `Playguard::Unsupported` with this message.
    Refused(String),
}

/// Whether the job's options keep it from running now (None: run it). The clock is read only
/// for a job that has `expires_at`.
pub fn not_run(job: &Job) -> Option<NotRun> {
    let expired_at = job
        .option("expires_at")
        .and_then(|_| expired(job, crate::job::payload::now_f64()));
    expired_at
        .map(NotRun::Expired)
        .or_else(|| refused(job).map(NotRun::Refused))
}

/// When an expired job expired (epoch seconds), or None when it has not or has no expiry.
/// `expires_at` is epoch seconds as Pro writes it (a float); a value past 10**11 is read as
/// milliseconds, the unit Sidekiq 8 uses for its own timestamps.
pub fn expired(job: &Job, now: f64) -> Option<f64> {
    let at = job.option("expires_at")?.as_f64()?;
    let at = if at > 1e11 { at / 1000.0 } else { at };
    (at < now).then_some(at)
}

/// Why a job carrying an option playguard refuses cannot run here: the `Playguard::Unsupported`
/// message, naming the option and where such jobs belong.
pub fn refused(job: &Job) -> Option<String> {
    REFUSED.iter().find_map(|(key, product, breaks)| {
        let set = !matches!(job.option(key)?, Value::Null | Value::Bool(false));
        set.then(|| {
            format!(
                "{product} option `{key}` is not supported by playguard ({breaks}). Route this \
                 class to a queue that only a Ruby {product} process serves (a queue not in \
                 playguard's -q), then retry the job from the dead set"
            )
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(raw: &str) -> Job {
        Job::parse("q", raw.to_string()).unwrap()
    }

    #[test]
    fn expiry_in_seconds_or_millis() {
        assert_eq!(expired(&job(r#"{"expires_at":99.5}"#), 100.0), Some(99.5));
        assert_eq!(expired(&job(r#"{"expires_at":100.5}"#), 100.0), None);
        let ms = job(r#"{"expires_at":1796095478843}"#);
        assert_eq!(expired(&ms, 1796095479.0), Some(1796095478.843));
        assert_eq!(expired(&ms, 1796095478.0), None);
        assert_eq!(expired(&job(r#"{"class":"X"}"#), 1e12), None);
    }

    #[test]
    fn refusals_name_the_option() {
        assert!(refused(&job(r#"{"unique_for":3600}"#))
            .unwrap()
            .contains("`unique_for`"));
        assert!(refused(&job(r#"{"bid":"abc"}"#))
            .unwrap()
            .contains("Sidekiq Pro"));
        assert!(refused(&job(r#"{"encrypt":true}"#))
            .unwrap()
            .contains("ciphertext"));
        assert_eq!(refused(&job(r#"{"encrypt":false,"bid":null}"#)), None);
    }
}

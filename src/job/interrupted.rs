//! A job the shutdown deadline interrupted (it was still running when `-t` ran out; one that
//! stopped in time, as a cycle at a phase boundary does, is requeued uncounted by
//! `manager/processor.rs`) goes back to its queue with a count in its payload,
//! `interrupted_count` (the key gitlab-sidekiq-fetcher uses); one interrupted more than the
//! limit (default 3) is not requeued again but goes to `dead` as `Playguard::Interrupted`
//! (dropped under `dead: false`), so a job that always outlives `-t` stops coming back on every
//! deploy. Builds payloads only; the fetch strategy writes them (`queue:<q>`, `dead`).

use crate::job::error_class;
use crate::job::payload::{dump, Job};
use crate::job::retry::{stamp_failure, Decision};
use serde_json::Value;

/// The payload key that counts shutdown requeues.
pub const COUNT_KEY: &str = "interrupted_count";
/// How many shutdown requeues a job gets before it goes to dead.
pub const DEFAULT_MAX_INTERRUPTIONS: u32 = 3;

/// What becomes of a job its shutdown interrupted.
#[derive(Debug, Clone, PartialEq)]
pub enum Interrupted {
    /// Push this back in the job's place (its count raised).
    Requeue(Vec<u8>),
    /// Interrupted too often: dead (or dropped under `dead: false`).
    Settle(Decision),
}

/// Count this interruption; requeue while the count is within `max`.
pub fn on_shutdown(job: &Job, max: u32) -> Interrupted {
    let mut msg = job.msg().clone();
    let count = msg.get(COUNT_KEY).and_then(Value::as_u64).unwrap_or(0) + 1;
    msg.insert(COUNT_KEY.into(), Value::from(count));
    if count <= u64::from(max) {
        return Interrupted::Requeue(dump(&msg).into_bytes());
    }
    if msg.get("dead") == Some(&Value::Bool(false)) {
        return Interrupted::Settle(Decision::Discard);
    }
    let why = format!(
        "interrupted by shutdown {count} times (more than {max}): not requeued again. It runs \
         longer than the shutdown timeout (-t); raise -t or split the job, then retry it from \
         the dead set"
    );
    stamp_failure(&mut msg, error_class::INTERRUPTED, &why);
    Interrupted::Settle(Decision::Dead {
        payload: dump(&msg),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(raw: &str) -> Job {
        Job::parse("q", raw.to_string()).unwrap()
    }

    #[test]
    fn counts_then_dead() {
        let Interrupted::Requeue(p) = on_shutdown(&job(r#"{"class":"X","args":[1]}"#), 3) else {
            panic!("requeued")
        };
        assert_eq!(
            p,
            br#"{"class":"X","args":[1],"interrupted_count":1}"#.to_vec()
        );
        let third = job(r#"{"class":"X","interrupted_count":2}"#);
        assert!(matches!(on_shutdown(&third, 3), Interrupted::Requeue(_)));
        let fourth = job(r#"{"class":"X","interrupted_count":3}"#);
        let Interrupted::Settle(Decision::Dead { payload }) = on_shutdown(&fourth, 3) else {
            panic!("dead")
        };
        let m: serde_json::Map<String, Value> = serde_json::from_str(&payload).unwrap();
        assert_eq!(m["error_class"], "Playguard::Interrupted");
        assert_eq!(m["interrupted_count"], 4);
        let dead_false = job(r#"{"class":"X","interrupted_count":3,"dead":false}"#);
        assert_eq!(
            on_shutdown(&dead_false, 3),
            Interrupted::Settle(Decision::Discard)
        );
    }
}

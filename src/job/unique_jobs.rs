//! The server side of sidekiq-unique-jobs: what the gem's server middleware does around a run,
//! in the gem's key layout. Keys (for a digest `d`, and `d:RUN` for the runtime lock): `d`,
//! `d:QUEUED`, `d:PRIMED`, `d:LOCKED`, `d:INFO`, `uniquejobs:digests`, `uniquejobs:changelog`;
//! `schedule` (an `on_conflict: reschedule` push). Scripts: `lua/unique_lock.lua`,
//! `lua/unique_unlock.lua`. The fields are read in `job/unique_fields.rs`; the processor
//! calls [`before`] where a job starts and [`after`] before its outcome is written.
//!
//! until_executed: the lock is held while the job runs (taken again when a retry runs without
//! it) and released once it ran, failed or not, as the gem's `ensure` does; a run cut short by
//! shutdown keeps it (the job goes back to its queue). until_executing: released before the
//! run, taken again after a failure. while_executing: the runtime lock `d:RUN` while it runs;
//! held by another job, `on_conflict` decides. until_and_while_executing: both. until_expired:
//! left to its TTL.

use crate::connections::redis_conn::Conn;
use crate::job::error_class;
use crate::job::handler::{BoxFuture, Outcome};
use crate::job::payload::{dump, float_value, new_jid, now_f64, Job};
use crate::job::retry::{Failure, Verdict};
pub use crate::job::unique_fields::{LockType, OnConflict, Unique};
use futures::future::OptionFuture;
use serde_json::Value;

/// The gem's default `max_history`: how many changelog entries are kept.
const MAX_HISTORY: i64 = 1000;
/// The gem's default `schedule_in` for `on_conflict: reschedule`, in seconds.
const RESCHEDULE_IN: f64 = 5.0;
/// error_class of a job the runtime lock kept from running (the gem's exception).
pub const CONFLICT: &str = crate::job::error_class::UNIQUE_CONFLICT;

static LOCK: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("../../lua/unique_lock.lua")));
static UNLOCK: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("../../lua/unique_unlock.lua")));

/// The gem's key set for one digest, in the order both scripts take them.
fn keys(digest: &str) -> [String; 7] {
    [
        digest.to_string(),
        format!("{digest}:QUEUED"),
        format!("{digest}:PRIMED"),
        format!("{digest}:LOCKED"),
        format!("{digest}:INFO"),
        "uniquejobs:changelog".to_string(),
        "uniquejobs:digests".to_string(),
    ]
}

fn runtime(u: &Unique) -> String {
    // The gem's client never suffixes; a digest that already ends so is not suffixed twice.
    match u.digest.ends_with(":RUN") {
        true => u.digest.clone(),
        false => format!("{}:RUN", u.digest),
    }
}

/// Takes or confirms `u.jid`'s hold on `digest`: None when held, else the holder's jid.
async fn lock(conn: &Conn, u: &Unique, digest: &str) -> redis::RedisResult<Option<String>> {
    let mut inv = LOCK.prepare_invoke();
    for k in keys(digest) {
        inv.key(k);
    }
    inv.arg(&u.jid)
        .arg(u.pttl)
        .arg(u.limit)
        .arg(&u.score)
        .arg(now_f64())
        .arg(MAX_HISTORY);
    let holder: String = inv.invoke_async(&mut conn.clone()).await?;
    Ok((holder != u.jid).then_some(holder))
}

/// Releases `u.jid`'s hold on `digest`; false when another job holds it (left alone).
async fn unlock(conn: &Conn, u: &Unique, digest: &str) -> redis::RedisResult<bool> {
    let mut inv = UNLOCK.prepare_invoke();
    for k in keys(digest) {
        inv.key(k);
    }
    inv.arg(&u.jid)
        .arg(u.lock.name())
        .arg(u.limit)
        .arg(now_f64())
        .arg(MAX_HISTORY);
    let released: Option<String> = inv.invoke_async(&mut conn.clone()).await?;
    Ok(released.is_some())
}

/// A lock step that Redis refused: the job runs (or settles) as if unlocked, the reason logged.
fn warn_failed(u: &Unique, what: &str, e: &redis::RedisError) {
    tracing::warn!(lock_digest = %u.digest, "job {}: sidekiq-unique-jobs {what} failed ({e}): run as if unlocked", u.jid);
}

/// [`before`] for a job with a lock; a job without one builds no future (None at once).
pub fn before_if<'a>(
    conn: &'a Conn,
    job: &'a Job,
    u: Option<&'a Unique>,
) -> OptionFuture<BoxFuture<'a, Result<(), Outcome>>> {
    u.map(|u| Box::pin(before(conn, job, u)) as BoxFuture<'a, _>)
        .into()
}

/// [`after`] for a job with a lock.
pub fn after_if<'a>(
    conn: &'a Conn,
    u: Option<&'a Unique>,
    outcome: &'a Outcome,
) -> OptionFuture<BoxFuture<'a, ()>> {
    u.map(|u| Box::pin(after(conn, u, outcome)) as BoxFuture<'a, _>)
        .into()
}

/// Before the run. Ok: run it (then call [`after`]); Err: do not run it, this is its outcome.
pub async fn before(conn: &Conn, job: &Job, u: &Unique) -> Result<(), Outcome> {
    if matches!(
        u.lock,
        LockType::UntilExecuting | LockType::UntilAndWhileExecuting
    ) {
        if let Err(e) = unlock(conn, u, &u.digest).await {
            warn_failed(u, "unlock", &e);
        }
    }
    let (digest, conflict) = match u.lock {
        LockType::UntilExecuted => (u.digest.clone(), OnConflict::Drop),
        LockType::WhileExecuting | LockType::UntilAndWhileExecuting => (runtime(u), u.on_conflict),
        LockType::UntilExecuting | LockType::UntilExpired => return Ok(()),
    };
    match lock(conn, u, &digest).await {
        Ok(None) => Ok(()),
        Ok(Some(holder)) => Err(conflicted(conn, job, u, &holder, conflict).await),
        Err(e) => {
            warn_failed(u, "lock", &e);
            Ok(())
        }
    }
}

/// After the run, before its outcome is written.
pub async fn after(conn: &Conn, u: &Unique, outcome: &Outcome) {
    // A failed run takes the outer lock back for its retry; a job rejected to dead does not.
    let failed = matches!(outcome, Outcome::Failed(f) if f.verdict != Some(Verdict::Kill));
    let step = match u.lock {
        LockType::UntilExecuted if !matches!(outcome, Outcome::Requeue) => {
            unlock(conn, u, &u.digest).await.map(drop)
        }
        LockType::WhileExecuting => unlock(conn, u, &runtime(u)).await.map(drop),
        LockType::UntilAndWhileExecuting => {
            let r = unlock(conn, u, &runtime(u)).await.map(drop);
            match failed {
                true => r.and(lock(conn, u, &u.digest).await.map(drop)),
                false => r,
            }
        }
        LockType::UntilExecuting if failed => lock(conn, u, &u.digest).await.map(drop),
        _ => Ok(()),
    };
    if let Err(e) = step {
        tracing::warn!(lock_digest = %u.digest, "job {}: sidekiq-unique-jobs release failed ({e}): the lock is left to its TTL", u.jid);
    }
}

/// The outcome of a job another one's lock kept from running.
async fn conflicted(conn: &Conn, job: &Job, u: &Unique, holder: &str, how: OnConflict) -> Outcome {
    let why = format!("{} is locked by job {holder}", u.digest);
    match how {
        OnConflict::Raise => Outcome::Failed(Failure::new(CONFLICT, why)),
        OnConflict::Reject => {
            tracing::info!("job {}: {why}: on_conflict reject, to the dead set", u.jid);
            let mut f = Failure::new(CONFLICT, why);
            f.verdict = Some(Verdict::Kill);
            Outcome::Failed(f)
        }
        OnConflict::Reschedule => match reschedule(conn, job).await {
            Ok(jid) => {
                tracing::info!("job {}: {why}: on_conflict reschedule, pushed again as job {jid} in {RESCHEDULE_IN} s", u.jid);
                Outcome::Done
            }
            // Nothing is lost: it fails, and is retried.
            Err(e) => Outcome::Failed(Failure::new(
                error_class::LOCK_ERROR,
                format!("{why}: reschedule failed: {e}"),
            )),
        },
        OnConflict::Drop => {
            tracing::info!(
                "job {}: {why}: not run, dropped (no on_conflict strategy)",
                u.jid
            );
            Outcome::Done
        }
    }
}

/// The gem's reschedule: the same class, queue and arguments as a new job, `RESCHEDULE_IN`
/// from now, in `schedule`. Returns its jid.
async fn reschedule(conn: &Conn, job: &Job) -> redis::RedisResult<String> {
    let mut msg = job.msg().clone();
    for k in [
        "enqueued_at",
        "retry_count",
        "error_message",
        "error_class",
        "error_backtrace",
        "failed_at",
        "retried_at",
        "at",
    ] {
        msg.remove(k);
    }
    let jid = new_jid();
    let now = now_f64();
    msg.insert("jid".into(), Value::from(jid.clone()));
    msg.insert("created_at".into(), float_value(now));
    let at = float_value(now + RESCHEDULE_IN).to_string();
    redis::cmd("ZADD")
        .arg("schedule")
        .arg(at)
        .arg(dump(&msg))
        .query_async::<()>(&mut conn.clone())
        .await?;
    Ok(jid)
}

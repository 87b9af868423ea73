//! The cycle ledger: one `playguard_cycles` row per cycle that acquired its lock, and, for
//! database-fenced locks, the `playguard_fences` row whose fence the cycle holds. A
//! Redis lease is coordination, not a record; the record lives in the application database
//! and survives whatever Redis loses. Tables: `playguard_cycles`, `playguard_fences`.
//!
//! Every write is one statement (data-modifying CTEs), so an acquisition's fence, its ledger
//! row and the marking of rows left `running` by a vanished holder commit together or not at
//! all.

use crate::connections::db::{Db, DbError};
use tokio_postgres::types::Type;

/// How a cycle ended, as written to `playguard_cycles.outcome`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    Complete,
    Failed,
    LockLost,
    /// Stopped by shutdown; the job went back on its queue.
    Interrupted,
    /// Stopped by Sidekiq's cancel (`cycle/cancel.rs`); not retried.
    Cancelled,
}

impl End {
    pub fn as_str(self) -> &'static str {
        match self {
            End::Complete => "complete",
            End::Failed => "failed",
            End::LockLost => "lock_lost",
            End::Interrupted => "interrupted",
            End::Cancelled => "cancelled",
        }
    }
}

/// Rows of this key still `running` belong to holders that vanished without an outcome (a
/// SIGKILL, a lost connection): they become `uncertain`, to be reconciled, never assumed done.
const MARK_STALE: &str = "\
stale AS (
    UPDATE playguard_cycles
       SET outcome = 'uncertain',
           error = 'no outcome recorded before the lock was taken again (by jid ' || $2 || ')'
     WHERE lock_key = $1 AND outcome = 'running'
)";

/// Where the fence of a new cycle comes from.
#[derive(Debug, Clone, Copy)]
pub enum Fence {
    /// The Redis acquire script's fence, recorded as is.
    Redis(i64),
    /// Taken from `playguard_fences`: one above the key's last database fence, and never below
    /// the Redis fence + 1, so switching a key from Redis to database fences never goes back.
    DatabaseAbove(i64),
}

/// Record an acquisition: mark stale rows `uncertain`, take the database fence when asked,
/// and insert the cycle's `running` row. Returns (cycle id, fence).
pub async fn start(
    db: &Db,
    lock_key: &str,
    jid: &str,
    fence: Fence,
) -> Result<(i64, i64), DbError> {
    let sql = match fence {
        Fence::Redis(_) => format!(
            "WITH {MARK_STALE}
             INSERT INTO playguard_cycles (lock_key, jid, fence, identity)
             VALUES ($1, $2, $3, $4)
             RETURNING id, fence"
        ),
        Fence::DatabaseAbove(_) => format!(
            "WITH f AS (
                 INSERT INTO playguard_fences AS f (lock_key, fence, identity, jid, acquired_at)
                 VALUES ($1, $3 + 1, $4, $2, now())
                 ON CONFLICT (lock_key) DO UPDATE
                    SET fence = GREATEST(f.fence + 1, EXCLUDED.fence),
                        identity = EXCLUDED.identity, jid = EXCLUDED.jid,
                        acquired_at = EXCLUDED.acquired_at
                 RETURNING f.fence
             ), {MARK_STALE}
             INSERT INTO playguard_cycles (lock_key, jid, fence, identity)
             SELECT $1, $2, f.fence, $4 FROM f
             RETURNING id, fence"
        ),
    };
    let n = match fence {
        Fence::Redis(n) | Fence::DatabaseAbove(n) => n,
    };
    let holder = db.holder();
    let rows = db
        .query(
            &sql,
            &[
                (&lock_key, Type::TEXT),
                (&jid, Type::TEXT),
                (&n, Type::INT8),
                (&holder, Type::TEXT),
            ],
        )
        .await?;
    let row = rows
        .first()
        .ok_or_else(|| DbError::Config("the acquisition insert returned no row".into()))?;
    Ok((row.get(0), row.get(1)))
}

/// The fence `playguard_fences` holds for `lock_key` now (`None`: no row).
pub async fn current_fence(db: &Db, lock_key: &str) -> Result<Option<i64>, DbError> {
    let rows = db
        .query(
            "SELECT fence FROM playguard_fences WHERE lock_key = $1",
            &[(&lock_key, Type::TEXT)],
        )
        .await?;
    Ok(rows.first().map(|r| r.get(0)))
}

/// Retire a cancelled cycle's fence: `playguard_fences` moves one past it, only while it still
/// holds ours (a newer holder's fence is left alone). Once this commits, a write that checks
/// its fence against `playguard_fences` (docs/fencing.md, the FOR SHARE recipe) is refused, and
/// one already under way has finished first (its row lock). Returns whether a row moved.
pub async fn retire_fence(db: &Db, lock_key: &str, fence: i64) -> Result<bool, DbError> {
    let rows = db
        .query(
            "UPDATE playguard_fences SET fence = fence + 1
              WHERE lock_key = $1 AND fence = $2
              RETURNING fence",
            &[(&lock_key, Type::TEXT), (&fence, Type::INT8)],
        )
        .await?;
    Ok(!rows.is_empty())
}

/// Write a cycle's outcome, only while its row is still `running` (a row another acquisition
/// already marked `uncertain` keeps that mark: the newer holder could not know this outcome).
pub async fn finish(
    db: &Db,
    cycle_id: i64,
    end: End,
    phase: Option<&str>,
    error: Option<&str>,
) -> Result<bool, DbError> {
    let outcome = end.as_str();
    let rows = db
        .query(
            "UPDATE playguard_cycles
                SET outcome = $2, finished_at = now(), phase = $3, error = $4
              WHERE id = $1 AND outcome = 'running'
              RETURNING id",
            &[
                (&cycle_id, Type::INT8),
                (&outcome, Type::TEXT),
                (&phase, Type::TEXT),
                (&error, Type::TEXT),
            ],
        )
        .await?;
    Ok(!rows.is_empty())
}

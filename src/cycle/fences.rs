//! Where a lock's fences come from, kept apart from the lock engine (`lock.rs`: token, lease,
//! renewal) and behind one small interface: [`hold`] turns a fresh Redis lease into a
//! [`Held`] lock with its fence, [`Held::renew`] proves both the lease and the fence, and
//! [`Held::finish`] records the outcome. Redis store: the acquire script's `<key>:fence`.
//! PostgreSQL store: tables `playguard_fences` and `playguard_cycles` (through `ledger.rs`).

use crate::connections::db::{Db, DbError};
use crate::cycle::ledger::{self, End, Fence};
use crate::cycle::lock::{Lease, LockLost};

/// Which store a lock's fences come from (`lock = { …, fence = "redis" | "database" }`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FenceSource {
    /// `max(counter + 1, Redis clock in µs)` from the acquire script.
    #[default]
    Redis,
    /// `playguard_fences`, taken in the statement that records the acquisition.
    Database,
}

impl FenceSource {
    pub fn parse(s: &str) -> Result<FenceSource, String> {
        match s {
            "redis" => Ok(FenceSource::Redis),
            "database" => Ok(FenceSource::Database),
            other => Err(format!(
                "lock.fence = {other:?} is not supported (\"redis\" or \"database\")"
            )),
        }
    }
}

/// Why a held lock can no longer be proven. Every variant means: stop, release, no retry.
#[derive(Debug, thiserror::Error)]
pub enum Lost {
    #[error(transparent)]
    Lease(#[from] LockLost),
    #[error("lock lost: playguard_fences holds fence {current} for this key, not ours ({ours})")]
    Superseded { ours: i64, current: i64 },
    #[error("lock lost: playguard_fences has no row for this key any more")]
    FenceMissing,
    #[error("lock lost: could not confirm the fence with PostgreSQL: {0}")]
    Database(String),
}

/// A lock held by a cycle: the Redis lease, the fence every guarded write carries, and the
/// cycle's ledger row when a database is configured.
pub struct Held {
    lease: Lease,
    fence: i64,
    source: FenceSource,
    db: Option<Db>,
    cycle_id: Option<i64>,
}

/// Record a fresh lease where its fence comes from. With a database configured every
/// acquisition gets a `running` ledger row (both sources); with `FenceSource::Database` the
/// fence itself is taken in that same statement, above the lease's Redis fence.
///
/// On `Err` nothing was recorded and the lease is still held (with its Redis fence, no
/// ledger row): the caller releases it.
pub async fn hold(
    lease: Lease,
    source: FenceSource,
    db: Option<&Db>,
    jid: &str,
) -> Result<Held, (Held, DbError)> {
    let Some(db) = db else {
        if source == FenceSource::Database {
            // Startup refuses this combination; never hand out a Redis fence in its place.
            let e = DbError::Config("fence = \"database\" needs a database URL".into());
            return Err((Held::unrecorded(lease, source), e));
        }
        return Ok(Held::unrecorded(lease, source));
    };
    let asked = match source {
        FenceSource::Redis => Fence::Redis(lease.fence()),
        FenceSource::Database => Fence::DatabaseAbove(lease.fence()),
    };
    match ledger::start(db, lease.key(), jid, asked).await {
        Ok((id, fence)) => Ok(Held {
            lease,
            fence,
            source,
            db: Some(db.clone()),
            cycle_id: Some(id),
        }),
        Err(e) => Err((Held::unrecorded(lease, source), e)),
    }
}

impl Held {
    /// A lease with its Redis fence and no ledger row.
    fn unrecorded(lease: Lease, source: FenceSource) -> Held {
        Held {
            fence: lease.fence(),
            lease,
            source,
            db: None,
            cycle_id: None,
        }
    }

    /// The lock key.
    pub fn key(&self) -> &str {
        self.lease.key()
    }

    /// Lease time left before its local deadline (zero once past it).
    pub fn remaining(&self) -> std::time::Duration {
        self.lease.remaining()
    }

    /// The lease's local deadline: nothing guarded may run past it.
    pub fn deadline(&self) -> tokio::time::Instant {
        self.lease.deadline()
    }

    /// Release the lock with compare-and-DEL ([`Lease::release`]): `Ok(false)` when it was no
    /// longer ours.
    pub async fn release(&self) -> redis::RedisResult<bool> {
        self.lease.release().await
    }

    /// Release, proving the lock was ours up to now ([`Lease::release_proving`]).
    pub async fn release_proving(&self) -> Result<(), LockLost> {
        self.lease.release_proving().await
    }

    /// The fence to attach to every guarded write.
    pub fn fence(&self) -> i64 {
        self.fence
    }

    pub fn cycle_id(&self) -> Option<i64> {
        self.cycle_id
    }

    /// Whether the end of the last phase may be proven by the release alone
    /// ([`Lease::release_proving`]): only without a database, where no fence must be checked
    /// in PostgreSQL and no ledger row written while the lock is still ours.
    pub fn release_proves(&self) -> bool {
        self.db.is_none()
    }

    /// Renew the lease (compare-and-PEXPIRE) and, for database fences, check in the same
    /// moment that `playguard_fences` still holds our fence. Both must hold.
    pub async fn renew(&mut self) -> Result<(), Lost> {
        let (lease, fence) = match (self.source, &self.db) {
            (FenceSource::Database, Some(db)) => {
                let key = self.lease.key().to_string();
                let (l, f) = tokio::join!(self.lease.renew(), ledger::current_fence(db, &key));
                (l, Some(f))
            }
            _ => (self.lease.renew().await, None),
        };
        lease?;
        match fence {
            None => Ok(()),
            Some(Ok(Some(current))) if current == self.fence => Ok(()),
            Some(Ok(Some(current))) => Err(Lost::Superseded {
                ours: self.fence,
                current,
            }),
            Some(Ok(None)) => Err(Lost::FenceMissing),
            Some(Err(e)) => Err(Lost::Database(e.to_string())),
        }
    }

    /// A cancelled cycle's fence, retired in `playguard_fences` (database fences only), so no
    /// late write carrying it can land ([`ledger::retire_fence`]). A failure is logged.
    pub async fn retire_fence(&self) {
        let (FenceSource::Database, Some(db)) = (self.source, &self.db) else {
            return;
        };
        let key = self.lease.key();
        match ledger::retire_fence(db, key, self.fence).await {
            Ok(true) => tracing::info!(lock_key = %key, fence = self.fence,
                "fence retired in playguard_fences: no later write with it is accepted"),
            Ok(false) => tracing::info!(lock_key = %key, fence = self.fence,
                "fence already superseded in playguard_fences; left as it is"),
            Err(e) => tracing::warn!(lock_key = %key, fence = self.fence, error = %e,
                "could not retire the cancelled cycle's fence in playguard_fences"),
        }
    }

    /// Write the cycle's outcome to its ledger row (nothing without a database). A failed
    /// write is logged: the row stays `running` and the next acquisition marks it `uncertain`.
    pub async fn finish(&self, end: End, phase: Option<&str>, error: Option<&str>) {
        let (Some(db), Some(id)) = (&self.db, self.cycle_id) else {
            return;
        };
        match ledger::finish(db, id, end, phase, error).await {
            Ok(true) => {}
            Ok(false) => tracing::warn!(
                cycle_id = id,
                outcome = end.as_str(),
                "ledger row was already marked uncertain by a newer holder; left as it is"
            ),
            Err(e) => tracing::warn!(cycle_id = id, outcome = end.as_str(), error = %e,
                "could not write the cycle's outcome to playguard_cycles; the next acquisition marks it uncertain"),
        }
    }
}

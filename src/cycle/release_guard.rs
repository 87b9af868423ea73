//! The one way a cycle's lock is released: however the cycle ends (or is dropped), and when
//! its acquisition could not be recorded. Keys: the lock key and its holder record, through
//! `fences.rs` / `lock.rs`; with a database, the ledger row (`playguard_cycles`).

use crate::cycle::fences::Held;
use crate::cycle::ledger::End;
use crate::cycle::lock;

/// Records the outcome and releases the lease however the cycle ends, even if the cycle's
/// future is dropped (then only the release happens; the ledger row stays `running` and the
/// next acquisition marks it `uncertain`).
pub struct ReleaseGuard {
    lease: Option<Held>,
}

impl ReleaseGuard {
    pub fn new(held: Held) -> ReleaseGuard {
        ReleaseGuard { lease: Some(held) }
    }

    /// The lock, between phases (held until the cycle's end or the last phase's release).
    pub fn held(&self) -> &Held {
        self.lease.as_ref().expect("held between phases")
    }

    pub fn held_mut(&mut self) -> &mut Held {
        self.lease.as_mut().expect("held between phases")
    }

    /// False once released, or after a release that proved the lock was no longer ours.
    pub fn is_held(&self) -> bool {
        self.lease.is_some()
    }

    /// Write the outcome to the ledger (while the lock is still ours), then release.
    pub async fn end(&mut self, end: End, phase: Option<&str>, error: Option<&str>, why: &str) {
        if let Some(held) = self.lease.as_ref() {
            held.finish(end, phase, error).await;
        }
        self.release(why).await;
    }

    /// Release the lease after the last phase, proving it was ours through that phase
    /// (`Lease::release_proving`). On `Err` the lease is gone, unless Redis could not be
    /// asked: then it is still held, for [`ReleaseGuard::lost`] to release.
    pub async fn release_proving(&mut self) -> Result<(), lock::LockLost> {
        let held = self.lease.take().expect("held between phases");
        match held.release_proving().await {
            Ok(()) => {
                crate::traces::lock_event("lock released", held.key(), held.fence());
                tracing::info!(
                    lock_key = held.key(),
                    fence = held.fence(),
                    "lock released (cycle complete)"
                );
                Ok(())
            }
            Err(e) => {
                if matches!(e, lock::LockLost::Redis(_)) {
                    self.lease = Some(held);
                }
                Err(e)
            }
        }
    }

    pub async fn release(&mut self, why: &str) {
        if let Some(held) = self.lease.take() {
            let released = held.release().await;
            if matches!(released, Ok(true)) {
                crate::traces::lock_event("lock released", held.key(), held.fence());
            }
            match released {
                Ok(true) => tracing::info!(lock_key = held.key(), fence = held.fence(), "lock released ({why})"),
                Ok(false) => tracing::info!(lock_key = held.key(),
                    "lock was no longer ours at release ({why}); the newer owner's lock is untouched"),
                Err(e) => tracing::warn!(lock_key = held.key(), error = %e,
                    "could not release the lock ({why}); it expires by its ttl"),
            }
        }
    }
}

impl Drop for ReleaseGuard {
    fn drop(&mut self) {
        if let Some(held) = self.lease.take() {
            // Cancelled or panicked mid-cycle: release in the background.
            if let Ok(h) = tokio::runtime::Handle::try_current() {
                h.spawn(async move {
                    let _ = held.release().await;
                });
            }
        }
    }
}

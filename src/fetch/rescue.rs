//! The jobs a fetch whose reply was lost may have moved into our working lists without
//! telling us (the script ran, its reply never came), and the two ways they go back to their
//! queues: at once under load (`lost`, from the lists' left ends) or once fully idle
//! (`if_idle`, the whole lists). The fetch loop (`manager/`) tells it what happened and asks
//! when a rescue is due; whether a mode can hide jobs at all is the strategy's business.
//! Keys: our working lists, through the strategy.

use super::FetchStrategy;
use std::time::Duration;

/// After a lost fetch reply, how long the rescue waits for pending acks to be confirmed (so
/// its count of our jobs is exact): this many checks, this far apart.
const ACK_SETTLE_CHECKS: usize = 100;
const ACK_SETTLE_PAUSE: Duration = Duration::from_millis(10);

/// What the fetch loop knows of jobs a lost fetch reply may have hidden.
#[derive(Default)]
pub struct Rescue {
    /// A fetch failed in a way that may have moved a job into our working list without
    /// telling us; cleared by a rescue drain once we are fully idle.
    may_hide_jobs: bool,
    /// Such a fetch failed and nothing has been fetched since: what it moved is at the left
    /// ends of our working lists, where `lost` finds it under load too.
    hidden_left: bool,
}

impl Rescue {
    /// A blocking pop's delivery is in hand: `got` a job, or `failed` on an error.
    pub fn delivered(&mut self, fetch: &FetchStrategy, got: bool, failed: bool) {
        self.may_hide_jobs |= failed;
        if got {
            self.hidden_left = false;
        }
        self.hidden_left |= failed && fetch.lost_reply_may_hide_jobs();
    }

    /// A batch was taken: what a lost reply moved is no longer at the lists' left ends.
    pub fn fetched(&mut self) {
        self.hidden_left = false;
    }

    /// A batch fetch failed: its reply may have been lost after the script ran.
    pub fn fetch_failed(&mut self, fetch: &FetchStrategy) {
        self.may_hide_jobs |= fetch.lost_reply_may_hide_jobs();
        self.hidden_left |= fetch.lost_reply_may_hide_jobs();
    }

    /// Whether `lost` is due before the next fetch.
    pub fn left_due(&self) -> bool {
        self.hidden_left
    }

    /// Fully idle after a fetch whose reply was lost: anything in our working lists now is a
    /// job that fetch moved there. Nothing runs, no ack waits, no pop is in flight, and only
    /// the fetch loop adds to the lists, so push them all back to their queues. The caller
    /// checked the rest of "fully idle" (no credit taken, no pop armed).
    pub async fn if_idle(&mut self, fetch: &FetchStrategy, queues: &[String]) -> bool {
        if !self.may_hide_jobs || fetch.acks_pending() != 0 {
            return false;
        }
        match fetch.drain(queues).await {
            Ok(n) => {
                if n > 0 {
                    tracing::warn!(
                        jobs = n,
                        "returned jobs a failed fetch had moved into our working list"
                    );
                }
                self.may_hide_jobs = false;
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "fetch: could not check our working lists");
                false
            }
        }
    }

    /// Right after a fetch whose reply was lost (nothing fetched since, no blocking pop armed):
    /// push back what it moved, while our own jobs keep running. Waits a little for pending
    /// acks to be confirmed, so the count of our jobs is exact; if it was not, the idle rescue
    /// stays due. False: Redis did not answer (fetch nothing yet, try again).
    pub async fn lost(&mut self, fetch: &FetchStrategy, queues: &[String]) -> bool {
        for _ in 0..ACK_SETTLE_CHECKS {
            if fetch.acks_pending() == 0 {
                break;
            }
            tokio::time::sleep(ACK_SETTLE_PAUSE).await;
        }
        let exact = fetch.acks_pending() == 0;
        match fetch.rescue_lost(queues).await {
            Ok(n) => {
                if n > 0 {
                    tracing::warn!(
                        jobs = n,
                        "returned jobs a failed fetch had moved into our working list"
                    );
                }
                self.hidden_left = false;
                self.may_hide_jobs &= !exact;
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "fetch: could not check our working lists; retrying in 1s");
                false
            }
        }
    }
}

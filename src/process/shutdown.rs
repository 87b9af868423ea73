//! The one shutdown state of a process, with its one deadline. It only ever moves forward:
//! running -> quiet -> stopping (deadline set) -> deadline moved to now by a second TERM.
//! Touches no Redis keys.

use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct State {
    /// Stop fetching (TSTP, or implied by stopping).
    pub quiet: bool,
    /// TERM/INT received: running jobs get until `deadline`.
    pub stopping: bool,
    pub deadline: Option<Instant>,
}

/// A cheap, cloneable handle on the process's shutdown state.
#[derive(Clone)]
pub struct Shutdown {
    tx: std::sync::Arc<watch::Sender<State>>,
}

impl Default for Shutdown {
    fn default() -> Self {
        Self::new()
    }
}

impl Shutdown {
    pub fn new() -> Shutdown {
        let (tx, _rx) = watch::channel(State::default());
        Shutdown {
            tx: std::sync::Arc::new(tx),
        }
    }

    pub fn state(&self) -> State {
        *self.tx.borrow()
    }

    /// TSTP: stop fetching, keep running jobs.
    pub fn quiet(&self) {
        self.tx
            .send_if_modified(|s| !std::mem::replace(&mut s.quiet, true));
    }

    /// TERM/INT: the first sets the deadline `timeout` from now; a second moves it to now.
    pub fn stop(&self, timeout: Duration) {
        self.tx.send_modify(|s| {
            s.quiet = true;
            let now = Instant::now();
            s.deadline = Some(if s.stopping { now } else { now + timeout });
            s.stopping = true;
        });
    }

    pub fn is_quiet(&self) -> bool {
        self.state().quiet
    }

    pub fn is_stopping(&self) -> bool {
        self.state().stopping
    }

    /// Whether the hard deadline has passed.
    pub fn past_deadline(&self) -> bool {
        matches!(self.state().deadline, Some(d) if Instant::now() >= d)
    }

    async fn wait_for(&self, f: impl Fn(&State) -> bool) {
        let mut rx = self.tx.subscribe();
        // wait_for only errs when the sender is gone; we hold it, so it cannot.
        let _ = rx.wait_for(|s| f(s)).await;
    }

    /// Resolves when fetching must stop (quiet or stopping). Cancel-safe.
    pub async fn quieted(&self) {
        self.wait_for(|s| s.quiet).await
    }

    /// Resolves when TERM/INT arrived. Cancel-safe.
    pub async fn stopped(&self) {
        self.wait_for(|s| s.stopping).await
    }

    /// Resolves at the hard deadline, following it if a second signal moves it. Cancel-safe.
    pub async fn hard_deadline(&self) {
        let mut rx = self.tx.subscribe();
        loop {
            let deadline = rx.borrow_and_update().deadline;
            match deadline {
                Some(d) if Instant::now() >= d => return,
                Some(d) => {
                    tokio::select! {
                        _ = tokio::time::sleep_until(d) => return,
                        r = rx.changed() => if r.is_err() { return },
                    }
                }
                None => {
                    if rx.changed().await.is_err() {
                        return;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn second_stop_moves_deadline_to_now() {
        let s = Shutdown::new();
        s.stop(Duration::from_secs(3600));
        assert!(s.is_quiet() && s.is_stopping() && !s.past_deadline());
        s.stop(Duration::from_secs(3600));
        tokio::time::timeout(Duration::from_secs(5), s.hard_deadline())
            .await
            .expect("deadline moved to now");
    }
}

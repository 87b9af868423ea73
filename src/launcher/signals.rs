//! Signals: the OS's (TERM, INT, TSTP, TTIN, listened for when `Signals::Handle`) and the
//! remote ones the heartbeat pops from `<identity>-signals` (Sidekiq's Web UI buttons), each
//! parsed once and applied to the shutdown state. Keys: none itself (the heartbeat reads the
//! signals list).

use crate::worker::Worker;
use std::sync::Arc;

/// Whether `run_with` listens for OS signals itself (the binary) or leaves them to the
/// embedder, who stops the worker through its `Shutdown`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signals {
    Handle,
    Ignore,
}

/// What an OS signal or a remote signal (Sidekiq's `<identity>-signals` list) asks for,
/// parsed once where it arrives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Signal {
    /// TERM or INT (the name, for the log line): stop; a second one moves the deadline to now.
    Stop(&'static str),
    /// TSTP: stop fetching, keep running jobs.
    Quiet,
    /// TTIN: log what every busy slot is doing.
    DumpSlots,
}

impl Signal {
    /// The signal named `name` ("TERM", "TSTP", ...), or None for one we do not act on.
    fn parse(name: &str) -> Option<Signal> {
        match name {
            "TERM" => Some(Signal::Stop("TERM")),
            "INT" => Some(Signal::Stop("INT")),
            "TSTP" => Some(Signal::Quiet),
            "TTIN" => Some(Signal::DumpSlots),
            _ => None,
        }
    }
}

/// Log what every busy slot is doing (TTIN).
fn dump_slots(worker: &Worker) {
    let snap = worker.slots.snapshot();
    tracing::info!(
        busy = snap.len(),
        concurrency = worker.config.concurrency,
        "TTIN: slot dump"
    );
    for (tid, e) in snap {
        tracing::info!(tid = %tid, jid = %e.jid, class = %e.class, queue = %e.queue,
            phase = e.phase.as_deref().unwrap_or("-"),
            runtime_ms = e.started.elapsed().as_millis() as u64, "busy");
    }
}

fn apply_signal(worker: &Worker, sig: Signal, remote: bool) {
    let from = if remote { "remote " } else { "" };
    match sig {
        Signal::Stop(name) => {
            let again = worker.shutdown.is_stopping();
            worker.shutdown.stop(worker.config.timeout);
            if again {
                tracing::warn!("{from}{name} again: shutdown deadline moved to now");
            } else {
                tracing::info!(
                    timeout_secs = worker.config.timeout.as_secs_f64(),
                    "{from}{name}: shutting down; running jobs get until the deadline"
                );
                crate::process::notify::stopping(&format!(
                    "stopping ({name}): running jobs get {} s",
                    worker.config.timeout.as_secs_f64()
                ));
            }
        }
        Signal::Quiet => {
            worker.shutdown.quiet();
            tracing::info!("{from}TSTP: quiet, no new jobs will be fetched");
        }
        Signal::DumpSlots => dump_slots(worker),
    }
}

/// A remote signal (a string from `<identity>-signals`): act on it, or log that it is ignored.
pub(super) fn apply_remote(worker: &Worker, name: &str) {
    match Signal::parse(name) {
        Some(sig) => apply_signal(worker, sig, true),
        None => tracing::info!("remote {name}: ignored"),
    }
}

pub(super) async fn listen(worker: Arc<Worker>) {
    use tokio::signal::unix::{signal, SignalKind};
    // USR1 and USR2 are listened for only so that they are logged, not fatal (their default).
    let kinds = [
        ("TERM", SignalKind::terminate()),
        ("INT", SignalKind::interrupt()),
        ("TSTP", SignalKind::from_raw(nix::libc::SIGTSTP)),
        ("TTIN", SignalKind::from_raw(nix::libc::SIGTTIN)),
        ("USR1", SignalKind::user_defined1()),
        ("USR2", SignalKind::user_defined2()),
    ];
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(&'static str, Option<Signal>)>();
    for (name, kind) in kinds {
        let sig = Signal::parse(name);
        match signal(kind) {
            Ok(mut s) => {
                let tx = tx.clone();
                tokio::spawn(async move {
                    while s.recv().await.is_some() {
                        if tx.send((name, sig)).is_err() {
                            return;
                        }
                    }
                });
            }
            Err(e) => tracing::warn!("cannot listen for SIG{name}: {e}"),
        }
    }
    while let Some((name, sig)) = rx.recv().await {
        match sig {
            Some(sig) => apply_signal(&worker, sig, false),
            None => tracing::info!("{name}: ignored"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Signal;

    #[test]
    fn signals_are_parsed_once_by_name() {
        assert_eq!(Signal::parse("TERM"), Some(Signal::Stop("TERM")));
        assert_eq!(Signal::parse("INT"), Some(Signal::Stop("INT")));
        assert_eq!(Signal::parse("TSTP"), Some(Signal::Quiet));
        assert_eq!(Signal::parse("TTIN"), Some(Signal::DumpSlots));
        for ignored in ["USR1", "USR2", "term", "KILL", ""] {
            assert_eq!(Signal::parse(ignored), None, "{ignored:?}");
        }
    }
}

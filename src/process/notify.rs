//! systemd's notify protocol (sd_notify(3), through the `sd-notify` crate): READY=1, STATUS=,
//! WATCHDOG=1 and STOPPING=1, each one datagram to the socket NOTIFY_SOCKET names. Without
//! NOTIFY_SOCKET nothing is sent and nothing is opened. Touches no Redis keys.

use sd_notify::NotifyState;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Whether a service manager asked for notifications (NOTIFY_SOCKET is set).
pub fn enabled() -> bool {
    std::env::var_os("NOTIFY_SOCKET").is_some_and(|s| !s.is_empty())
}

/// How often to send WATCHDOG=1: half of WATCHDOG_USEC, as sd_watchdog_enabled(3) advises,
/// when the watchdog is on for this process (WATCHDOG_PID unset or ours).
pub fn watchdog_interval() -> Option<Duration> {
    if !enabled() {
        return None;
    }
    sd_notify::watchdog_enabled()
        .filter(|d| !d.is_zero())
        .map(|d| d / 2)
}

/// READY=1 with the first status line: Redis answered and the first heartbeat landed.
pub fn ready(status: &str) {
    send(&[NotifyState::Ready, NotifyState::Status(status)]);
}

/// A STATUS= line (shown by `systemctl status`).
pub fn status(status: &str) {
    send(&[NotifyState::Status(status)]);
}

/// WATCHDOG=1 with the status line, in one datagram.
pub fn watchdog(status: &str) {
    send(&[NotifyState::Watchdog, NotifyState::Status(status)]);
}

/// STOPPING=1: TERM arrived, running jobs get until the deadline.
pub fn stopping(status: &str) {
    send(&[NotifyState::Stopping, NotifyState::Status(status)]);
}

/// One datagram; a failure is logged once (a manager that went away must not flood the log).
fn send(states: &[NotifyState]) {
    static WARNED: AtomicBool = AtomicBool::new(false);
    if !enabled() {
        return;
    }
    if let Err(e) = sd_notify::notify(states) {
        if !WARNED.swap(true, Ordering::Relaxed) {
            tracing::warn!(error = %e, "cannot notify the service manager (NOTIFY_SOCKET)");
        }
    }
}

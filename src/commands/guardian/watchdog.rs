//! The worker's check that its guardian still answers: a ping (`P`) every [`PING_EVERY`]
//! while commands are registered, answered at once (`p`) by the guardian's loop. A guardian
//! that leaves one unanswered for [`ANSWER_WITHIN`] is stopped (SIGSTOP) or stuck in the
//! kernel (an exec on a hung file system blocks its clone): it reaps nothing, reports no exit
//! and would kill nothing if we froze, so the commands it holds would run on past their
//! timeouts. It is declared gone: its commands' groups are killed and their runs end (a
//! failure each), it is SIGKILLed, a new one is started, and `/health` says so until a
//! guardian answers again (`metrics/server.rs`). Touches no Redis keys.

use super::client::{fail_all, Conn};
use super::frame::Frame;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// How often a guardian holding commands is asked whether it still answers.
const PING_EVERY: Duration = Duration::from_secs(1);
/// How long a ping may wait for its answer. The guardian answers from the same loop that
/// reaps and kills: one that cannot answer in this long cannot guard either.
pub(crate) const ANSWER_WITHIN: Duration = Duration::from_secs(5);

/// The watchdog thread of one guardian; it ends with the guardian.
pub(super) fn start(conn: &Arc<Conn>) -> std::io::Result<()> {
    let weak = Arc::downgrade(conn);
    std::thread::Builder::new()
        .name("playguard-guardian-ping".into())
        .spawn(move || watch(weak))?;
    Ok(())
}

fn watch(weak: Weak<Conn>) {
    loop {
        let slept = Instant::now();
        std::thread::sleep(PING_EVERY);
        let Some(conn) = weak.upgrade() else { return };
        if conn.is_dead() {
            return;
        }
        let send = {
            let mut p = conn.ping.lock().unwrap();
            // We ourselves were frozen (SIGSTOP, a VM pause) or not scheduled: the answer may
            // be waiting unread on the socket, so the wait starts again.
            if slept.elapsed() > PING_EVERY * 2 && p.waiting_since.is_some() {
                p.waiting_since = Some(Instant::now());
            }
            match p.waiting_since {
                Some(t) if t.elapsed() >= ANSWER_WITHIN => None,
                Some(_) => Some(false),
                None if p.answered && !conn.busy() => Some(false),
                None => {
                    p.waiting_since = Some(Instant::now());
                    Some(true)
                }
            }
        };
        match send {
            Some(true) => conn.send_plain(Frame::new(b'P').u64(0).done()),
            Some(false) => {}
            None => return replace(&conn),
        }
    }
}

/// The guardian did not answer in time: kill what it started and it, start another.
fn replace(conn: &Conn) {
    tracing::error!(
        guardian_pid = conn.pid,
        "the command guardian has not answered for {}s (stopped, or stuck in the kernel, as an exec on a hung file system is): killing it and the commands it started (each fails and is retried); starting a new one",
        ANSWER_WITHIN.as_secs()
    );
    crate::metrics::server::guardian_answers(false);
    fail_all(conn);
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(conn.pid),
        nix::sys::signal::Signal::SIGKILL,
    );
    if let Err(e) = super::get() {
        tracing::error!(error = %e, "could not start a new command guardian; the next command tries again");
    }
}

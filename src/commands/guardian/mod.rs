//! The command guardian: one long-lived helper process per worker that starts, reaps and, when
//! the worker dies or freezes, kills the worker's commands. It is this same executable run
//! again as `<exe> playguard-shepherd:<worker pid>` (the sweep looks for that argument, see
//! `loops/sweeper.rs`), started on the first command, its stdin a UNIX socket to the worker.
//! Touches no Redis keys.
//!
//! Why a separate process: a dead or frozen worker cannot kill anything, and forking the
//! worker itself per command (std falls back to fork for a `pre_exec` hook) is what made a
//! phase cost several forks and execs. The guardian starts each command with one vfork-style
//! clone and one exec (`process.rs`).
//!
//! Protocol (frames `[u32 length][u8 tag][body]`, integers little-endian, strings
//! `[u32 length][bytes]`):
//! - worker → guardian `S` spawn: id u64, budget u64 (milliseconds, 0 = no watchdog),
//!   program, argv, env pairs; stdin, stdout and stderr ride along as SCM_RIGHTS fds.
//! - worker → guardian `K` keepalive: id u64, budget u64 (milliseconds; the countdown starts
//!   again).
//! - guardian → worker `s` started: id u64, pid i32 (the process group id too). Held up to
//!   2 ms (`START_HOLD`) so that a short command's start and exit go in one write. (Should
//!   the guardian be killed inside those 2 ms, the worker cannot kill that one command's
//!   group: it never learnt the pid. It then runs to its end unwatched.)
//! - guardian → worker `e` not started: id u64, errno i32 (-1: none), message.
//! - guardian → worker `x` exited: id u64, raw wait status i32.
//! - worker → guardian `P` ping: 0 u64; guardian → worker `p` its answer: 0 u64. A guardian
//!   that leaves a ping unanswered too long is replaced (`watchdog.rs`).
//!
//! The guardian SIGKILLs a group when its countdown runs out (the frozen-worker case,
//! [`crate::process::liveness::Liveness::guardian_budget`]), right after its leader exited (nothing of
//! a finished command is left behind), and every group it started when the worker goes (EOF
//! on the socket, or PR_SET_PDEATHSIG). It exits only once those groups are empty, so while a
//! dead worker's command may still run, the sweep still sees `playguard-shepherd:<pid>`.

mod client;
mod frame;
mod process;
mod watchdog;

pub(crate) use client::{cloexec_pipe, Event, Handle};

use client::Conn;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The guardian's argument, which names its worker (`/proc/<pid>/cmdline` shows it).
pub fn guardian_arg(worker: u32) -> String {
    format!("{PREFIX}{worker}")
}

/// The argument keeps the component's first name: a worker's sweep must recognise the
/// guardians of workers of earlier versions still running beside it.
pub(crate) const PREFIX: &str = "playguard-shepherd:";
/// A sane cap on one frame: exec itself refuses far less (ARG_MAX), so only a broken peer
/// sends more.
pub(crate) const MAX_FRAME: usize = 64 << 20;
/// After it killed its groups on the worker's death, how long the guardian waits for them to
/// be gone before it exits anyway (a process stuck in the kernel cannot be hurried).
pub(crate) const EXIT_WAIT: Duration = Duration::from_secs(10);

static CURRENT: Mutex<Option<Arc<Conn>>> = Mutex::new(None);

/// The live guardian, started if there is none (or the last one died).
pub(crate) fn get() -> std::io::Result<Arc<Conn>> {
    let mut cur = CURRENT.lock().unwrap();
    if let Some(c) = cur.as_ref() {
        if !c.is_dead() {
            return Ok(c.clone());
        }
    }
    let c = client::start()?;
    watchdog::start(&c)?;
    *cur = Some(c.clone());
    Ok(c)
}

/// Call first thing in `main`, before any runtime or thread starts: when this process was
/// started as a guardian it runs as one and returns its exit code; otherwise None.
pub fn main_if_requested() -> Option<i32> {
    let mut args = std::env::args_os();
    let _exe = args.next();
    let first = args.next()?;
    let worker = first.to_str()?.strip_prefix(PREFIX)?.parse::<i32>().ok()?;
    if args.next().is_some() {
        return None;
    }
    Some(process::guard(worker))
}

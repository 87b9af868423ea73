//! Runs one manifest command: argv (never a shell), the PLAYGUARD_* environment, the payload on
//! stdin, in a process group of its own so a deadline or shutdown kills the whole tree.
//! Every stdout/stderr line is logged in the caller's span (jid, class, phase). With a
//! liveness lease, the shepherd also kills the group when the worker's keepalives stop (a
//! frozen worker cannot). Touches no Redis keys.

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use std::future::Future;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::Command;

/// Time between TERM and KILL when a command's group is stopped.
pub const KILL_GRACE: Duration = Duration::from_secs(2);
/// How many stderr lines are kept as the failure's "backtrace".
const STDERR_TAIL: usize = 20;

pub struct Spec<'a> {
    pub argv: &'a [String],
    pub env: Vec<(String, String)>,
    pub stdin: String,
    /// The process's liveness lease: the shepherd gets a keepalive countdown from it.
    pub keepalive: Option<crate::liveness::Liveness>,
}

#[derive(Debug)]
pub enum Exit {
    Success,
    /// Non-zero exit: message is the last non-empty stderr line.
    Failed {
        message: String,
        stderr_tail: Vec<String>,
    },
    /// We stopped it (deadline, lost lease, shutdown); `why` names the reason.
    Killed {
        why: String,
    },
    /// It could not be started at all.
    SpawnFailed(String),
}

/// `sh -c SHEPHERD playguard-shepherd:<worker pid> <budget> <prog> <args>...`: runs "$@" (prog and args, unparsed) with our
/// stdin, exits with its status, kills the whole group when the worker dies (SIGUSR2), and on
/// TERM/INT waits for the command to finish its own shutdown.
/// (A non-interactive sh gives a background command /dev/null as stdin, so the real stdin
/// travels through fd 3.)
///
/// With a `<budget>` (whole seconds), a watchdog subshell counts down one per `sleep 1` tick
/// and SIGKILLs the whole group at zero; every keepalive line the worker writes on fd 4 (a
/// pipe whose write end the ticker shares as fd 5) resets the countdown to the number it
/// carries. A frozen worker writes nothing, so its commands die before its alive key can
/// expire, without the worker being scheduled. The watchdog ignores TERM/INT so it keeps
/// guarding through a graceful stop; POSIX sh only (dash has no `read -t`, hence the ticker).
const SHEPHERD: &str = r#"trap 'kill -KILL 0' USR2
trap 'wait "$pid"; exit $?' TERM INT
budget=$1
shift
if [ -n "$budget" ]; then
  (
    trap '' TERM INT
    exec </dev/null >/dev/null 2>&1
    while sleep 1; do echo t; done >&5 &
    exec 5>&-
    left=$budget
    while read -r m; do
      case $m in
        t) left=$((left - 1)); [ "$left" -gt 0 ] || kill -KILL 0 ;;
        ''|*[!0-9]*) ;;
        *) left=$m ;;
      esac
    done <&4
  ) &
  exec 4<&- 5>&-
fi
exec 3<&0
"$@" <&3 3<&- &
pid=$!
exec 3<&-
wait "$pid"
exit $?"#;

/// The shepherd's `$0` (in its argv, so in /proc/<pid>/cmdline) for worker pid `worker`.
pub fn shepherd_name(worker: u32) -> String {
    format!("playguard-shepherd:{worker}")
}

/// The fds the shepherd's watchdog reads keepalives from (4) and ticks into (5).
const KEEPALIVE_READ_FD: i32 = 4;
const KEEPALIVE_TICK_FD: i32 = 5;

/// Aborts the keepalive writer when the command is done (its pipe end closes with it).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A close-on-exec pipe: (read end, write end).
fn cloexec_pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as nix::libc::c_int; 2];
    // SAFETY: pipe2 fills both fds on success; we own them from here on.
    if unsafe { nix::libc::pipe2(fds.as_mut_ptr(), nix::libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// In the child between fork and exec: put `r` on fd 4 and `w` on fd 5 (without close-on-exec).
/// Async-signal-safe calls only.
fn place_keepalive_fds(r: RawFd, w: RawFd) -> std::io::Result<()> {
    use nix::libc::{close, dup2, fcntl, F_DUPFD};
    // SAFETY: plain fd syscalls on fds we own in this (forked) process.
    unsafe {
        // Out of the way first, so placing one cannot clobber the other.
        let r2 = fcntl(r, F_DUPFD, 10);
        let w2 = fcntl(w, F_DUPFD, 10);
        if r2 < 0 || w2 < 0 || dup2(r2, KEEPALIVE_READ_FD) < 0 || dup2(w2, KEEPALIVE_TICK_FD) < 0 {
            return Err(std::io::Error::last_os_error());
        }
        close(r2);
        close(w2);
    }
    Ok(())
}

/// SIGKILLs a process group when dropped.
struct GroupGuard(Option<Pid>);

impl Drop for GroupGuard {
    fn drop(&mut self) {
        if let Some(pg) = self.0 {
            let _ = killpg(pg, Signal::SIGKILL);
        }
    }
}

/// Why a running command is being stopped, and how long it may take to go after TERM.
/// A zero grace means KILL at once (a lapsed lease leaves no time to be polite).
pub struct Stop {
    pub why: String,
    pub grace: Duration,
}

impl Stop {
    pub fn term(why: impl Into<String>) -> Stop {
        Stop {
            why: why.into(),
            grace: KILL_GRACE,
        }
    }

    pub fn kill(why: impl Into<String>) -> Stop {
        Stop {
            why: why.into(),
            grace: Duration::ZERO,
        }
    }
}

/// Run the command until it exits or `stop` resolves (then its group gets TERM and, after the
/// stop's grace, KILL).
pub async fn run(spec: Spec<'_>, stop: impl Future<Output = Stop>) -> Exit {
    let Some((prog, args)) = spec.argv.split_first() else {
        return Exit::SpawnFailed("empty argv".into());
    };
    // The command runs under a small sh "shepherd" that leads its process group. If the worker
    // dies (SIGKILL, OOM), the kernel sends the shepherd SIGUSR2 (PR_SET_PDEATHSIG, kept across
    // exec) and it SIGKILLs the whole group: the command and anything it started. Otherwise a
    // recovered job would run beside its orphan, or a phase (and its ssh) run on unleased.
    // On TERM (our shutdown) the shepherd waits for the command's own exit, so a command that
    // handles TERM gracefully still can. argv is passed as "$@": still no shell parsing.
    // The keepalive pipe, when the worker holds a liveness lease (see SHEPHERD).
    let budget = spec.keepalive.as_ref().and_then(|l| l.shepherd_budget());
    let pipe = match budget {
        Some(_) => match cloexec_pipe() {
            Ok(p) => Some(p),
            Err(e) => return Exit::SpawnFailed(format!("cannot create the keepalive pipe: {e}")),
        },
        None => None,
    };
    let mut cmd = Command::new("/bin/sh");
    cmd.arg("-c")
        .arg(SHEPHERD)
        // $0 names the worker, so a sweep can tell our shepherds are all gone (sweeper.rs).
        .arg(shepherd_name(std::process::id()))
        .arg(budget.map(|b| b.to_string()).unwrap_or_default())
        .arg(prog)
        .args(args)
        .envs(spec.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    // tokio's worker threads, which spawn these, live as long as the process, so the death
    // signal fires when the worker process goes. The getppid check closes the race where the
    // worker died between fork and prctl.
    let parent = std::process::id() as nix::libc::pid_t;
    let child_fds = pipe.as_ref().map(|(r, w)| (r.as_raw_fd(), w.as_raw_fd()));
    // SAFETY: only async-signal-safe calls (prctl, getppid, _exit, fcntl, dup2, close) run
    // between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if nix::libc::prctl(nix::libc::PR_SET_PDEATHSIG, nix::libc::SIGUSR2, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if nix::libc::getppid() != parent {
                nix::libc::_exit(1);
            }
            if let Some((r, w)) = child_fds {
                place_keepalive_fds(r, w)?;
            }
            Ok(())
        });
    }
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => return Exit::SpawnFailed(format!("cannot start {prog:?}: {e}")),
    };
    // Keepalives: after each heartbeat that refreshed our alive key, tell the shepherd how long
    // it may go on. Nothing is written while the lease is lapsed, so the countdown runs out.
    let _keepalive = match (pipe, spec.keepalive.clone()) {
        (Some((read_end, write_end)), Some(lv)) => {
            drop(read_end);
            // Never block the runtime on a full pipe (the shepherd reads every line at once).
            // SAFETY: fcntl on a pipe fd we own.
            unsafe {
                let fl = nix::libc::fcntl(write_end.as_raw_fd(), nix::libc::F_GETFL);
                nix::libc::fcntl(
                    write_end.as_raw_fd(),
                    nix::libc::F_SETFL,
                    fl | nix::libc::O_NONBLOCK,
                );
            }
            Some(AbortOnDrop(tokio::spawn(async move {
                loop {
                    lv.changed().await;
                    if !lv.is_live() {
                        continue;
                    }
                    if let Some(n) = lv.shepherd_budget() {
                        let _ = nix::unistd::write(&write_end, format!("{n}\n").as_bytes());
                    }
                }
            })))
        }
        _ => None,
    };
    let pgid = child.id().map(|id| Pid::from_raw(id as i32));
    // If this future is dropped mid-run (a job abandoned at the deadline), the whole group
    // dies with it, not just the leader that kill_on_drop would reach.
    let _group = GroupGuard(pgid);
    if let Some(mut stdin) = child.stdin.take() {
        let input = spec.stdin.clone();
        // A command that never reads stdin must not block us: write from a task, ignore EPIPE.
        tokio::spawn(async move {
            let _ = stdin.write_all(input.as_bytes()).await;
        });
    }
    let out = child.stdout.take().map(|s| {
        tokio::spawn(tracing::Instrument::in_current_span(async move {
            let mut lines = BufReader::new(s).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                tracing::info!(stream = "stdout", "{line}");
            }
        }))
    });
    let err = child.stderr.take().map(|s| {
        tokio::spawn(tracing::Instrument::in_current_span(async move {
            let mut tail: Vec<String> = Vec::new();
            let mut lines = BufReader::new(s).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                tracing::info!(stream = "stderr", "{line}");
                if !line.trim().is_empty() {
                    if tail.len() == STDERR_TAIL {
                        tail.remove(0);
                    }
                    tail.push(line);
                }
            }
            tail
        }))
    });

    let mut killed: Option<String> = None;
    tokio::pin!(stop);
    let status = tokio::select! {
        st = child.wait() => st,
        st = &mut stop => {
            killed = Some(st.why);
            if let Some(pg) = pgid {
                let first = if st.grace.is_zero() { Signal::SIGKILL } else { Signal::SIGTERM };
                let _ = killpg(pg, first);
            }
            match tokio::time::timeout(st.grace, child.wait()).await {
                Ok(st) => st,
                Err(_) => {
                    if let Some(pg) = pgid {
                        let _ = killpg(pg, Signal::SIGKILL);
                    }
                    child.wait().await
                }
            }
        }
    };
    // Whatever the leader did, leave nothing of its group behind (no orphans holding pipes).
    drop(_group);
    if let Some(h) = out {
        let _ = h.await;
    }
    let tail = match err {
        Some(h) => h.await.unwrap_or_default(),
        None => Vec::new(),
    };
    if let Some(why) = killed {
        return Exit::Killed { why };
    }
    match status {
        Ok(st) if st.success() => Exit::Success,
        Ok(st) => {
            let message = tail
                .last()
                .cloned()
                .unwrap_or_else(|| format!("{prog} exited with {st}"));
            Exit::Failed {
                message,
                stderr_tail: tail,
            }
        }
        Err(e) => Exit::SpawnFailed(format!("waiting for {prog:?}: {e}")),
    }
}

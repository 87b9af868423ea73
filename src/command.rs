//! Runs one manifest command: argv (never a shell), the PLAYGUARD_* environment, the payload on
//! stdin, in a process group of its own so a deadline or shutdown kills the whole tree.
//! Every stdout/stderr line is logged in the caller's span (jid, class, phase): read as bytes
//! (not UTF-8 is shown lossily), cut at MAX_LINE. With a liveness lease, the shepherd also
//! kills the group when the worker's keepalives stop (a frozen worker cannot). Touches no
//! Redis keys.

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use std::future::Future;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWriteExt, BufReader};
use tokio::process::Command;

/// Time between TERM and KILL when a command's group is stopped.
pub const KILL_GRACE: Duration = Duration::from_secs(2);
/// How many stderr lines are kept as the failure's "backtrace".
const STDERR_TAIL: usize = 20;
/// Longest output line logged whole: the rest of a longer one is dropped, so a command that
/// prints megabytes without a newline cannot grow our memory (or one log line) without bound.
pub const MAX_LINE: usize = 16 * 1024;
/// After the command's shepherd exited, how long its output may take to reach EOF. Only a
/// process that left the group (`setsid`) can hold the pipes open longer; the job is over
/// by then, and its slot must not wait for that process.
const OUTPUT_DRAIN: Duration = Duration::from_secs(1);

pub struct Spec<'a> {
    pub argv: &'a [String],
    pub env: Vec<(String, String)>,
    /// The worker's variables the command inherits: None = all of them (as a Procfile
    /// process has), Some = only these names. `env` is set on top either way.
    pub inherit: Option<&'a [String]>,
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
    /// The job's data cannot be handed to a command (a NUL byte, too large for exec): no retry
    /// can help.
    BadInput(String),
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
        .args(args);
    if let Some(names) = spec.inherit {
        cmd.env_clear();
        for name in names {
            if let Some(v) = std::env::var_os(name) {
                cmd.env(name, v);
            }
        }
    }
    cmd.envs(spec.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
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
    // An environment variable cannot hold a NUL (the C string would end there): say which.
    if let Some((k, _)) = spec.env.iter().find(|(_, v)| v.contains('\0')) {
        return Exit::BadInput(format!(
            "{k} would hold a NUL byte, which an environment variable cannot carry"
        ));
    }
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) if e.raw_os_error() == Some(nix::libc::E2BIG) => {
            let bytes: usize = spec.env.iter().map(|(k, v)| k.len() + v.len() + 2).sum();
            return Exit::BadInput(format!(
                "cannot start {prog:?}: the job's arguments are too large for exec \
                 ({bytes} bytes of PLAYGUARD_* environment; Linux allows 128 KiB per variable): {e}"
            ));
        }
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
    let writer = child.stdin.take().map(|mut stdin| {
        let input = spec.stdin.clone();
        // A command that never reads stdin must not block us: write from a task, ignore EPIPE.
        tokio::spawn(async move {
            let _ = stdin.write_all(input.as_bytes()).await;
        })
    });
    let mut out = child.stdout.take().map(|s| {
        tokio::spawn(tracing::Instrument::in_current_span(read_lines(
            s,
            |line| {
                tracing::info!(stream = "stdout", "{line}");
            },
        )))
    });
    // Shared, not returned: a reader still blocked after the drain is aborted, and the lines it
    // already read must still make the failure's message.
    let tail: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut err = child.stderr.take().map(|s| {
        let tail = tail.clone();
        tokio::spawn(tracing::Instrument::in_current_span(read_lines(
            s,
            move |line| {
                tracing::info!(stream = "stderr", "{line}");
                if !line.trim().is_empty() {
                    let mut tail = tail.lock().unwrap();
                    if tail.len() == STDERR_TAIL {
                        tail.remove(0);
                    }
                    tail.push(line);
                }
            },
        )))
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
    let drained = tokio::time::timeout(OUTPUT_DRAIN, async {
        for h in [out.as_mut(), err.as_mut()].into_iter().flatten() {
            let _ = h.await;
        }
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            "the command exited, but a process it started outside its group still holds its output open; no longer reading it"
        );
    }
    for h in [out, err, writer].into_iter().flatten() {
        h.abort();
    }
    let tail = std::mem::take(&mut *tail.lock().unwrap());
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

/// Hand every line of `r` to `each`, as text (bytes that are not UTF-8 become U+FFFD), a line
/// longer than MAX_LINE cut there. A read error ends it like EOF.
async fn read_lines<R: AsyncRead + Unpin>(r: R, mut each: impl FnMut(String)) {
    let mut r = BufReader::new(r);
    let mut line: Vec<u8> = Vec::new();
    // Past MAX_LINE of the current line: drop bytes until its newline.
    let mut cut = false;
    loop {
        let buf = match r.fill_buf().await {
            Ok([]) | Err(_) => break,
            Ok(b) => b,
        };
        let (chunk, newline) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (&buf[..i], true),
            None => (buf, false),
        };
        let used = chunk.len() + usize::from(newline);
        if !cut {
            let room = MAX_LINE - line.len();
            line.extend_from_slice(&chunk[..chunk.len().min(room)]);
            if chunk.len() > room {
                cut = true;
                let mut text = String::from_utf8_lossy(&line).into_owned();
                text.push_str(&format!(" [line cut at {MAX_LINE} bytes]"));
                each(text);
                line.clear();
            }
        }
        r.consume(used);
        if newline {
            if !cut {
                let end = line.len() - usize::from(line.last() == Some(&b'\r'));
                each(String::from_utf8_lossy(&line[..end]).into_owned());
            }
            line.clear();
            cut = false;
        }
    }
    if !line.is_empty() && !cut {
        each(String::from_utf8_lossy(&line).into_owned());
    }
}

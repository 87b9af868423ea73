//! Runs one manifest command: argv (never a shell), the PLAYGUARD_* environment, the payload on
//! stdin, in a process group of its own so a deadline or shutdown kills the whole tree.
//! Every stdout/stderr line is logged in the caller's span (jid, class, phase): read as bytes
//! (not UTF-8 is shown lossily), cut at MAX_LINE. The process is started and reaped by the
//! worker's guardian (`guardian/` beside this file), which also kills the group when the worker dies or, with
//! a liveness lease, when its keepalives stop (a frozen worker cannot). Touches no Redis keys.

use crate::commands::guardian::{cloexec_pipe, Event, Handle};
use crate::process::liveness::Liveness;
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use std::ffi::{OsStr, OsString};
use std::future::Future;
use std::os::fd::{AsRawFd, OwnedFd};
use std::pin::Pin;
use std::sync::Mutex;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc::UnboundedReceiver;

/// Time between TERM and KILL when a command's group is stopped.
pub const KILL_GRACE: Duration = Duration::from_secs(2);
/// How many stderr lines are kept as the failure's "backtrace".
const STDERR_TAIL: usize = 20;
/// Longest output line logged whole: the rest of a longer one is dropped, so a command that
/// prints megabytes without a newline cannot grow our memory (or one log line) without bound.
pub const MAX_LINE: usize = 16 * 1024;
/// After the command's leader exited, how long its output may take to reach EOF. Only a
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
    /// The process's liveness lease: the guardian gets a keepalive countdown from it.
    pub keepalive: Option<crate::process::liveness::Liveness>,
    /// The latest the command may live whatever the lease says (a phase's lock: before it can
    /// expire in Redis). The guardian's countdown never runs past it, with a lease or
    /// without one (basic fetch), so a frozen worker's phase is dead before a new holder
    /// can take the lock.
    pub kill_by: Option<tokio::time::Instant>,
}

#[derive(Debug)]
pub enum Exit {
    Success,
    /// Non-zero exit: message is the last non-empty stderr line.
    Failed {
        message: String,
        stderr_tail: Vec<String>,
        /// Its exit code (None: ended by a signal).
        code: Option<i32>,
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

/// The worker's environment, read at its first command: what commands inherit. Read once,
/// not per command (a copy of every variable and a sort each time was a tenth of the
/// worker's instructions per phase); a worker's environment is fixed from its start.
fn base_env() -> &'static [(OsString, OsString)] {
    static BASE: std::sync::OnceLock<Vec<(OsString, OsString)>> = std::sync::OnceLock::new();
    BASE.get_or_init(|| {
        let mut seen = std::collections::HashSet::new();
        std::env::vars_os()
            .filter(|(k, _)| seen.insert(k.clone()))
            .collect()
    })
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

/// Our end of a pipe, non-blocking for the runtime (the command's end stays blocking: they are
/// separate open files). A fresh pipe end has no other status flag, so none is read first.
fn nonblocking(fd: &OwnedFd) {
    // SAFETY: fcntl on a pipe fd we own.
    unsafe {
        nix::libc::fcntl(fd.as_raw_fd(), nix::libc::F_SETFL, nix::libc::O_NONBLOCK);
    }
}

/// Write what the non-blocking pipe `fd` takes of `input` now: the count written, or all of
/// it when the reader is gone (EPIPE: nothing more to deliver).
fn write_now(fd: &OwnedFd, input: &[u8]) -> usize {
    let mut done = 0;
    while done < input.len() {
        match nix::unistd::write(fd, &input[done..]) {
            Ok(n) => done += n,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(nix::errno::Errno::EAGAIN) => break,
            Err(_) => return input.len(),
        }
    }
    done
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
pub async fn run(mut spec: Spec<'_>, stop: impl Future<Output = Stop>) -> Exit {
    // The current span (the job's, or its phase's) for the command's own spans.
    crate::traces::command_env(&mut spec.env);
    let Some((prog, _)) = spec.argv.split_first() else {
        return Exit::SpawnFailed("empty argv".into());
    };
    if let Err(exit) = check_input(&spec, prog) {
        return exit;
    }
    let env = command_env(&spec);
    let ((in_r, in_w), (out_r, out_w), (err_r, err_w)) = match open_pipes() {
        Ok(p) => p,
        Err(e) => return Exit::SpawnFailed(format!("cannot start {prog:?}: pipes: {e}")),
    };
    let budget = countdown(spec.keepalive.as_ref(), spec.kill_by);
    let (handle, events) = match start(prog, &spec, &env, budget, vec![in_r, out_w, err_w]) {
        Ok(started) => started,
        Err(exit) => return exit,
    };
    // The guardian reports the start (the pid, which is also the group's id) and the exit; for
    // a short command both come in one message, so nothing here waits for the start alone.
    let mut cmd = Tracked {
        events,
        group: GroupGuard(None),
        ended: None,
    };
    let keepalive = keepalives(spec.keepalive.as_ref(), spec.kill_by, budget, &handle);
    tokio::pin!(keepalive);
    let writer = write_stdin(in_w, spec.stdin.as_bytes());
    // Lent to the stderr reader, which may be dropped after the drain: the lines it already
    // read must still make the failure's message.
    let tail: Mutex<Vec<String>> = Mutex::default();
    let output = read_output(out_r, err_r, &tail);
    tokio::pin!(output);
    let mut output_done = false;
    let mut killed: Option<String> = None;
    // The command's end, with its output read meanwhile.
    let status = {
        let running = wait_or_stop(&mut cmd, keepalive.as_mut(), stop, &mut killed);
        tokio::pin!(running);
        loop {
            tokio::select! {
                st = &mut running => break st,
                () = &mut output, if !output_done => output_done = true,
            }
        }
    };
    let status = match status {
        Ok(st) => st,
        Err(not) => {
            if let Some(h) = writer {
                h.abort();
            }
            return not_started(not, prog, &spec.env);
        }
    };
    // Whatever the leader did, leave nothing of its group behind (no orphans holding pipes).
    // The guardian did so as it reaped the leader, before it reported the exit; this covers
    // a guardian that went first (no exit reported).
    if status.is_some() {
        cmd.group.0 = None;
    }
    drop(cmd);
    if !output_done {
        drain(output).await;
    }
    if let Some(h) = writer {
        h.abort();
    }
    let tail = std::mem::take(&mut *tail.lock().unwrap());
    ended(prog, status, killed, tail)
}

/// Refuse what exec cannot carry before anything is started.
fn check_input(spec: &Spec<'_>, prog: &str) -> Result<(), Exit> {
    // An environment variable cannot hold a NUL (the C string would end there): say which.
    if let Some((k, _)) = spec.env.iter().find(|(_, v)| v.contains('\0')) {
        return Err(Exit::BadInput(format!(
            "{k} would hold a NUL byte, which an environment variable cannot carry"
        )));
    }
    if spec.argv.iter().any(|a| a.contains('\0')) {
        return Err(Exit::SpawnFailed(format!(
            "cannot start {prog:?}: nul byte found in provided data"
        )));
    }
    Ok(())
}

/// The worker's variables the command inherits (all, or the names allowed), then ours on
/// top: each name once.
fn command_env<'a>(spec: &'a Spec<'_>) -> Vec<(&'a OsStr, &'a OsStr)> {
    let base = base_env();
    let ours = |k: &OsStr| spec.env.iter().any(|(n, _)| OsStr::new(n) == k);
    let mut env: Vec<(&OsStr, &OsStr)> = Vec::with_capacity(base.len() + spec.env.len());
    match spec.inherit {
        Some(names) => {
            for (i, n) in names.iter().enumerate() {
                let n = OsStr::new(n);
                if ours(n) || names[..i].iter().any(|m| OsStr::new(m) == n) {
                    continue;
                }
                if let Some((_, v)) = base.iter().find(|(k, _)| k == n) {
                    env.push((n, v));
                }
            }
        }
        None => env.extend(
            base.iter()
                .filter(|(k, _)| !ours(k))
                .map(|(k, v)| (k.as_os_str(), v.as_os_str())),
        ),
    }
    env.extend(spec.env.iter().map(|(k, v)| (OsStr::new(k), OsStr::new(v))));
    env
}

type Pipe = (OwnedFd, OwnedFd);

/// stdin, stdout and stderr pipes; our ends (stdin's write end, the outputs' read ends)
/// non-blocking for the runtime.
fn open_pipes() -> std::io::Result<(Pipe, Pipe, Pipe)> {
    let pipes = (cloexec_pipe()?, cloexec_pipe()?, cloexec_pipe()?);
    for fd in [&pipes.0 .1, &pipes.1 .0, &pipes.2 .0] {
        nonblocking(fd);
    }
    Ok(pipes)
}

/// Hand the command to our guardian (guardian/), which starts it in a process group of its
/// own, so the whole group can be killed: by us when the command is stopped, by the guardian
/// when we die (SIGKILL, OOM) or freeze (its countdown, `budget`, runs out without a
/// keepalive). Otherwise a recovered job would run beside its orphan, or a phase (and its
/// ssh) run on unleased. argv goes to exec as it is: no shell parsing.
fn start(
    prog: &str,
    spec: &Spec<'_>,
    env: &[(&OsStr, &OsStr)],
    budget: Option<u64>,
    fds: Vec<OwnedFd>,
) -> Result<(Handle, UnboundedReceiver<Event>), Exit> {
    let conn = crate::commands::guardian::get().map_err(|e| {
        Exit::SpawnFailed(format!("cannot start {prog:?}: no command guardian: {e}"))
    })?;
    conn.spawn(OsStr::new(prog), spec.argv, env, budget, fds)
        .map_err(|()| {
            Exit::SpawnFailed(format!(
                "cannot start {prog:?}: the command guardian exited"
            ))
        })
}

/// The guardian's countdown, in milliseconds: the smaller of the lease's budget
/// ([`Liveness::guardian_budget`]) and the time left until `kill_by`, at least 1 (0 means no
/// countdown). None: neither applies.
fn countdown(lease: Option<&Liveness>, kill_by: Option<tokio::time::Instant>) -> Option<u64> {
    let lease = lease.and_then(|l| l.guardian_budget()).map(|s| s * 1000);
    let lock = kill_by.map(|t| {
        let left = t.saturating_duration_since(tokio::time::Instant::now());
        (left.as_millis() as u64).max(1)
    });
    match (lease, lock) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Keepalives: after each heartbeat that refreshed our alive key, tell the guardian how long
/// this command may go on (never past `kill_by`). Nothing is sent while the lease is lapsed,
/// so the countdown runs out. Never ends.
async fn keepalives(
    lease: Option<&Liveness>,
    kill_by: Option<tokio::time::Instant>,
    budget: Option<u64>,
    handle: &Handle,
) {
    match lease.filter(|_| budget.is_some()) {
        Some(lv) => loop {
            lv.changed().await;
            if !lv.is_live() {
                continue;
            }
            if let Some(n) = countdown(Some(lv), kill_by) {
                handle.keepalive(n);
            }
        },
        None => std::future::pending().await,
    }
}

/// The payload usually fits the pipe's buffer: written here, with no task and no poller
/// registration. A command that never reads stdin must not block us: the rest (if any) is
/// written from a task, EPIPE ignored.
fn write_stdin(in_w: OwnedFd, input: &[u8]) -> Option<tokio::task::JoinHandle<()>> {
    let done = write_now(&in_w, input);
    if done == input.len() {
        return None;
    }
    let rest = input[done..].to_vec();
    let mut stdin = tokio::net::unix::pipe::Sender::from_owned_fd(in_w).ok()?;
    Some(tokio::spawn(async move {
        let _ = stdin.write_all(&rest).await;
    }))
}

/// Both output streams, read right here in the command's future (no task each, no wake-up
/// handed between tasks): they are polled whenever it is, so in its job's log context.
/// stderr's last non-empty lines are kept in `tail`. Our own pipes' read ends are already
/// non-blocking: tokio need not fstat and fcntl them.
async fn read_output(out_r: OwnedFd, err_r: OwnedFd, tail: &Mutex<Vec<String>>) {
    use futures::future::OptionFuture;
    let out = tokio::net::unix::pipe::Receiver::from_owned_fd_unchecked(out_r)
        .ok()
        .map(|s| {
            read_lines(s, |line| {
                tracing::info!(stream = "stdout", "{line}");
            })
        });
    let err = tokio::net::unix::pipe::Receiver::from_owned_fd_unchecked(err_r)
        .ok()
        .map(|s| {
            read_lines(s, move |line| {
                tracing::info!(stream = "stderr", "{line}");
                if !line.trim().is_empty() {
                    let mut tail = tail.lock().unwrap();
                    if tail.len() == STDERR_TAIL {
                        tail.remove(0);
                    }
                    tail.push(line);
                }
            })
        });
    tokio::join!(OptionFuture::from(out), OptionFuture::from(err));
}

/// The leader's exit, or, once `stop` resolves, its group stopped: TERM (KILL for a zero
/// grace), then KILL after the grace. `killed` records why. Ok(None): the guardian went first.
async fn wait_or_stop(
    cmd: &mut Tracked,
    mut keepalive: Pin<&mut impl Future<Output = ()>>,
    stop: impl Future<Output = Stop>,
    killed: &mut Option<String>,
) -> Result<Option<std::process::ExitStatus>, NotStarted> {
    let st = tokio::select! {
        st = cmd.exit() => return st,
        _ = &mut keepalive => return Ok(None),
        st = stop => st,
    };
    *killed = Some(st.why);
    let first = if st.grace.is_zero() {
        Signal::SIGKILL
    } else {
        Signal::SIGTERM
    };
    let graceful = async {
        // A stop right after the spawn may come before the guardian named the pid.
        if let Some(pg) = cmd.pid().await? {
            let _ = killpg(pg, first);
        }
        tokio::select! {
            st = cmd.exit() => st,
            _ = &mut keepalive => Ok(None),
        }
    };
    if let Ok(st) = tokio::time::timeout(st.grace, graceful).await {
        return st;
    }
    // Also when the start was not reported within the grace (a zero grace gives it no time
    // at all): KILL as soon as it is.
    if let Some(pg) = cmd.pid().await? {
        let _ = killpg(pg, Signal::SIGKILL);
    }
    cmd.exit().await
}

/// What a command the guardian could not start ends as.
fn not_started(not: NotStarted, prog: &str, env: &[(String, String)]) -> Exit {
    let NotStarted { errno, message } = not;
    if errno == nix::libc::E2BIG {
        let e = std::io::Error::from_raw_os_error(errno);
        let bytes: usize = env.iter().map(|(k, v)| k.len() + v.len() + 2).sum();
        return Exit::BadInput(format!(
            "cannot start {prog:?}: the job's arguments are too large for exec \
             ({bytes} bytes of PLAYGUARD_* environment; Linux allows 128 KiB per variable): {e}"
        ));
    }
    let e = if errno > 0 {
        std::io::Error::from_raw_os_error(errno).to_string()
    } else {
        message
    };
    Exit::SpawnFailed(format!("cannot start {prog:?}: {e}"))
}

/// After the leader exited, its output gets OUTPUT_DRAIN to reach EOF.
async fn drain(output: Pin<&mut impl Future<Output = ()>>) {
    if tokio::time::timeout(OUTPUT_DRAIN, output).await.is_err() {
        tracing::warn!(
            "the command exited, but a process it started outside its group still holds its output open; no longer reading it"
        );
    }
}

/// What a command that ran ends as: killed by us, a success, a failure named by its last
/// stderr line, or lost with its guardian.
fn ended(
    prog: &str,
    status: Option<std::process::ExitStatus>,
    killed: Option<String>,
    tail: Vec<String>,
) -> Exit {
    if let Some(why) = killed {
        return Exit::Killed { why };
    }
    match status {
        Some(st) if st.success() => Exit::Success,
        Some(st) => {
            let message = tail
                .last()
                .cloned()
                .unwrap_or_else(|| format!("{prog} exited with {st}"));
            Exit::Failed {
                message,
                stderr_tail: tail,
                code: st.code(),
            }
        }
        None => Exit::SpawnFailed(format!(
            "{prog:?} lost its command guardian while it ran (its process group was killed)"
        )),
    }
}

/// The guardian could not start the command.
struct NotStarted {
    errno: i32,
    message: String,
}

/// One command as the guardian reports it: its group (killed if we are dropped before the
/// exit) is known once the start is reported.
struct Tracked {
    events: tokio::sync::mpsc::UnboundedReceiver<Event>,
    group: GroupGuard,
    /// The exit, once reported (None inside: the guardian went first).
    ended: Option<Option<std::process::ExitStatus>>,
}

impl Tracked {
    /// Take one report and record it. Cancel-safe: nothing is awaited after the receive.
    async fn next(&mut self) -> Result<(), NotStarted> {
        match self.events.recv().await {
            Some(Event::Started(pid)) => self.group.0 = Some(Pid::from_raw(pid)),
            Some(Event::NotStarted { errno, message }) => {
                return Err(NotStarted { errno, message })
            }
            Some(Event::Exited(st)) => self.ended = Some(Some(st)),
            None => self.ended = Some(None),
        }
        Ok(())
    }

    /// The leader's exit as the guardian reaped it; Ok(None): the guardian went first.
    async fn exit(&mut self) -> Result<Option<std::process::ExitStatus>, NotStarted> {
        loop {
            if let Some(end) = self.ended {
                return Ok(end);
            }
            self.next().await?;
        }
    }

    /// The group to signal, waiting for the start report if it has not come yet; Ok(None):
    /// the command has already ended.
    async fn pid(&mut self) -> Result<Option<Pid>, NotStarted> {
        while self.group.0.is_none() && self.ended.is_none() {
            self.next().await?;
        }
        Ok(self.group.0.filter(|_| self.ended.is_none()))
    }
}

/// Hand every line of `r` to `each`, as text (bytes that are not UTF-8 become U+FFFD), a line
/// longer than MAX_LINE cut there. A read error ends it like EOF.
async fn read_lines<R: AsyncRead + Unpin>(mut r: R, mut each: impl FnMut(String)) {
    // Our own buffer rather than a BufReader's, which is zeroed when it is made: most commands
    // print nothing, and two zeroed buffers per command were a tenth of a phase's instructions.
    let mut buf: Vec<u8> = Vec::with_capacity(8 * 1024);
    let mut line: Vec<u8> = Vec::new();
    // Past MAX_LINE of the current line: drop bytes until its newline.
    let mut cut = false;
    loop {
        buf.clear();
        match r.read_buf(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        let mut rest = &buf[..];
        while !rest.is_empty() {
            let (chunk, newline) = match rest.iter().position(|&b| b == b'\n') {
                Some(i) => (&rest[..i], true),
                None => (rest, false),
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
            rest = &rest[used..];
            if newline {
                if !cut {
                    let end = line.len() - usize::from(line.last() == Some(&b'\r'));
                    each(String::from_utf8_lossy(&line[..end]).into_owned());
                }
                line.clear();
                cut = false;
            }
        }
    }
    if !line.is_empty() && !cut {
        each(String::from_utf8_lossy(&line).into_owned());
    }
}

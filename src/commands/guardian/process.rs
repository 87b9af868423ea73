//! The guardian process itself: a single-threaded loop over its socket and a signalfd that
//! spawns commands (one vfork-style clone and exec each, in its own process group), reaps them, runs their
//! keepalive countdowns and kills every group when the worker goes. Touches no Redis keys.

use super::frame::{frames, Body, Frame};
use super::EXIT_WAIT;

use nix::sys::signal::{killpg, SigSet, Signal};
use nix::sys::socket::{ControlMessageOwned, MsgFlags, UnixAddr};
use nix::unistd::Pid;
use std::collections::{HashMap, VecDeque};
use std::ffi::{OsStr, OsString};
use std::io::IoSliceMut;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::time::{Duration, Instant};

/// The child's stack between clone and exec: a handful of system calls need far less (glibc's
/// posix_spawn gives its child 32 KiB plus the argv).
const CHILD_STACK: usize = 64 * 1024;

/// How long a start report waits to go out with the command's exit: most phase commands end
/// within it, and then the worker hears of both in one message (one wake-up, not two). The
/// worker waits for the start only to signal the group, which a stop then does this much
/// later at worst.
const START_HOLD: Duration = Duration::from_millis(2);

struct Group {
    id: u64,
    /// With a watchdog: when the countdown runs out.
    deadline: Option<Instant>,
    watched: bool,
}

struct Guardian {
    sock: OwnedFd,
    /// By leader pid (= process group id).
    groups: HashMap<i32, Group>,
    ids: HashMap<u64, i32>,
    fds: VecDeque<OwnedFd>,
    out: Vec<u8>,
    /// Starts not reported yet (id, pid), and until when they may wait (START_HOLD).
    held: Vec<(u64, i32)>,
    held_until: Option<Instant>,
    /// Where each command runs between clone and exec (`spawn_child`).
    stack: Vec<u8>,
}

pub(super) fn guard(worker: i32) -> i32 {
    let Some(sigfd) = signal_fd() else {
        return 1;
    };
    if !watch_worker(worker) {
        return 0;
    }
    let Some(sock) = take_socket() else {
        return 1;
    };
    let mut g = Guardian {
        sock,
        groups: HashMap::new(),
        ids: HashMap::new(),
        fds: VecDeque::new(),
        out: Vec::new(),
        held: Vec::new(),
        held_until: None,
        stack: vec![0; CHILD_STACK],
    };
    serve(&mut g, &sigfd, worker);
    g.shutdown();
    0
}

/// Block the signals we handle and open the signalfd they arrive through instead.
fn signal_fd() -> Option<nix::sys::signalfd::SignalFd> {
    // Signals arrive through a signalfd. Blocked (not ignored) ones are not inherited as
    // ignored: std resets the mask of every process it spawns.
    let mut mask = SigSet::empty();
    for s in [
        Signal::SIGCHLD,
        Signal::SIGUSR2,
        Signal::SIGTERM,
        Signal::SIGINT,
        Signal::SIGHUP,
        Signal::SIGQUIT,
    ] {
        mask.add(s);
    }
    if mask.thread_block().is_err() {
        return None;
    }
    nix::sys::signalfd::SignalFd::with_flags(
        &mask,
        nix::sys::signalfd::SfdFlags::SFD_CLOEXEC | nix::sys::signalfd::SfdFlags::SFD_NONBLOCK,
    )
    .ok()
}

/// Ask for SIGUSR2 when the worker dies and become our descendants' reaper; false when the
/// worker is already gone.
fn watch_worker(worker: i32) -> bool {
    // SAFETY: prctl/getppid on our own process.
    unsafe {
        // The worker dying sends SIGUSR2 (also when only the thread that spawned us exits:
        // hence the getppid check when it comes). Our orphaned descendants are reparented to
        // us, so we can reap them and tell when a killed group is really empty.
        nix::libc::prctl(nix::libc::PR_SET_PDEATHSIG, nix::libc::SIGUSR2, 0, 0, 0);
        nix::libc::prctl(nix::libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
        nix::libc::getppid() == worker
    }
}

/// The worker's socket, which came as stdin, moved to a close-on-exec fd; /dev/null goes on 0.
fn take_socket() -> Option<OwnedFd> {
    // SAFETY: fcntl on fd 0, which we own.
    let sock = unsafe {
        let fd = nix::libc::fcntl(0, nix::libc::F_DUPFD_CLOEXEC, 3);
        if fd < 0 {
            return None;
        }
        OwnedFd::from_raw_fd(fd)
    };
    if let Ok(null) = std::fs::File::open("/dev/null") {
        // SAFETY: dup2 onto fd 0.
        unsafe { nix::libc::dup2(null.as_raw_fd(), 0) };
    }
    Some(sock)
}

/// The guardian's loop: wait, take signals and requests, expire countdowns, report; until the
/// worker is gone or its socket fails.
fn serve(g: &mut Guardian, sigfd: &nix::sys::signalfd::SignalFd, worker: i32) {
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    while let Some((sock_ready, sig_ready)) = wait(g, sigfd) {
        if sig_ready && take_signals(g, sigfd, worker) {
            break;
        }
        if sock_ready && !take_requests(g, &mut buf, &mut chunk) {
            break;
        }
        g.expire();
        if g.held_until.is_some_and(|t| t <= Instant::now()) {
            g.release_held();
        }
        if g.flush().is_err() {
            break;
        }
    }
}

/// Poll the socket and the signalfd until the next countdown or held start is due: whether
/// each is readable (both false after EINTR), None when poll fails.
fn wait(g: &Guardian, sigfd: &nix::sys::signalfd::SignalFd) -> Option<(bool, bool)> {
    let timeout = g
        .groups
        .values()
        .filter_map(|gr| gr.deadline)
        .chain(g.held_until)
        .min()
        .map(|d| {
            let left = d.saturating_duration_since(Instant::now());
            // Round up: waking a millisecond early would only loop.
            (left.as_micros().div_ceil(1000)).min(i32::MAX as u128) as i32
        })
        .unwrap_or(-1);
    let mut pfds = [
        nix::libc::pollfd {
            fd: g.sock.as_raw_fd(),
            events: nix::libc::POLLIN,
            revents: 0,
        },
        nix::libc::pollfd {
            fd: sigfd.as_raw_fd(),
            events: nix::libc::POLLIN,
            revents: 0,
        },
    ];
    // SAFETY: poll on two valid pollfds.
    let n = unsafe { nix::libc::poll(pfds.as_mut_ptr(), 2, timeout) };
    if n < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
        return None;
    }
    Some((pfds[0].revents != 0, pfds[1].revents != 0))
}

/// Drain the signalfd and reap; true when the worker is gone.
fn take_signals(g: &mut Guardian, sigfd: &nix::sys::signalfd::SignalFd, worker: i32) -> bool {
    let mut worker_gone = false;
    while let Ok(Some(si)) = sigfd.read_signal() {
        if si.ssi_signo == Signal::SIGUSR2 as u32 {
            // SAFETY: getppid cannot fail.
            worker_gone |= unsafe { nix::libc::getppid() } != worker;
        }
        // SIGCHLD: reaped below either way. TERM/INT/HUP/QUIT: we guard until the
        // worker is gone, whoever asks.
    }
    g.reap();
    worker_gone
}

/// Read what the worker sent and handle every whole request in it; false when the socket
/// reached EOF or failed, or a frame did not parse.
fn take_requests(g: &mut Guardian, buf: &mut Vec<u8>, chunk: &mut [u8]) -> bool {
    match g.receive(chunk) {
        Ok(Some(0)) | Err(_) => return false,
        Ok(Some(n)) => buf.extend_from_slice(&chunk[..n]),
        Ok(None) => {}
    }
    let mut reqs = Vec::new();
    let ok = frames(buf, |tag, b| reqs.push((tag, b.0.to_vec())));
    for (tag, body) in reqs {
        g.handle(tag, Body(&body));
    }
    ok.is_ok()
}

impl Guardian {
    /// Read what the worker sent (Some(0): EOF, None: nothing after all), keeping its fds.
    fn receive(&mut self, chunk: &mut [u8]) -> nix::Result<Option<usize>> {
        let mut space = nix::cmsg_space!([RawFd; 64]);
        let mut iov = [IoSliceMut::new(chunk)];
        let msg = loop {
            match nix::sys::socket::recvmsg::<UnixAddr>(
                self.sock.as_raw_fd(),
                &mut iov,
                Some(&mut space),
                MsgFlags::MSG_CMSG_CLOEXEC | MsgFlags::MSG_DONTWAIT,
            ) {
                Err(nix::errno::Errno::EINTR) => continue,
                Err(nix::errno::Errno::EAGAIN) => return Ok(None),
                r => break r?,
            }
        };
        let n = msg.bytes;
        for c in msg.cmsgs()? {
            if let ControlMessageOwned::ScmRights(fds) = c {
                // SAFETY: the kernel just installed these fds in our table.
                self.fds
                    .extend(fds.into_iter().map(|f| unsafe { OwnedFd::from_raw_fd(f) }));
            }
        }
        Ok(Some(n))
    }

    fn handle(&mut self, tag: u8, mut b: Body<'_>) {
        match tag {
            b'S' => {
                // The fds came with this frame's first byte, so they are first in line.
                let fds: Vec<OwnedFd> = (0..3).filter_map(|_| self.fds.pop_front()).collect();
                let Some(id) = b.u64() else { return };
                match self.spawn(&mut b, fds) {
                    Ok((pid, budget)) => {
                        self.groups.insert(
                            pid,
                            Group {
                                id,
                                deadline: budget
                                    .map(|ms| Instant::now() + Duration::from_millis(ms)),
                                watched: budget.is_some(),
                            },
                        );
                        self.ids.insert(id, pid);
                        self.held.push((id, pid));
                        self.held_until
                            .get_or_insert_with(|| Instant::now() + START_HOLD);
                    }
                    Err(e) => self.out.extend_from_slice(
                        &Frame::new(b'e')
                            .u64(id)
                            .i32(e.raw_os_error().unwrap_or(-1))
                            .bytes(e.to_string().as_bytes())
                            .done(),
                    ),
                }
            }
            // The worker's watchdog asks whether we still answer (`watchdog.rs`).
            b'P' => self.out.extend_from_slice(&Frame::new(b'p').u64(0).done()),
            b'K' => {
                let (Some(id), Some(budget)) = (b.u64(), b.u64()) else {
                    return;
                };
                if let Some(gr) = self.ids.get(&id).and_then(|p| self.groups.get_mut(p)) {
                    if gr.watched {
                        gr.deadline = Some(Instant::now() + Duration::from_millis(budget));
                    }
                }
            }
            _ => {}
        }
    }

    fn spawn(
        &mut self,
        b: &mut Body<'_>,
        fds: Vec<OwnedFd>,
    ) -> std::io::Result<(i32, Option<u64>)> {
        let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "bad spawn request");
        let budget = b.u64().ok_or_else(bad)?;
        let prog = b.bytes().ok_or_else(bad)?;
        let argc = b.u64().ok_or_else(bad)?;
        // argv and envp as C strings in one buffer, straight from the frame: no per-string
        // allocation, no map (the worker sends each name once).
        // The frame's argv starts with the program itself (argv[0] is set below).
        let mut args = CStrings::default();
        for n in 0..argc {
            let a = b.bytes().ok_or_else(bad)?;
            if n > 0 {
                args.push(a)?;
            }
        }
        let envc = b.u64().ok_or_else(bad)?;
        // The rest of the body is the environment: its size bounds the buffer's.
        let mut env = CStrings {
            buf: Vec::with_capacity(b.0.len()),
            at: Vec::with_capacity((envc as usize).min(b.0.len() / 8)),
        };
        let mut path_var: Option<&[u8]> = None;
        for _ in 0..envc {
            let k = b.bytes().ok_or_else(bad)?;
            let v = b.bytes().ok_or_else(bad)?;
            if k == b"PATH" {
                path_var = Some(v);
            }
            env.push_pair(k, v)?;
        }
        let mut fds = fds.into_iter();
        let (Some(i), Some(o), Some(e)) = (fds.next(), fds.next(), fds.next()) else {
            return Err(bad());
        };
        let path = resolve(OsStr::from_bytes(prog), path_var)
            .ok_or_else(|| std::io::Error::from_raw_os_error(nix::libc::ENOENT))?;
        let stdio = [i, o, e];
        // argv[0] is the program as the manifest names it, as sh would pass it.
        let mut argv = CStrings::default();
        argv.push(prog)?;
        let exe = CStrings::one(path.as_bytes())?;
        let stack = &mut self.stack;
        let pid = match spawn_child(stack, &exe, &argv, Some(&args), &env, &stdio) {
            Err(err) if err.raw_os_error() == Some(nix::libc::ENOEXEC) => {
                // As sh does for a file exec refuses (no #! line): run it as a script.
                let mut argv = CStrings::default();
                argv.push(b"/bin/sh")?;
                argv.push(path.as_bytes())?;
                spawn_child(
                    stack,
                    &CStrings::one(b"/bin/sh")?,
                    &argv,
                    Some(&args),
                    &env,
                    &stdio,
                )?
            }
            r => r?,
        };
        Ok((pid, (budget > 0).then_some(budget)))
    }

    /// Reap every child that exited; report our commands' leaders (and kill what is left of
    /// their groups).
    fn reap(&mut self) {
        loop {
            let mut status = 0;
            // SAFETY: waitpid with a valid status pointer.
            let pid = unsafe { nix::libc::waitpid(-1, &mut status, nix::libc::WNOHANG) };
            if pid <= 0 {
                break;
            }
            if let Some(gr) = self.groups.remove(&pid) {
                // Its start goes first (every start held goes with it: order kept).
                self.release_held();
                let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
                self.ids.remove(&gr.id);
                self.out
                    .extend_from_slice(&Frame::new(b'x').u64(gr.id).i32(status).done());
            }
        }
    }

    /// Report the starts held back so far.
    fn release_held(&mut self) {
        for (id, pid) in self.held.drain(..) {
            self.out
                .extend_from_slice(&Frame::new(b's').u64(id).i32(pid).done());
        }
        self.held_until = None;
    }

    /// SIGKILL the groups whose countdown ran out: the worker stopped granting time.
    fn expire(&mut self) {
        let now = Instant::now();
        for (pid, gr) in self.groups.iter_mut() {
            if gr.deadline.is_some_and(|d| d <= now) {
                let _ = killpg(Pid::from_raw(*pid), Signal::SIGKILL);
                gr.deadline = None;
            }
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if self.out.is_empty() {
            return Ok(());
        }
        // Straight to the socket (blocking): no duplicated fd to write through.
        let mut done = 0;
        let r = loop {
            if done == self.out.len() {
                break Ok(());
            }
            match nix::unistd::write(&self.sock, &self.out[done..]) {
                Ok(n) => done += n,
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => break Err(std::io::Error::from(e)),
            }
        };
        self.out.clear();
        r
    }

    /// The worker is gone: kill every group, wait until they are empty, then exit.
    fn shutdown(&mut self) {
        for pid in self.groups.keys() {
            let _ = killpg(Pid::from_raw(*pid), Signal::SIGKILL);
        }
        let pgids: Vec<i32> = self.groups.keys().copied().collect();
        let until = Instant::now() + EXIT_WAIT;
        loop {
            self.reap();
            let left = pgids.iter().any(|p| {
                !matches!(
                    nix::sys::signal::kill(Pid::from_raw(-p), None),
                    Err(nix::errno::Errno::ESRCH)
                )
            });
            if !left || Instant::now() >= until {
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

/// The program's path, found as sh finds it: a name with a slash as it is, else the first
/// executable file along the command's PATH (sh's default PATH when it has none). Never a
/// bare name, so std never looks it up along our own PATH (nor forks to do so).
fn resolve(prog: &OsStr, path_var: Option<&[u8]>) -> Option<OsString> {
    if prog.as_bytes().contains(&b'/') {
        return Some(prog.to_os_string());
    }
    if prog.is_empty() {
        return None;
    }
    let path = path_var.unwrap_or(b"/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin");
    for dir in path.split(|b| *b == b':') {
        let mut cand = if dir.is_empty() {
            b".".to_vec()
        } else {
            dir.to_vec()
        };
        cand.push(b'/');
        cand.extend_from_slice(prog.as_bytes());
        let cand = OsString::from_vec(cand);
        let p = std::path::Path::new(&cand);
        if p.is_file() && nix::unistd::access(p, nix::unistd::AccessFlags::X_OK).is_ok() {
            return Some(cand);
        }
    }
    None
}

/// NUL-terminated strings in one buffer, for argv and envp.
#[derive(Default)]
struct CStrings {
    buf: Vec<u8>,
    /// Where each string starts in `buf`.
    at: Vec<usize>,
}

impl CStrings {
    fn one(s: &[u8]) -> std::io::Result<CStrings> {
        let mut c = CStrings::default();
        c.push(s)?;
        Ok(c)
    }

    fn push(&mut self, s: &[u8]) -> std::io::Result<()> {
        self.push_parts(s, None)
    }

    /// An environment entry: `k=v`.
    fn push_pair(&mut self, k: &[u8], v: &[u8]) -> std::io::Result<()> {
        self.push_parts(k, Some(v))
    }

    fn push_parts(&mut self, k: &[u8], v: Option<&[u8]>) -> std::io::Result<()> {
        if k.contains(&0) || v.is_some_and(|v| v.contains(&0)) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "nul byte found in provided data",
            ));
        }
        self.at.push(self.buf.len());
        self.buf.extend_from_slice(k);
        if let Some(v) = v {
            self.buf.push(b'=');
            self.buf.extend_from_slice(v);
        }
        self.buf.push(0);
        Ok(())
    }

    fn ptrs(&self, into: &mut Vec<*mut nix::libc::c_char>) {
        into.extend(
            self.at
                .iter()
                .map(|&i| self.buf[i..].as_ptr() as *mut nix::libc::c_char),
        );
    }
}

/// What the child of [`spawn_child`] needs, and where it leaves the exec's error: the child
/// shares our memory until it execs, so it writes `err` where we read it.
#[repr(C)]
struct ChildArgs {
    exe: *const nix::libc::c_char,
    argv: *const *const nix::libc::c_char,
    envp: *const *const nix::libc::c_char,
    stdio: [RawFd; 3],
    err: nix::libc::c_int,
}

/// The child between clone and exec, on the guardian's spare stack: only raw system calls
/// (no allocation, no lock: our memory is shared and we are suspended). SIGPIPE back to its
/// default (Rust ignores it, and an ignored signal stays ignored across exec; handlers do
/// not survive exec, so no other disposition needs resetting), a process group of its own,
/// stdio, an empty signal mask (ours blocks what our signalfd reads), exec.
extern "C" fn child_main(arg: *mut nix::libc::c_void) -> nix::libc::c_int {
    use nix::libc;
    // SAFETY: `arg` is the ChildArgs that spawn_child keeps alive until we exec or exit;
    // every call here is async-signal-safe.
    unsafe {
        let a = &mut *(arg as *mut ChildArgs);
        let mut dfl: libc::sigaction = std::mem::zeroed();
        dfl.sa_sigaction = libc::SIG_DFL;
        libc::sigaction(libc::SIGPIPE, &dfl, std::ptr::null_mut());
        if libc::setpgid(0, 0) != 0 {
            a.err = *libc::__errno_location();
            libc::_exit(127);
        }
        for (n, fd) in a.stdio.iter().enumerate() {
            if libc::dup2(*fd, n as libc::c_int) < 0 {
                a.err = *libc::__errno_location();
                libc::_exit(127);
            }
        }
        let mut none: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut none);
        libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
        libc::execve(a.exe, a.argv, a.envp);
        a.err = *libc::__errno_location();
        libc::_exit(127)
    }
}

/// Start `exe` with argv `argv` + `more` and environment `env` (nothing else is inherited),
/// stdin/stdout/stderr from `stdio`, as the leader of a new process group. Our other fds are
/// all close-on-exec. One clone(CLONE_VM|CLONE_VFORK) on `stack` (we are suspended until the
/// child execs or exits, so one stack serves every spawn) and one exec. This is what glibc's
/// posix_spawn does, without what it adds per spawn here: a fresh stack mapped and unmapped,
/// six getrlimit calls to check the fds, every signal blocked and unblocked around the clone
/// and, in the child, a sigaction for each of the 64 signals (121 system calls per command,
/// about a tenth of a short command's whole cost in the bench's spawn loop).
fn spawn_child(
    stack: &mut [u8],
    exe: &CStrings,
    argv: &CStrings,
    more: Option<&CStrings>,
    env: &CStrings,
    stdio: &[OwnedFd; 3],
) -> std::io::Result<i32> {
    use nix::libc;
    let mut av = Vec::with_capacity(argv.at.len() + more.map_or(0, |m| m.at.len()) + 1);
    argv.ptrs(&mut av);
    if let Some(m) = more {
        m.ptrs(&mut av);
    }
    av.push(std::ptr::null_mut());
    let mut ev = Vec::with_capacity(env.at.len() + 1);
    env.ptrs(&mut ev);
    ev.push(std::ptr::null_mut());
    // A received fd in 0..=2 (only when we were started without one) would be dup2'd onto
    // itself and keep its close-on-exec flag: move it up first.
    let mut moved = Vec::new();
    let mut src = [0; 3];
    for (n, fd) in stdio.iter().enumerate() {
        src[n] = fd.as_raw_fd();
        if src[n] <= 2 {
            // SAFETY: F_DUPFD_CLOEXEC on an fd we own; the new one is owned by `moved`.
            let d = unsafe { libc::fcntl(src[n], libc::F_DUPFD_CLOEXEC, 3) };
            if d < 0 {
                return Err(std::io::Error::last_os_error());
            }
            moved.push(unsafe { OwnedFd::from_raw_fd(d) });
            src[n] = d;
        }
    }
    let mut args = ChildArgs {
        exe: exe.buf.as_ptr() as *const libc::c_char,
        argv: av.as_ptr() as *const *const libc::c_char,
        envp: ev.as_ptr() as *const *const libc::c_char,
        stdio: src,
        err: 0,
    };
    // The stack grows down from its 16-byte aligned end.
    let top = stack.as_mut_ptr_range().end as usize & !15;
    // SAFETY: CLONE_VFORK suspends us until the child execs or exits, so `args`, the argv
    // and envp arrays and `stack` outlive its use of them, and nothing else runs on `stack`.
    let pid = unsafe {
        libc::clone(
            child_main,
            top as *mut libc::c_void,
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            &mut args as *mut ChildArgs as *mut libc::c_void,
        )
    };
    if pid < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the child has exec'd or exited: `err` is no longer written.
    let err = unsafe { std::ptr::read_volatile(&args.err) };
    if err != 0 {
        // It exited (127) without running anything: reap it here, as posix_spawn does.
        let mut st = 0;
        // SAFETY: waitpid on our own child.
        unsafe { libc::waitpid(pid, &mut st, 0) };
        return Err(std::io::Error::from_raw_os_error(err));
    }
    Ok(pid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn programs_are_found_along_the_commands_path_as_sh_does() {
        let path = Some(&b"/nonexistent:/bin"[..]);
        assert_eq!(resolve(OsStr::new("sh"), path), Some("/bin/sh".into()));
        assert_eq!(resolve(OsStr::new("jobs/x"), path), Some("jobs/x".into()));
        assert_eq!(resolve(OsStr::new("no-such-program-here"), path), None);
        assert!(
            resolve(OsStr::new("sh"), None).is_some(),
            "sh's default PATH"
        );
    }
}

//! The command guardian: one long-lived helper process per worker that starts, reaps and, when
//! the worker dies or freezes, kills the worker's commands. It is this same executable run
//! again as `<exe> playguard-shepherd:<worker pid>` (the sweep looks for that argument, see
//! `sweeper.rs`), started on the first command, its stdin a UNIX socket to the worker.
//! Touches no Redis keys.
//!
//! Why a separate process: a dead or frozen worker cannot kill anything, and forking the
//! worker itself per command (std falls back to fork for a `pre_exec` hook) is what made a
//! phase cost several forks and execs. The guardian spawns with `posix_spawn` (no hook), one
//! exec per command.
//!
//! Protocol (frames `[u32 length][u8 tag][body]`, integers little-endian, strings
//! `[u32 length][bytes]`):
//! - worker → guardian `S` spawn: id u64, budget u64 (whole seconds, 0 = no watchdog),
//!   program, argv, env pairs; stdin, stdout and stderr ride along as SCM_RIGHTS fds.
//! - worker → guardian `K` keepalive: id u64, budget u64 (the countdown starts again).
//! - guardian → worker `s` started: id u64, pid i32 (the process group id too).
//! - guardian → worker `e` not started: id u64, errno i32 (-1: none), message.
//! - guardian → worker `x` exited: id u64, raw wait status i32.
//!
//! The guardian SIGKILLs a group when its countdown runs out (the frozen-worker case,
//! [`crate::liveness::Liveness::shepherd_budget`]), right after its leader exited (nothing of
//! a finished command is left behind), and every group it started when the worker goes (EOF
//! on the socket, or PR_SET_PDEATHSIG). It exits only once those groups are empty, so while a
//! dead worker's command may still run, the sweep still sees `playguard-shepherd:<pid>`.

use nix::sys::signal::{killpg, SigSet, Signal};
use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, UnixAddr};
use nix::unistd::Pid;
use std::collections::{HashMap, VecDeque};
use std::ffi::{OsStr, OsString};
use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::net::UnixStream;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// The guardian's argument, which names its worker (`/proc/<pid>/cmdline` shows it).
pub fn shepherd_name(worker: u32) -> String {
    format!("playguard-shepherd:{worker}")
}

const PREFIX: &str = "playguard-shepherd:";
/// A sane cap on one frame: exec itself refuses far less (ARG_MAX), so only a broken peer
/// sends more.
const MAX_FRAME: usize = 64 << 20;
/// After it killed its groups on the worker's death, how long the guardian waits for them to
/// be gone before it exits anyway (a process stuck in the kernel cannot be hurried).
const EXIT_WAIT: Duration = Duration::from_secs(10);

// --- framing -------------------------------------------------------------------------------

struct Frame(Vec<u8>);

impl Frame {
    fn new(tag: u8) -> Frame {
        Frame(vec![0, 0, 0, 0, tag])
    }
    fn u64(mut self, v: u64) -> Frame {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn i32(mut self, v: i32) -> Frame {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(mut self, b: &[u8]) -> Frame {
        self.0.extend_from_slice(&(b.len() as u32).to_le_bytes());
        self.0.extend_from_slice(b);
        self
    }
    fn done(mut self) -> Vec<u8> {
        let len = (self.0.len() - 4) as u32;
        self.0[..4].copy_from_slice(&len.to_le_bytes());
        self.0
    }
}

/// Reads one frame's body.
struct Body<'a>(&'a [u8]);

impl<'a> Body<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn i32(&mut self) -> Option<i32> {
        Some(i32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn bytes(&mut self) -> Option<&'a [u8]> {
        let n = self.u32()? as usize;
        self.take(n)
    }
}

/// Split complete frames off the front of `buf`: (tag, body) each.
fn frames(buf: &mut Vec<u8>, mut each: impl FnMut(u8, Body<'_>)) -> Result<(), ()> {
    let mut at = 0;
    while buf.len() - at >= 4 {
        let len = u32::from_le_bytes(buf[at..at + 4].try_into().unwrap()) as usize;
        if len == 0 || len > MAX_FRAME {
            return Err(());
        }
        if buf.len() - at - 4 < len {
            break;
        }
        let f = &buf[at + 4..at + 4 + len];
        each(f[0], Body(&f[1..]));
        at += 4 + len;
    }
    buf.drain(..at);
    Ok(())
}

/// A close-on-exec pipe: (read end, write end).
pub(crate) fn cloexec_pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as nix::libc::c_int; 2];
    // SAFETY: pipe2 fills both fds on success; we own them from here on.
    if unsafe { nix::libc::pipe2(fds.as_mut_ptr(), nix::libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

// --- the worker's side ---------------------------------------------------------------------

/// What the guardian says about one command.
#[derive(Debug)]
pub(crate) enum Event {
    Started(i32),
    NotStarted { errno: i32, message: String },
    Exited(std::process::ExitStatus),
}

struct Entry {
    tx: tokio::sync::mpsc::UnboundedSender<Event>,
    pid: Option<i32>,
    /// Its `run` future is gone: kill the group as soon as its pid is known.
    abandoned: bool,
}

struct Table {
    dead: bool,
    entries: HashMap<u64, Entry>,
}

/// One running guardian, seen from the worker.
pub(crate) struct Conn {
    out: Mutex<mpsc::Sender<(Vec<u8>, Vec<OwnedFd>)>>,
    table: Mutex<Table>,
    next: AtomicU64,
    dead: AtomicBool,
}

static CURRENT: Mutex<Option<Arc<Conn>>> = Mutex::new(None);

/// The live guardian, started if there is none (or the last one died).
pub(crate) fn get() -> std::io::Result<Arc<Conn>> {
    let mut cur = CURRENT.lock().unwrap();
    if let Some(c) = cur.as_ref() {
        if !c.dead.load(Ordering::Acquire) {
            return Ok(c.clone());
        }
    }
    let c = start()?;
    *cur = Some(c.clone());
    Ok(c)
}

/// The executable to run again: our own path while it still names our binary, else the
/// kernel's handle on it (a deploy may have replaced the file meanwhile).
fn own_exe() -> std::path::PathBuf {
    match std::fs::read_link("/proc/self/exe") {
        Ok(p) if !p.as_os_str().as_bytes().ends_with(b" (deleted)") && p.exists() => p,
        _ => "/proc/self/exe".into(),
    }
}

fn start() -> std::io::Result<Arc<Conn>> {
    use nix::sys::socket::{socketpair, AddressFamily, SockFlag, SockType};
    let (ours, theirs) = socketpair(
        AddressFamily::Unix,
        SockType::Stream,
        None,
        SockFlag::SOCK_CLOEXEC,
    )?;
    // No pre_exec: std spawns with posix_spawn. The guardian leads a process group of its own
    // so a signal to the worker's group (a terminal's ^C, a supervisor's killpg) leaves it to
    // clean up after the worker; it sets its own PDEATHSIG.
    let child = std::process::Command::new(own_exe())
        .arg(shepherd_name(std::process::id()))
        .stdin(Stdio::from(theirs))
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .process_group(0)
        .spawn()?;
    let sock = Arc::new(UnixStream::from(ours));
    let (tx, rx) = mpsc::channel::<(Vec<u8>, Vec<OwnedFd>)>();
    let conn = Arc::new(Conn {
        out: Mutex::new(tx),
        table: Mutex::new(Table {
            dead: false,
            entries: HashMap::new(),
        }),
        next: AtomicU64::new(1),
        dead: AtomicBool::new(false),
    });
    let w = sock.clone();
    // Not the Conn itself: this thread ends when the last Conn (and so the sender) is gone.
    let wc = Arc::downgrade(&conn);
    std::thread::Builder::new()
        .name("playguard-guardian-out".into())
        .spawn(move || {
            for (bytes, fds) in rx {
                if send_frame(&w, &bytes, &fds).is_err() {
                    // The reader sees the same end as EOF and fails everything.
                    if let Some(c) = wc.upgrade() {
                        c.dead.store(true, Ordering::Release);
                    }
                    let _ = w.shutdown(std::net::Shutdown::Both);
                    break;
                }
            }
        })?;
    let rc = conn.clone();
    std::thread::Builder::new()
        .name("playguard-guardian-in".into())
        .spawn(move || read_replies(&sock, &rc, child))?;
    Ok(conn)
}

fn send_frame(sock: &UnixStream, bytes: &[u8], fds: &[OwnedFd]) -> std::io::Result<()> {
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let cmsg = [ControlMessage::ScmRights(&raw)];
    let cmsgs: &[ControlMessage] = if raw.is_empty() { &[] } else { &cmsg };
    let sent = loop {
        match nix::sys::socket::sendmsg::<UnixAddr>(
            sock.as_raw_fd(),
            &[IoSlice::new(bytes)],
            cmsgs,
            MsgFlags::MSG_NOSIGNAL,
            None,
        ) {
            Ok(n) => break n,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    // The fds went with the first byte; the rest is plain stream.
    let mut w: &UnixStream = sock;
    w.write_all(&bytes[sent..])
}

fn read_replies(sock: &UnixStream, conn: &Conn, mut child: std::process::Child) {
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    let mut r: &UnixStream = sock;
    loop {
        let n = match r.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        buf.extend_from_slice(&chunk[..n]);
        let ok = frames(&mut buf, |tag, mut b| {
            let Some(id) = b.u64() else { return };
            let mut t = conn.table.lock().unwrap();
            match tag {
                b's' => {
                    let Some(pid) = b.i32() else { return };
                    if let Some(e) = t.entries.get_mut(&id) {
                        e.pid = Some(pid);
                        if e.abandoned {
                            let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
                        }
                        let _ = e.tx.send(Event::Started(pid));
                    }
                }
                b'e' => {
                    let errno = b.i32().unwrap_or(-1);
                    let message = String::from_utf8_lossy(b.bytes().unwrap_or_default()).into();
                    if let Some(e) = t.entries.remove(&id) {
                        let _ = e.tx.send(Event::NotStarted { errno, message });
                    }
                }
                b'x' => {
                    let Some(st) = b.i32() else { return };
                    if let Some(e) = t.entries.remove(&id) {
                        let _ =
                            e.tx.send(Event::Exited(std::process::ExitStatus::from_raw(st)));
                    }
                }
                _ => {}
            }
        });
        if ok.is_err() {
            break;
        }
    }
    // The guardian is gone (or speaks nonsense): nobody watches these commands any more, so
    // they die now, and their `run`s see the channel close (a spawn failure).
    conn.dead.store(true, Ordering::Release);
    let entries = {
        let mut t = conn.table.lock().unwrap();
        t.dead = true;
        std::mem::take(&mut t.entries)
    };
    for e in entries.values() {
        if let Some(pid) = e.pid {
            let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
        }
    }
    drop(entries);
    let _ = child.kill();
    let _ = child.wait();
}

/// One command's registration with the guardian. Dropping it (its `run` was abandoned, or is
/// done) kills the group if it may still run.
pub(crate) struct Handle {
    conn: Arc<Conn>,
    id: u64,
}

impl Conn {
    /// Register a command and send its spawn request. Err: this guardian is already gone.
    pub(crate) fn spawn(
        self: &Arc<Conn>,
        prog: &OsStr,
        argv: &[String],
        env: &[(OsString, OsString)],
        budget: Option<u64>,
        fds: Vec<OwnedFd>,
    ) -> Result<(Handle, tokio::sync::mpsc::UnboundedReceiver<Event>), ()> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        {
            let mut t = self.table.lock().unwrap();
            if t.dead {
                return Err(());
            }
            t.entries.insert(
                id,
                Entry {
                    tx,
                    pid: None,
                    abandoned: false,
                },
            );
        }
        let handle = Handle {
            conn: self.clone(),
            id,
        };
        let mut f = Frame::new(b'S')
            .u64(id)
            .u64(budget.unwrap_or(0))
            .bytes(prog.as_bytes())
            .u64(argv.len() as u64);
        for a in argv {
            f = f.bytes(a.as_bytes());
        }
        f = f.u64(env.len() as u64);
        for (k, v) in env {
            f = f.bytes(k.as_bytes()).bytes(v.as_bytes());
        }
        if self.out.lock().unwrap().send((f.done(), fds)).is_err() {
            return Err(());
        }
        Ok((handle, rx))
    }
}

impl Handle {
    /// Tell the guardian this command may run `budget` more seconds without hearing again.
    pub(crate) fn keepalive(&self, budget: u64) {
        let f = Frame::new(b'K').u64(self.id).u64(budget).done();
        let _ = self.conn.out.lock().unwrap().send((f, Vec::new()));
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        let mut t = self.conn.table.lock().unwrap();
        if let Some(e) = t.entries.get_mut(&self.id) {
            match e.pid {
                Some(pid) => {
                    let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
                }
                None => e.abandoned = true,
            }
        }
    }
}

// --- the guardian process ------------------------------------------------------------------

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
    Some(guard(worker))
}

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
}

fn guard(worker: i32) -> i32 {
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
        return 1;
    }
    let Ok(sigfd) = nix::sys::signalfd::SignalFd::with_flags(
        &mask,
        nix::sys::signalfd::SfdFlags::SFD_CLOEXEC | nix::sys::signalfd::SfdFlags::SFD_NONBLOCK,
    ) else {
        return 1;
    };
    // SAFETY: prctl/getppid/fcntl/open/dup2 on our own process and fds.
    unsafe {
        // The worker dying sends SIGUSR2 (also when only the thread that spawned us exits:
        // hence the getppid check when it comes). Our orphaned descendants are reparented to
        // us, so we can reap them and tell when a killed group is really empty.
        nix::libc::prctl(nix::libc::PR_SET_PDEATHSIG, nix::libc::SIGUSR2, 0, 0, 0);
        nix::libc::prctl(nix::libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
        if nix::libc::getppid() != worker {
            return 0;
        }
    }
    // The socket came as stdin: move it to a close-on-exec fd and put /dev/null on 0.
    // SAFETY: fcntl on fd 0, which we own.
    let sock = unsafe {
        let fd = nix::libc::fcntl(0, nix::libc::F_DUPFD_CLOEXEC, 3);
        if fd < 0 {
            return 1;
        }
        OwnedFd::from_raw_fd(fd)
    };
    if let Ok(null) = std::fs::File::open("/dev/null") {
        // SAFETY: dup2 onto fd 0.
        unsafe { nix::libc::dup2(null.as_raw_fd(), 0) };
    }
    let mut g = Guardian {
        sock,
        groups: HashMap::new(),
        ids: HashMap::new(),
        fds: VecDeque::new(),
        out: Vec::new(),
    };
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        let timeout = g
            .groups
            .values()
            .filter_map(|gr| gr.deadline)
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
            break;
        }
        if pfds[1].revents != 0 {
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
            if worker_gone {
                break;
            }
        }
        if pfds[0].revents != 0 {
            match g.receive(&mut chunk) {
                Ok(Some(0)) | Err(_) => break,
                Ok(Some(n)) => buf.extend_from_slice(&chunk[..n]),
                Ok(None) => {}
            }
            let mut reqs = Vec::new();
            let ok = frames(&mut buf, |tag, b| reqs.push((tag, b.0.to_vec())));
            for (tag, body) in reqs {
                g.handle(tag, Body(&body));
            }
            if ok.is_err() {
                break;
            }
        }
        g.expire();
        if g.flush().is_err() {
            break;
        }
    }
    g.shutdown();
    0
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
                let reply = match self.spawn(&mut b, fds) {
                    Ok((pid, budget)) => {
                        self.groups.insert(
                            pid,
                            Group {
                                id,
                                deadline: budget.map(|s| Instant::now() + Duration::from_secs(s)),
                                watched: budget.is_some(),
                            },
                        );
                        self.ids.insert(id, pid);
                        Frame::new(b's').u64(id).i32(pid).done()
                    }
                    Err(e) => Frame::new(b'e')
                        .u64(id)
                        .i32(e.raw_os_error().unwrap_or(-1))
                        .bytes(e.to_string().as_bytes())
                        .done(),
                };
                self.out.extend_from_slice(&reply);
            }
            b'K' => {
                let (Some(id), Some(budget)) = (b.u64(), b.u64()) else {
                    return;
                };
                if let Some(gr) = self.ids.get(&id).and_then(|p| self.groups.get_mut(p)) {
                    if gr.watched {
                        gr.deadline = Some(Instant::now() + Duration::from_secs(budget));
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
        let prog = OsStr::from_bytes(b.bytes().ok_or_else(bad)?).to_os_string();
        let argc = b.u64().ok_or_else(bad)?;
        let mut argv = Vec::new();
        for _ in 0..argc {
            argv.push(OsStr::from_bytes(b.bytes().ok_or_else(bad)?).to_os_string());
        }
        let envc = b.u64().ok_or_else(bad)?;
        let mut env = Vec::new();
        for _ in 0..envc {
            let k = OsStr::from_bytes(b.bytes().ok_or_else(bad)?);
            let v = OsStr::from_bytes(b.bytes().ok_or_else(bad)?);
            env.push((k, v));
        }
        let mut fds = fds.into_iter();
        let (Some(i), Some(o), Some(e)) = (fds.next(), fds.next(), fds.next()) else {
            return Err(bad());
        };
        let path = resolve(&prog, &env)
            .ok_or_else(|| std::io::Error::from_raw_os_error(nix::libc::ENOENT))?;
        let build =
            |exe: &OsStr, script: Option<&OsStr>| -> std::io::Result<std::process::Command> {
                let mut cmd = std::process::Command::new(exe);
                match script {
                    // As sh does for a file exec refuses (no #! line): run it as a script.
                    Some(s) => cmd.arg(s),
                    None => cmd.arg0(&prog),
                };
                cmd.args(argv.iter().skip(1))
                    .env_clear()
                    .envs(env.iter().copied())
                    .stdin(Stdio::from(i.try_clone()?))
                    .stdout(Stdio::from(o.try_clone()?))
                    .stderr(Stdio::from(e.try_clone()?))
                    .process_group(0);
                Ok(cmd)
            };
        let child = match build(&path, None)?.spawn() {
            Err(err) if err.raw_os_error() == Some(nix::libc::ENOEXEC) => {
                build(OsStr::new("/bin/sh"), Some(&path))?.spawn()?
            }
            r => r?,
        };
        Ok((child.id() as i32, (budget > 0).then_some(budget)))
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
                let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
                self.ids.remove(&gr.id);
                self.out
                    .extend_from_slice(&Frame::new(b'x').u64(gr.id).i32(status).done());
            }
        }
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
        let mut w = std::fs::File::from(self.sock.try_clone()?);
        let r = w.write_all(&self.out);
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
fn resolve(prog: &OsStr, env: &[(&OsStr, &OsStr)]) -> Option<OsString> {
    if prog.as_bytes().contains(&b'/') {
        return Some(prog.to_os_string());
    }
    if prog.is_empty() {
        return None;
    }
    let path = env
        .iter()
        .rev()
        .find(|(k, _)| k.as_bytes() == b"PATH")
        .map(|(_, v)| v.as_bytes())
        .unwrap_or(b"/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin");
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_split_whole_frames_and_keep_the_rest() {
        let a = Frame::new(b'K').u64(7).u64(12).done();
        let b = Frame::new(b'e').u64(8).i32(2).bytes(b"no such file").done();
        let mut buf = [a.clone(), b.clone()].concat();
        buf.extend_from_slice(&a[..5]);
        let mut got = Vec::new();
        frames(&mut buf, |tag, mut body| {
            got.push((tag, body.u64(), body.0.to_vec()));
        })
        .unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!((got[0].0, got[0].1), (b'K', Some(7)));
        let mut rest = Body(&got[1].2);
        assert_eq!(rest.i32(), Some(2));
        assert_eq!(rest.bytes(), Some(&b"no such file"[..]));
        assert_eq!(buf, a[..5].to_vec(), "a partial frame waits for the rest");
        assert!(frames(&mut vec![0, 0, 0, 0], |_, _| {}).is_err());
    }

    #[test]
    fn programs_are_found_along_the_commands_path_as_sh_does() {
        let path = (OsStr::new("PATH"), OsStr::new("/nonexistent:/bin"));
        assert_eq!(resolve(OsStr::new("sh"), &[path]), Some("/bin/sh".into()));
        assert_eq!(
            resolve(OsStr::new("jobs/x"), &[path]),
            Some("jobs/x".into())
        );
        assert_eq!(resolve(OsStr::new("no-such-program-here"), &[path]), None);
        assert!(
            resolve(OsStr::new("sh"), &[]).is_some(),
            "sh's default PATH"
        );
    }
}

//! The worker's side of the guardian: starting it, sending spawn requests and keepalives,
//! reading what it reports about each command, and killing what it started if it dies.
//! Touches no Redis keys.

use super::frame::{frames, Frame};
use super::guardian_arg;

use nix::sys::signal::{killpg, Signal};
use nix::sys::socket::{ControlMessage, MsgFlags, UnixAddr};
use nix::unistd::Pid;
use std::collections::HashMap;
use std::ffi::OsStr;
use std::io::{IoSlice, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};

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

/// Frames to the guardian: sent at once by the caller when the socket takes them, else
/// queued for the sending thread (which may block), in order.
struct Out {
    sock: Arc<UnixStream>,
    tx: mpsc::Sender<(Vec<u8>, Vec<OwnedFd>)>,
    /// Frames handed to the thread and not yet fully sent: while any are, later frames
    /// queue behind them.
    queued: usize,
}

/// One running guardian, seen from the worker.
pub(crate) struct Conn {
    out: Mutex<Out>,
    table: Mutex<Table>,
    next: AtomicU64,
    dead: AtomicBool,
    /// The guardian's pid, to kill it when it stops answering (`watchdog.rs`).
    pub(super) pid: i32,
    /// Since when a ping waits for its answer (`watchdog.rs`), and whether one was answered.
    pub(super) ping: Mutex<Ping>,
}

#[derive(Default)]
pub(crate) struct Ping {
    /// When the ping now waiting for its answer was sent.
    pub(super) waiting_since: Option<std::time::Instant>,
    /// The guardian answered at least once (a new one is pinged until it has).
    pub(super) answered: bool,
}

/// The executable to run again: our own path while it still names our binary, else the
/// kernel's handle on it (a deploy may have replaced the file meanwhile).
fn own_exe() -> std::path::PathBuf {
    match std::fs::read_link("/proc/self/exe") {
        Ok(p) if !p.as_os_str().as_bytes().ends_with(b" (deleted)") && p.exists() => p,
        _ => "/proc/self/exe".into(),
    }
}

/// A new guardian and our connection to it (its watchdog is started by `get`, `mod.rs`).
pub(super) fn start() -> std::io::Result<Arc<Conn>> {
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
        .arg(guardian_arg(std::process::id()))
        .stdin(Stdio::from(theirs))
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .process_group(0)
        .spawn()?;
    let sock = Arc::new(UnixStream::from(ours));
    let (tx, rx) = mpsc::channel::<(Vec<u8>, Vec<OwnedFd>)>();
    let conn = Arc::new(Conn {
        out: Mutex::new(Out {
            sock: sock.clone(),
            tx,
            queued: 0,
        }),
        table: Mutex::new(Table {
            dead: false,
            entries: HashMap::new(),
        }),
        next: AtomicU64::new(1),
        dead: AtomicBool::new(false),
        pid: child.id() as i32,
        ping: Mutex::default(),
    });
    let w = sock.clone();
    // Not the Conn itself: this thread ends when the last Conn (and so the sender) is gone.
    let wc = Arc::downgrade(&conn);
    std::thread::Builder::new()
        .name("playguard-guardian-out".into())
        .spawn(move || {
            for (bytes, fds) in rx {
                let sent = send_frame(&w, &bytes, &fds);
                let Some(c) = wc.upgrade() else { break };
                c.out.lock().unwrap().queued -= 1;
                if sent.is_err() {
                    // The reader sees the same end as EOF and fails everything.
                    c.dead.store(true, Ordering::Release);
                    let _ = w.shutdown(std::net::Shutdown::Both);
                    break;
                }
            }
        })?;
    let rc = conn.clone();
    match tokio::runtime::Handle::try_current() {
        // On the runtime: a report wakes the task waiting for it, not a thread that then
        // wakes the runtime (two context switches per report fewer).
        Ok(rt) => {
            rt.spawn(read_replies_async(sock, rc, child));
        }
        Err(_) => {
            std::thread::Builder::new()
                .name("playguard-guardian-in".into())
                .spawn(move || read_replies(&sock, &rc, child))?;
        }
    }
    Ok(conn)
}

impl Conn {
    /// Send one frame, in order with every frame before it: directly when nothing is queued
    /// and the socket takes it now (the common case: no thread to wake per command), else
    /// through the sending thread. Err: the thread is gone (so is the guardian).
    fn send(&self, bytes: Vec<u8>, fds: Vec<OwnedFd>) -> Result<(), ()> {
        let mut out = self.out.lock().unwrap();
        if out.queued == 0 {
            let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
            let cmsg = [ControlMessage::ScmRights(&raw)];
            let cmsgs: &[ControlMessage] = if raw.is_empty() { &[] } else { &cmsg };
            let sent = loop {
                match nix::sys::socket::sendmsg::<UnixAddr>(
                    out.sock.as_raw_fd(),
                    &[IoSlice::new(&bytes)],
                    cmsgs,
                    MsgFlags::MSG_NOSIGNAL | MsgFlags::MSG_DONTWAIT,
                    None,
                ) {
                    Err(nix::errno::Errno::EINTR) => continue,
                    r => break r,
                }
            };
            match sent {
                Ok(n) if n == bytes.len() => return Ok(()),
                // The fds went with the first byte; the thread sends the rest.
                Ok(n) => return queue(&mut out, bytes[n..].to_vec(), Vec::new()),
                Err(nix::errno::Errno::EAGAIN) => {}
                Err(_) => {
                    // As the thread does: the reader sees EOF and fails every command.
                    self.dead.store(true, Ordering::Release);
                    let _ = out.sock.shutdown(std::net::Shutdown::Both);
                    return Ok(());
                }
            }
        }
        queue(&mut out, bytes, fds)
    }
}

impl Conn {
    /// Whether this guardian has been declared gone (its socket ended, or it stopped
    /// answering).
    pub(super) fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    /// Commands registered and not yet reported ended.
    pub(super) fn busy(&self) -> bool {
        !self.table.lock().unwrap().entries.is_empty()
    }

    /// Send a frame that carries no fds (a ping).
    pub(super) fn send_plain(&self, bytes: Vec<u8>) {
        let _ = self.send(bytes, Vec::new());
    }
}

fn queue(out: &mut Out, bytes: Vec<u8>, fds: Vec<OwnedFd>) -> Result<(), ()> {
    out.tx.send((bytes, fds)).map_err(|_| ())?;
    out.queued += 1;
    Ok(())
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
        if dispatch(conn, &mut buf).is_err() {
            break;
        }
    }
    fail_all(conn);
    let _ = child.kill();
    let _ = child.wait();
}

/// `read_replies` as a task: readiness from the runtime's poller, reads with MSG_DONTWAIT.
/// The socket itself stays blocking: O_NONBLOCK belongs to the open file, which the sending
/// thread's blocking writes share. If the runtime goes first (its task is dropped), the
/// commands die and the next `get` starts another guardian, as when this one dies.
async fn read_replies_async(sock: Arc<UnixStream>, conn: Arc<Conn>, child: std::process::Child) {
    struct Ends {
        conn: Arc<Conn>,
        child: Option<std::process::Child>,
    }
    impl Drop for Ends {
        fn drop(&mut self) {
            fail_all(&self.conn);
            if let Some(mut c) = self.child.take() {
                let _ = c.kill();
                // Reaped off the runtime: wait blocks.
                let _ = std::thread::Builder::new()
                    .name("playguard-guardian-reap".into())
                    .spawn(move || c.wait());
            }
        }
    }
    let _ends = Ends {
        conn: conn.clone(),
        child: Some(child),
    };
    // SAFETY: the Arc'd stream owns the fd, and it stays open, the same file, while the
    // AsyncFd holds that Arc.
    let registered = unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(sock, tokio::io::Interest::READABLE)
    };
    let Ok(afd) = registered else {
        return;
    };
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        let Ok(mut ready) = afd.readable().await else {
            return;
        };
        let got = ready.try_io(|s| loop {
            match nix::sys::socket::recv(
                s.get_ref().as_raw_fd(),
                &mut chunk,
                MsgFlags::MSG_DONTWAIT,
            ) {
                Err(nix::errno::Errno::EINTR) => continue,
                r => break r.map_err(std::io::Error::from),
            }
        });
        match got {
            Err(_would_block) => continue,
            Ok(Ok(0)) | Ok(Err(_)) => return,
            Ok(Ok(n)) => {
                buf.extend_from_slice(&chunk[..n]);
                if dispatch(&conn, &mut buf).is_err() {
                    return;
                }
            }
        }
    }
}

/// Hand each complete report in `buf` to its command. Err: the guardian speaks nonsense.
fn dispatch(conn: &Conn, buf: &mut Vec<u8>) -> Result<(), ()> {
    frames(buf, |tag, mut b| {
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
            b'p' => {
                drop(t);
                answered(conn);
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
    })
}

/// The guardian answered a ping.
pub(super) fn answered(conn: &Conn) {
    let mut p = conn.ping.lock().unwrap();
    p.waiting_since = None;
    p.answered = true;
    crate::metrics::server::guardian_answers(true);
}

/// The guardian is gone (or speaks nonsense): nobody watches these commands any more, so
/// they die now, and their `run`s see the channel close (a spawn failure).
pub(super) fn fail_all(conn: &Conn) {
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
        env: &[(&OsStr, &OsStr)],
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
        let size = 64
            + prog.len()
            + argv.iter().map(|a| a.len() + 4).sum::<usize>()
            + env
                .iter()
                .map(|(k, v)| k.len() + v.len() + 8)
                .sum::<usize>();
        let mut f = Frame::with_capacity(b'S', size)
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
        if self.send(f.done(), fds).is_err() {
            return Err(());
        }
        Ok((handle, rx))
    }
}

impl Handle {
    /// Tell the guardian this command may run `budget` more milliseconds without hearing again.
    pub(crate) fn keepalive(&self, budget: u64) {
        let f = Frame::new(b'K').u64(self.id).u64(budget).done();
        let _ = self.conn.send(f, Vec::new());
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

/// A close-on-exec pipe: (read end, write end).
pub(crate) fn cloexec_pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as nix::libc::c_int; 2];
    // SAFETY: pipe2 fills both fds on success; we own them from here on.
    if unsafe { nix::libc::pipe2(fds.as_mut_ptr(), nix::libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

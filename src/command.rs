//! Runs one manifest command: argv (never a shell), the PLAYGUARD_* environment, the payload on
//! stdin, in a process group of its own so a deadline or shutdown kills the whole tree.
//! Every stdout/stderr line is logged in the caller's span (jid, class, phase). Touches no
//! Redis keys.

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use std::future::Future;
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
    /// The worker's variables the command inherits: None = all of them (as a Procfile
    /// process has), Some = only these names. `env` is set on top either way.
    pub inherit: Option<&'a [String]>,
    pub stdin: String,
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

/// `sh -c SHEPHERD <prog> <prog> <args>...`: runs "$@" (prog and args, unparsed) with our
/// stdin, exits with its status, kills the whole group when the worker dies (SIGUSR2), and on
/// TERM/INT waits for the command to finish its own shutdown.
/// (A non-interactive sh gives a background command /dev/null as stdin, so the real stdin
/// travels through fd 3.)
const SHEPHERD: &str = r#"trap 'kill -KILL 0' USR2
trap 'wait "$pid"; exit $?' TERM INT
exec 3<&0
"$@" <&3 3<&- &
pid=$!
exec 3<&-
wait "$pid"
exit $?"#;

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
    let mut cmd = Command::new("/bin/sh");
    cmd.arg("-c").arg(SHEPHERD).arg(prog).arg(prog).args(args);
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
    // SAFETY: only async-signal-safe calls (prctl, getppid, _exit) run between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if nix::libc::prctl(nix::libc::PR_SET_PDEATHSIG, nix::libc::SIGUSR2, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if nix::libc::getppid() != parent {
                nix::libc::_exit(1);
            }
            Ok(())
        });
    }
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => return Exit::SpawnFailed(format!("cannot start {prog:?}: {e}")),
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

//! A command's output never breaks its job: bytes that are not UTF-8 are logged lossily, an
//! overlong line is cut, and a grandchild that left the process group and keeps the pipes open
//! does not keep a finished job running.
//! Each test owns its redis-server; waits are conditions with deadlines, never timings.

mod support;

use std::time::Duration;
use support::*;

/// `printf 'caf\351\n'` then more output: the command is not killed by SIGPIPE, the line is
/// logged with a replacement character, and the job succeeds.
#[test]
fn non_utf8_output_is_logged_lossily_and_the_command_runs_on() {
    let redis = RedisServer::start();
    let p = Project::with_jobs(&[(
        "Latin1Job",
        "latin1",
        "#!/bin/sh\nprintf 'caf\\351\\n'\nprintf 'err \\377\\376\\n' >&2\n\
         i=0; while [ $i -lt 3000 ]; do echo \"line $i\"; i=$((i+1)); done\n\
         echo finished > finished.txt\n",
    )]);
    let w = Worker::builder(&redis).jobs(p.path()).start();
    enqueue(&redis, &["Latin1Job"]);
    w.wait_for_line("line 2999", Duration::from_secs(20));
    wait_until("the job finished", Duration::from_secs(20), || {
        w.saw("done elapsed_ms") || redis.zcard("retry") > 0
    });
    assert_eq!(redis.zcard("retry"), 0, "{}", w.output());
    assert!(p.path().join("finished.txt").exists());
    assert!(w.saw("caf\u{FFFD}"), "{}", w.output());
    assert!(w.saw("err \u{FFFD}\u{FFFD}"), "{}", w.output());
}

/// A 1 MiB line without a newline is logged cut, not buffered whole; output after it still
/// arrives and the job succeeds.
#[test]
fn an_overlong_line_is_cut() {
    let redis = RedisServer::start();
    let p = Project::with_jobs(&[(
        "LongLineJob",
        "long",
        "#!/bin/sh\nhead -c 1048576 /dev/zero | tr '\\0' x\necho\necho short-after\n",
    )]);
    let w = Worker::builder(&redis).jobs(p.path()).start();
    enqueue(&redis, &["LongLineJob"]);
    w.wait_for_line("short-after", Duration::from_secs(20));
    wait_until("the job finished", Duration::from_secs(20), || {
        w.saw("done elapsed_ms")
    });
    let lines = w.lines();
    let longest = lines.iter().map(String::len).max().unwrap();
    assert!(longest < 20_000, "a log line of {longest} bytes");
    assert!(lines
        .iter()
        .any(|l| l.contains("xxxx") && l.contains("[line cut")));
    assert_eq!(redis.zcard("retry"), 0);
}

/// Kills the grandchildren a test's commands left behind (one pid a line), whatever the test's
/// outcome.
struct KillPidFile(std::path::PathBuf);

impl Drop for KillPidFile {
    fn drop(&mut self) {
        let pids = std::fs::read_to_string(&self.0).unwrap_or_default();
        for pid in pids.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
            signal(pid, "KILL");
        }
    }
}

/// `setsid sleep 120 &` keeps stdout and stderr open after the command exited: the job is
/// done (its slot free) at once, not when the grandchild exits.
#[test]
fn a_grandchild_holding_the_pipes_does_not_keep_the_job_running() {
    let redis = RedisServer::start();
    let p = Project::with_jobs(&[(
        "LeakyJob",
        "leaky",
        "#!/bin/sh\nsetsid sleep 120 &\necho $! >> grandchild.pid\necho started\n",
    )]);
    let _gc = KillPidFile(p.path().join("grandchild.pid"));
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-c", "1"])
        .start();
    enqueue(&redis, &["LeakyJob"]);
    w.wait_for_line("started", Duration::from_secs(20));
    // Well before the grandchild's 120 s: the job is done and the one slot runs the next job.
    w.wait_for_line("done elapsed_ms", Duration::from_secs(30));
    enqueue(&redis, &["LeakyJob"]);
    wait_until("the second job finished", Duration::from_secs(30), || {
        w.count_lines("done elapsed_ms") == 2
    });
    w.stop(Duration::from_secs(30));
}

/// A command gets exactly its manifest argv (argv[0] as written, no argument added or
/// dropped, empty ones kept) and the PLAYGUARD_* environment, an empty variable included;
/// a bare program name is found along PATH.
#[test]
fn a_command_gets_exactly_its_argv_and_environment() {
    let redis = RedisServer::start();
    let p = Project::new();
    p.script(
        "jobs/bin/args",
        "#!/bin/sh\n{ echo \"0=$0 #=$#\"; for a in \"$@\"; do echo \"arg=[$a]\"; done;\n\
         echo \"retry=${PLAYGUARD_RETRY_COUNT+set}[$PLAYGUARD_RETRY_COUNT] jid=$PLAYGUARD_JID\"; } > args.txt\n",
    );
    p.write(
        "jobs/app.toml",
        "[[job]]\nclass = \"ArgsJob\"\nrun = [\"jobs/bin/args\", \"one\", \"two words\", \"\"]\n\
         [[job]]\nclass = \"BareJob\"\nrun = [\"sh\", \"-c\", \"echo \\\"$0 $#\\\" > bare.txt\", \"zero\"]\n",
    );
    let w = Worker::builder(&redis).jobs(p.path()).start();
    enqueue(&redis, &["ArgsJob"]);
    enqueue(&redis, &["BareJob"]);
    let read = |f: &str| std::fs::read_to_string(p.path().join(f)).unwrap_or_default();
    wait_until("both commands ran", Duration::from_secs(20), || {
        read("args.txt").contains("jid=") && read("bare.txt").ends_with('\n')
    });
    let args = read("args.txt");
    let jid = args.rsplit("jid=").next().unwrap().trim();
    assert_eq!(
        args,
        format!("0=jobs/bin/args #=3\narg=[one]\narg=[two words]\narg=[]\nretry=set[] jid={jid}\n"),
        "{}",
        w.output()
    );
    assert!(!jid.is_empty());
    assert_eq!(read("bare.txt"), "zero 0\n");
    assert_eq!(redis.zcard("retry"), 0, "{}", w.output());
}

/// This test process's fds above stderr that a process it starts inherits (no close-on-exec).
fn inherited_fds() -> Vec<u32> {
    let mut fds = Vec::new();
    for e in std::fs::read_dir("/proc/self/fdinfo").unwrap().flatten() {
        let Ok(n) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let info = std::fs::read_to_string(e.path()).unwrap_or_default();
        let flags = info
            .lines()
            .find_map(|l| l.strip_prefix("flags:"))
            .and_then(|f| u32::from_str_radix(f.trim(), 8).ok());
        // O_CLOEXEC is 02000000.
        if n > 2 && flags.is_some_and(|f| f & 0o2000000 == 0) {
            fds.push(n);
        }
    }
    fds
}

/// A command starts clean, whatever the guardian's own state: the leader of its own process
/// group, no signal blocked (the guardian blocks the ones its signalfd reads), SIGPIPE not
/// ignored (Rust ignores it in the guardian), and no fd open but its stdin, stdout and stderr
/// (and what the worker itself inherited). Read from /proc while the command, a shell that
/// opens no file of its own, has stopped itself (SIGSTOP) after printing its pid: what it
/// holds then is what it was started with. Not from a program it exec'd: /proc names that
/// program as soon as the exec is done, while its loader and setlocale still open and close
/// files of their own (a `sleep` seen that early, under load, held its locale files at fd 3).
#[test]
fn a_command_starts_in_its_own_group_with_no_signal_blocked_and_only_its_stdio() {
    let redis = RedisServer::start();
    let p = Project::new();
    p.write(
        "jobs/app.toml",
        "[[job]]\nclass = \"StateJob\"\n\
         run = [\"/bin/sh\", \"-c\", \"echo command-pid=$$ end; kill -STOP $$\"]\n",
    );
    let w = Worker::builder(&redis).jobs(p.path()).start();
    enqueue(&redis, &["StateJob"]);
    w.wait_for_line("command-pid=", Duration::from_secs(20));
    let line = w.line_with("command-pid=").unwrap();
    let pid: i32 = line
        .split("command-pid=")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let proc = |f: &str| std::fs::read_to_string(format!("/proc/{pid}/{f}")).unwrap();
    let state = || proc("stat").rsplit(") ").next().unwrap().starts_with('T');
    wait_until("the command stopped itself", Duration::from_secs(20), state);
    let stat = proc("stat");
    let after_comm: Vec<&str> = stat.rsplit(") ").next().unwrap().split(' ').collect();
    assert_eq!(after_comm[2], pid.to_string(), "process group: {stat}");
    let status = proc("status");
    let mask = |name: &str| {
        let v = status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .unwrap()
            .trim();
        u64::from_str_radix(v, 16).unwrap()
    };
    assert_eq!(mask("SigBlk:"), 0, "blocked signals: {status}");
    assert_eq!(
        mask("SigIgn:") & (1 << (13 - 1)),
        0,
        "SIGPIPE ignored: {status}"
    );
    let mut got: Vec<u32> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().parse().unwrap())
        .collect();
    got.sort_unstable();
    // Besides its stdio, only what the worker itself inherited without close-on-exec from
    // whoever started this test (a terminal's or CI runner's fds) may reach it.
    let mut want: Vec<u32> = vec![0, 1, 2];
    want.extend(inherited_fds());
    want.sort_unstable();
    assert_eq!(got, want, "open fds of the command");
    signal(pid, "KILL");
}

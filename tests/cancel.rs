//! Sidekiq's cancel against real workers, a private redis-server and (for the fenced cycle) a
//! private PostgreSQL cluster: a plain command killed, a cycle stopped at its boundary or
//! killed mid-phase with its database fence retired, a job cancelled before it starts, and
//! `playguard check` refusing bad `on_cancel` values. Redis keys: `it-<jid>`, `queue:default`,
//! `retry`, `dead`, the test locks `lock:*`. Tables: `playguard_fences`, `playguard_cycles`,
//! the guarded `channels` row.
//!
//! Debian's Ruby Sidekiq (6.4.1) has no `cancel!`; [`cancel`] sends the commands that
//! Sidekiq 8.1.7's `Sidekiq::Client#cancel!` sends (lib/sidekiq/client.rb), in one pipeline:
//! `hsetnx(key, "cancelled", Time.now.to_i)`, `hget(key, "cancelled")`,
//! `expire(key, Sidekiq::Job::Iterable::STATE_TTL, "nx")` with `key = "it-#{jid}"`
//! (7.3.3 to 7.3.10 send the same EXPIRE without "nx").

mod support;

use std::process::Command;
use std::time::Duration;
use support::*;

const PATIENCE: Duration = Duration::from_secs(20);

/// `Sidekiq::Client.new.cancel!(jid)`, command for command; returns what it returns (the
/// `cancelled` timestamp).
fn cancel(redis: &RedisServer, jid: &str) -> i64 {
    let key = format!("it-{jid}");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let (_, at, _): (i64, String, i64) = redis::pipe()
        .cmd("HSETNX")
        .arg(&key)
        .arg("cancelled")
        .arg(now)
        .cmd("HGET")
        .arg(&key)
        .arg("cancelled")
        .cmd("EXPIRE")
        .arg(&key)
        .arg(30 * 24 * 60 * 60)
        .arg("nx")
        .query(&mut redis.conn())
        .unwrap();
    at.parse().unwrap()
}

fn exists(redis: &RedisServer, key: &str) -> bool {
    redis::cmd("EXISTS")
        .arg(key)
        .query::<i64>(&mut redis.conn())
        .unwrap()
        == 1
}

fn fields(redis: &RedisServer, key: &str) -> Vec<String> {
    let mut f: Vec<String> = redis::cmd("HKEYS")
        .arg(key)
        .query(&mut redis.conn())
        .unwrap();
    f.sort();
    f
}

/// Nothing of the job is left to run: no queue entry, no retry, no dead entry, no working copy.
fn assert_gone_for_good(redis: &RedisServer) {
    assert_eq!(redis.llen("queue:default"), 0);
    assert_eq!(redis.zcard("retry"), 0, "a cancelled job is not retried");
    assert_eq!(redis.zcard("dead"), 0);
    wait_until("the working list to be acknowledged", PATIENCE, || {
        redis.working_jobs().is_empty()
    });
}

fn pid_in(p: &Project, file: &str) -> Option<i32> {
    p.read(file).trim().parse().ok()
}

/// A plain command job cancelled while it runs: its process group (the script and the child
/// it started) is killed, the job ends without a retry, and a line says why.
#[test]
fn a_cancelled_command_has_its_process_group_killed_and_is_not_retried() {
    let redis = RedisServer::start();
    let p = Project::new();
    p.script(
        "jobs/bin/long",
        "#!/bin/sh\nsleep 600 &\necho $! > child.pid\necho $$ > cmd.pid\nwait\n",
    );
    p.write(
        "jobs/app.toml",
        "[[job]]\nclass = \"LongJob\"\nrun = [\"jobs/bin/long\"]\n",
    );
    let w = Worker::builder(&redis).jobs(p.path()).start();
    let jid = enqueue(&redis, &["LongJob"]);
    wait_until("the command and its child to start", PATIENCE, || {
        pid_in(&p, "cmd.pid").is_some() && pid_in(&p, "child.pid").is_some()
    });
    let (cmd, child) = (
        pid_in(&p, "cmd.pid").unwrap(),
        pid_in(&p, "child.pid").unwrap(),
    );
    assert!(cancel(&redis, &jid) > 0);
    w.wait_for_line(
        "job cancelled: its command was stopped (no retry)",
        PATIENCE,
    );
    wait_until("the command's group to be gone", PATIENCE, || {
        !pid_alive(cmd) && !pid_alive(child)
    });
    assert_gone_for_good(&redis);
    assert!(!w.saw("fail:"), "{}", w.output());
}

/// The default `on_cancel = "boundary"`: the running phase finishes, no further phase starts,
/// the lock is released, the job is not retried, and `it-<jid>` keeps only its cancel flag.
#[test]
fn a_cancelled_cycle_stops_at_its_next_phase_boundary() {
    let redis = RedisServer::start();
    let p = Project::new();
    p.script("jobs/bin/wait", WAIT_FOR_GO);
    p.script("jobs/bin/second", "#!/bin/sh\ntouch second.ran\n");
    p.write(
        "jobs/app.toml",
        r#"
[[job]]
class = "CycleJob"
lock = { key = "lock:boundary", ttl_secs = 30 }
[[job.phase]]
name = "first"
run = ["jobs/bin/wait"]
[[job.phase]]
name = "second"
run = ["jobs/bin/second"]
"#,
    );
    let w = Worker::builder(&redis).jobs(p.path()).start();
    let jid = enqueue(&redis, &["CycleJob", "m1"]);
    wait_until("the first phase to start", PATIENCE, || {
        p.path().join("m1.started").exists()
    });
    cancel(&redis, &jid);
    p.go("m1");
    w.wait_for_line("cancelled: stopping at the phase boundary", PATIENCE);
    w.wait_for_line("lock:boundary: cycle cancelled (no retry)", PATIENCE);
    assert!(
        !p.path().join("second.ran").exists(),
        "no phase starts after the cancel"
    );
    assert!(w.saw("lock released (cancelled)"), "{}", w.output());
    assert!(!exists(&redis, "lock:boundary"), "the lock is released");
    assert_gone_for_good(&redis);
    assert_eq!(fields(&redis, &format!("it-{jid}")), ["cancelled"]);
}

/// A job whose jid was cancelled before it was fetched: a cycle takes no lock and runs no
/// phase, a command is not started; both end without a retry.
#[test]
fn a_job_cancelled_before_it_starts_runs_nothing() {
    let redis = RedisServer::start();
    let p = Project::new();
    p.script(
        "jobs/bin/mark",
        "#!/bin/sh\ntouch \"$PLAYGUARD_CLASS.ran\"\n",
    );
    p.write(
        "jobs/app.toml",
        r#"
[[job]]
class = "CycleJob"
lock = { key = "lock:early", ttl_secs = 30 }
[[job.phase]]
name = "only"
run = ["jobs/bin/mark"]

[[job]]
class = "PlainJob"
run = ["jobs/bin/mark"]
"#,
    );
    for (jid, class) in [
        ("c0ffee000000000000000001", "CycleJob"),
        ("c0ffee000000000000000002", "PlainJob"),
    ] {
        cancel(&redis, jid);
        push_to_default(
            &redis,
            format!(
                r#"{{"class":"{class}","args":[],"jid":"{jid}","queue":"default","retry":true,"created_at":1700000000.0,"enqueued_at":1700000000.0}}"#
            ),
        );
    }
    let w = Worker::builder(&redis).jobs(p.path()).start();
    w.wait_for_line(
        "cycle cancelled before its first phase: not run (no retry)",
        PATIENCE,
    );
    w.wait_for_line(
        "job cancelled before it started: not run (no retry)",
        PATIENCE,
    );
    assert_gone_for_good(&redis);
    assert!(!p.path().join("CycleJob.ran").exists());
    assert!(!p.path().join("PlainJob.ran").exists());
    assert!(
        !exists(&redis, "lock:early") && !exists(&redis, "lock:early:fence"),
        "no lock was taken"
    );
}

/// `on_cancel = "kill"` with `fence = "database"`: the phase writes through a session of its
/// own (as a command over SSH would, so killing the phase's group does not stop it). One write
/// lands before the cancel; the cancel kills the phase, retires the fence, records `cancelled`
/// and releases the lock; the write the orphaned writer makes after that is refused.
#[test]
fn a_cancel_kills_a_fenced_phase_and_no_write_of_it_lands_afterwards() {
    let redis = RedisServer::start();
    let pg = PostgresServer::start();
    // playguard_cycles as releases before `cancelled` made it (its CHECK without that
    // outcome): the worker's start widens the check, or the ledger could not say `cancelled`.
    pg.psql(
        "CREATE TABLE playguard_cycles (
             id bigserial PRIMARY KEY, lock_key text NOT NULL, jid text NOT NULL,
             fence bigint NOT NULL, identity text NOT NULL,
             started_at timestamptz NOT NULL DEFAULT now(), finished_at timestamptz,
             outcome text NOT NULL DEFAULT 'running'
                 CHECK (outcome IN ('running', 'complete', 'failed', 'lock_lost', 'interrupted', 'uncertain')),
             phase text, error text);",
    );
    pg.psql(
        "CREATE TABLE channels (id int PRIMARY KEY, retention_days int NOT NULL, fence bigint NOT NULL);
         INSERT INTO channels VALUES (7, 7, 0);",
    );
    let p = Project::new();
    p.script(
        "jobs/bin/write",
        "#!/bin/sh\necho $$ > phase.pid\nsetsid jobs/bin/writer &\nwait\n",
    );
    // The FOR SHARE recipe of docs/fencing.md; values reach psql only as -v variables.
    p.script(
        "jobs/bin/writer",
        r#"#!/bin/sh
set -eu
for step in early late; do
  while [ ! -e "$step.go" ]; do sleep 0.02; done
  n=$(psql -X -q -A -t -v ON_ERROR_STOP=1 -v days="$step" -v fence="$PLAYGUARD_FENCE" -v key="$PLAYGUARD_LOCK_KEY" -d "$DATABASE_URL" <<'SQL'
WITH u AS (UPDATE channels SET retention_days = length(:'days'), fence = :'fence'::bigint
            WHERE id = 7 AND fence <= :'fence'::bigint
              AND :'fence'::bigint = (SELECT fence FROM playguard_fences WHERE lock_key = :'key' FOR SHARE)
            RETURNING 1)
SELECT count(*) FROM u;
SQL
)
  echo "$step fence=$PLAYGUARD_FENCE rows=$n" >> writes.log
done
"#,
    );
    p.write(
        "jobs/app.toml",
        r#"
[[job]]
class = "FencedJob"
lock = { key = "lock:fenced", ttl_secs = 30, fence = "database" }
on_cancel = "kill"
[[job.phase]]
name = "write"
run = ["jobs/bin/write"]
[[job.phase]]
name = "after"
run = ["jobs/bin/write"]
"#,
    );
    let writes = p.path().join("writes.log");
    let w = Worker::builder(&redis)
        .jobs(p.path())
        .env("DATABASE_URL", pg.url())
        .start();
    let jid = enqueue(&redis, &["FencedJob"]);
    wait_until("the phase to start", PATIENCE, || {
        pid_in(&p, "phase.pid").is_some()
    });
    let phase = pid_in(&p, "phase.pid").unwrap();
    let ours: i64 = pg
        .psql("SELECT fence FROM playguard_fences WHERE lock_key = 'lock:fenced'")
        .parse()
        .unwrap();
    p.write("early.go", "");
    wait_until("the early write", PATIENCE, || {
        read_or_empty(&writes).contains("early")
    });
    assert_eq!(
        read_or_empty(&writes).trim(),
        format!("early fence={ours} rows=1")
    );

    cancel(&redis, &jid);
    w.wait_for_line("lock:fenced: cycle cancelled (no retry)", PATIENCE);
    assert!(
        w.saw("cancelled: the running phase was stopped"),
        "{}",
        w.output()
    );
    wait_until("the phase's process group to be killed", PATIENCE, || {
        !pid_alive(phase)
    });
    assert_eq!(
        pg.psql("SELECT outcome, phase FROM playguard_cycles WHERE lock_key = 'lock:fenced'"),
        "cancelled|write"
    );
    assert_eq!(
        pg.psql("SELECT fence FROM playguard_fences WHERE lock_key = 'lock:fenced'"),
        (ours + 1).to_string(),
        "the cancelled cycle's fence is retired"
    );
    assert!(!exists(&redis, "lock:fenced"), "the lock is released");
    assert_gone_for_good(&redis);

    // The writer the kill could not reach tries once more: refused.
    p.write("late.go", "");
    wait_until("the late write", PATIENCE, || {
        read_or_empty(&writes).contains("late")
    });
    assert!(
        read_or_empty(&writes).contains(&format!("late fence={ours} rows=0")),
        "{}",
        read_or_empty(&writes)
    );
    assert_eq!(
        pg.psql("SELECT retention_days, fence FROM channels WHERE id = 7"),
        format!("5|{ours}"),
        "only the write before the cancel landed"
    );
    assert!(!w.saw("phase start phase=after") && w.count_lines("phase start") == 1);
}

/// `playguard check` names the file and the entry of a bad `on_cancel`.
#[test]
fn check_refuses_bad_on_cancel_values() {
    let redis = RedisServer::start();
    for (entry, why) in [
        (
            "[[job]]\nclass = \"CancelA\"\nlock = { key = \"k\" }\non_cancel = \"later\"\n[[job.phase]]\nname = \"p\"\nrun = [\"true\"]\n",
            "on_cancel = \"later\" is not supported (\"boundary\" or \"kill\")",
        ),
        (
            "[[job]]\nclass = \"CancelA\"\nrun = [\"true\"]\non_cancel = \"kill\"\n",
            "on_cancel applies to [[job.phase]] jobs",
        ),
    ] {
        let p = Project::new();
        p.write("jobs/bad.toml", entry);
        let out = Command::new(bin())
            .args(["check", "-r", &redis.url(), "-j"])
            .arg(p.path().join("jobs"))
            .current_dir(p.path())
            .output()
            .unwrap();
        let text = output_text(&out);
        assert!(!out.status.success(), "{text}");
        assert!(text.contains("bad.toml: [[job]] #1 (class \"CancelA\"):"), "{text}");
        assert!(text.contains(why), "{text}");
    }
}

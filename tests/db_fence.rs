//! Fences that never go backwards and the cycle ledger, through real workers against a
//! private redis-server and a private PostgreSQL cluster (initdb in a temp dir). Redis keys:
//! `lock:*` and `lock:*:fence` (the locks under test), Sidekiq's queues. Tables:
//! `playguard_fences`, `playguard_cycles`, and the guarded `channels` row of seed 004.

mod support;

use std::process::Command;
use std::time::Duration;
use support::*;

const PATIENCE: Duration = Duration::from_secs(20);

/// (fence, outcome, phase, error) of each ledger row of `key`, oldest first.
fn ledger(pg: &PostgresServer, key: &str) -> Vec<(i64, String, String, String)> {
    let out = pg.psql(&format!(
        "SELECT fence, outcome, coalesce(phase, ''), coalesce(error, '') FROM playguard_cycles \
         WHERE lock_key = '{key}' ORDER BY id"
    ));
    out.lines()
        .filter(|l| !l.is_empty())
        .map(|l| {
            let f: Vec<&str> = l.splitn(4, '|').collect();
            (
                f[0].parse().unwrap(),
                f[1].to_string(),
                f[2].to_string(),
                f[3].to_string(),
            )
        })
        .collect()
}

fn db_fence(pg: &PostgresServer, key: &str) -> i64 {
    pg.psql(&format!(
        "SELECT fence FROM playguard_fences WHERE lock_key = '{key}'"
    ))
    .parse()
    .unwrap()
}

fn redis_exists(redis: &RedisServer, key: &str) -> bool {
    redis::cmd("EXISTS")
        .arg(key)
        .query::<i64>(&mut redis.conn())
        .unwrap()
        == 1
}

fn worker(redis: &RedisServer, pg: &PostgresServer, p: &Project) -> Worker {
    Worker::builder(redis)
        .jobs(p.path())
        .args(["-c", "2", "-t", "5"])
        .env("DATABASE_URL", pg.url())
        .start()
}

/// A phase that waits for the file `$1.go` (created by the test) after touching `$1.started`.
const WAIT_FOR_ARGV1_GO: &str = "#!/bin/sh\n\
    touch \"$1.started\"\n\
    while [ ! -e \"$1.go\" ]; do sleep 0.02; done\n";

/// Redis restarted with SHUTDOWN NOSAVE between cycles: in both modes every fence is above
/// every fence before it, and the first database fence of a key starts above its Redis counter.
#[test]
fn fences_strictly_increase_across_a_redis_restart_in_both_modes() {
    let mut redis = RedisServer::start();
    let pg = PostgresServer::start();
    let p = Project::new();
    p.script(
        "jobs/bin/record",
        "#!/bin/sh\necho \"$PLAYGUARD_CLASS $PLAYGUARD_FENCE\" >> fences.log\n",
    );
    p.write(
        "jobs/app.toml",
        r#"
[[job]]
class = "RedisFenced"
lock = { key = "lock:r:{args.0}", ttl_secs = 30 }
[[job.phase]]
name = "record"
run = ["jobs/bin/record"]

[[job]]
class = "DbFenced"
lock = { key = "lock:d:{args.0}", ttl_secs = 30, fence = "database" }
[[job.phase]]
name = "record"
run = ["jobs/bin/record"]
"#,
    );
    let log = p.path().join("fences.log");
    let run_once = |redis: &RedisServer, class: &str| {
        let before = read_or_empty(&log).lines().count();
        enqueue(redis, &[class, "7"]);
        wait_until("the cycle's fence line", PATIENCE, || {
            read_or_empty(&log).lines().count() > before
        });
    };

    let mut w = worker(&redis, &pg, &p);
    run_once(&redis, "RedisFenced");
    let redis_counter: i64 = redis::cmd("GET")
        .arg("lock:d:7:fence")
        .query::<Option<i64>>(&mut redis.conn())
        .unwrap()
        .unwrap_or(0);
    run_once(&redis, "DbFenced");
    run_once(&redis, "RedisFenced");
    run_once(&redis, "DbFenced");
    w.stop(PATIENCE);
    let first_db: i64 = read_or_empty(&log)
        .lines()
        .find_map(|l| l.strip_prefix("DbFenced "))
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        first_db > redis_counter,
        "first database fence {first_db} starts above the Redis counter {redis_counter}"
    );

    redis.shutdown_nosave_and_restart();
    assert!(
        !redis_exists(&redis, "lock:r:7:fence"),
        "Redis lost its data"
    );
    let mut w = worker(&redis, &pg, &p);
    for _ in 0..2 {
        run_once(&redis, "RedisFenced");
        run_once(&redis, "DbFenced");
    }
    w.stop(PATIENCE);

    for class in ["RedisFenced", "DbFenced"] {
        let fences: Vec<i64> = read_or_empty(&log)
            .lines()
            .filter_map(|l| l.strip_prefix(&format!("{class} ")))
            .map(|f| f.parse().unwrap())
            .collect();
        assert_eq!(fences.len(), 4, "{class}: {fences:?}");
        assert!(
            fences.windows(2).all(|w| w[1] > w[0]),
            "{class}: fences must strictly increase across the restart: {fences:?}"
        );
    }
    // Both modes keep a ledger when a database is configured; every cycle completed.
    for key in ["lock:r:7", "lock:d:7"] {
        let rows = ledger(&pg, key);
        assert_eq!(rows.len(), 4, "{key}: {rows:?}");
        assert!(rows.iter().all(|r| r.1 == "complete"), "{key}: {rows:?}");
    }
}

/// Seed 004's retention timeline against a real PostgreSQL row, through two real workers whose
/// phase commands write with psql. The row and the key's fence start at 32. W1 takes the lock
/// and is paused (SIGSTOP: worker and the phase's writer, which runs apart from the phase's
/// process group as a remote command would) past its lease; W2 takes it with a higher fence.
/// W1's phase wakes and writes 30 days (lands: nobody newer wrote yet), W2 writes 90 days
/// (lands), W1 writes 30 days again (refused). The row ends with W2's value and fence.
#[test]
fn seed_004_retention_timeline_against_a_postgres_row() {
    let redis = RedisServer::start();
    let pg = PostgresServer::start();
    pg.psql(playguard::db::SCHEMA);
    pg.psql(
        "CREATE TABLE channels (id int PRIMARY KEY, retention_days int NOT NULL, fence bigint NOT NULL);
         INSERT INTO channels VALUES (7, 7, 32);
         INSERT INTO playguard_fences (lock_key, fence) VALUES ('lock:retention', 32);",
    );
    let p = Project::new();
    // Job data reaches psql only as -v variables, never inside a shell or SQL string.
    // The writes run in a session of their own, as a command run over SSH runs on its remote
    // host: the guardian kills the phase's process group before the lock can expire (the
    // worker is frozen), and a write already under way elsewhere is what the fence refuses.
    p.script(
        "jobs/bin/write-retention",
        r#"#!/bin/sh
set -eu
days=$(printf '%s' "$PLAYGUARD_ARGS" | tr -d '[] "' | cut -d, -f1)
who=$(printf '%s' "$PLAYGUARD_ARGS" | tr -d '[] "' | cut -d, -f2)
setsid jobs/bin/retention-writer "$days" "$who" &
wait
"#,
    );
    p.script(
        "jobs/bin/retention-writer",
        r#"#!/bin/sh
set -eu
days=$1
who=$2
echo $$ > "$who.pid"
for step in $(cat "$who.steps"); do
  while [ ! -e "$who-$step.go" ]; do sleep 0.02; done
  n=$(psql -X -q -A -t -v ON_ERROR_STOP=1 -v days="$days" -v fence="$PLAYGUARD_FENCE" -d "$DATABASE_URL" <<'SQL'
WITH u AS (UPDATE channels SET retention_days = :'days'::int, fence = :'fence'::bigint
            WHERE id = 7 AND fence <= :'fence'::bigint RETURNING 1)
SELECT count(*) FROM u;
SQL
)
  echo "$who $step fence=$PLAYGUARD_FENCE rows=$n" >> writes.log
done
"#,
    );
    p.write("w1.steps", "first second\n");
    p.write("w2.steps", "only\n");
    p.write(
        "jobs/app.toml",
        r#"
[[job]]
class = "RetentionJob"
lock = { key = "lock:retention", ttl_secs = 4, fence = "database" }
[[job.phase]]
name = "write_retention"
run = ["jobs/bin/write-retention"]
"#,
    );
    let writes = p.path().join("writes.log");
    let go = |f: &str| std::fs::write(p.path().join(f), "").unwrap();
    let write_line = |prefix: &str| {
        wait_until(prefix, PATIENCE, || read_or_empty(&writes).contains(prefix));
        read_or_empty(&writes)
            .lines()
            .find(|l| l.starts_with(prefix))
            .unwrap()
            .to_string()
    };

    let w1 = worker(&redis, &pg, &p);
    enqueue(&redis, &["RetentionJob", "30", "w1"]);
    wait_until("W1's phase to start", PATIENCE, || {
        read_or_empty(&p.path().join("w1.pid"))
            .trim()
            .parse::<i32>()
            .is_ok()
    });
    let f1 = db_fence(&pg, "lock:retention");
    assert!(f1 > 32);
    let w1_phase: i32 = read_or_empty(&p.path().join("w1.pid"))
        .trim()
        .parse()
        .unwrap();
    w1.signal("STOP");
    signal(w1_phase, "STOP");
    wait_until("W1's lease to run out in Redis", PATIENCE, || {
        !redis_exists(&redis, "lock:retention")
    });

    let w2 = worker(&redis, &pg, &p);
    enqueue(&redis, &["RetentionJob", "90", "w2"]);
    wait_until("W2's phase to start", PATIENCE, || {
        p.path().join("w2.pid").exists()
    });
    let f2 = db_fence(&pg, "lock:retention");
    assert!(f2 > f1, "W2's fence {f2} is above W1's {f1}");

    signal(w1_phase, "CONT");
    go("w1-first.go");
    assert_eq!(
        write_line("w1 first"),
        format!("w1 first fence={f1} rows=1")
    );
    go("w2-only.go");
    assert_eq!(write_line("w2 only"), format!("w2 only fence={f2} rows=1"));
    go("w1-second.go");
    assert_eq!(
        write_line("w1 second"),
        format!("w1 second fence={f1} rows=0"),
        "W1's stale write is refused"
    );
    assert_eq!(
        pg.psql("SELECT retention_days, fence FROM channels WHERE id = 7"),
        format!("90|{f2}")
    );

    w1.signal("CONT");
    w1.wait_for_line("aborted: lock lost", PATIENCE);
    w2.wait_for_line("lock released (cycle complete)", PATIENCE);
    let rows = ledger(&pg, "lock:retention");
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert_eq!(
        (rows[0].0, rows[0].1.as_str()),
        (f1, "uncertain"),
        "W2's acquisition found W1's row still running: {rows:?}"
    );
    assert_eq!((rows[1].0, rows[1].1.as_str()), (f2, "complete"));
}

/// An operator bumps the key's fence in PostgreSQL while a phase runs: the renewal after that
/// phase finds a newer fence, the cycle stops (no further phase), the Redis lease is released,
/// and the ledger row says `lock_lost`.
#[test]
fn a_database_side_fence_bump_aborts_the_cycle_at_the_next_boundary() {
    let redis = RedisServer::start();
    let pg = PostgresServer::start();
    let p = Project::new();
    p.script("jobs/bin/wait", WAIT_FOR_ARGV1_GO);
    p.script("jobs/bin/after", "#!/bin/sh\ntouch after.ran\n");
    p.write(
        "jobs/app.toml",
        r#"
[[job]]
class = "BumpJob"
lock = { key = "lock:bump", ttl_secs = 30, fence = "database" }
[[job.phase]]
name = "wait"
run = ["jobs/bin/wait", "bump"]
[[job.phase]]
name = "after"
run = ["jobs/bin/after"]
"#,
    );
    let w = worker(&redis, &pg, &p);
    enqueue(&redis, &["BumpJob"]);
    wait_until("the first phase to start", PATIENCE, || {
        p.path().join("bump.started").exists()
    });
    let ours = db_fence(&pg, "lock:bump");
    assert!(redis_exists(&redis, "lock:bump"));
    pg.psql("UPDATE playguard_fences SET fence = fence + 1 WHERE lock_key = 'lock:bump'");
    std::fs::write(p.path().join("bump.go"), "").unwrap();

    w.wait_for_line("lock released (lock lost)", PATIENCE);
    w.wait_for_line("aborted: lock lost", PATIENCE);
    assert!(
        !p.path().join("after.ran").exists(),
        "no phase starts after the fence was bumped"
    );
    assert!(!redis_exists(&redis, "lock:bump"), "the lease is released");
    let rows = ledger(&pg, "lock:bump");
    assert_eq!(rows.len(), 1, "{rows:?}");
    let (fence, outcome, phase, error) = &rows[0];
    assert_eq!(
        (*fence, outcome.as_str(), phase.as_str()),
        (ours, "lock_lost", "wait")
    );
    assert!(
        error.contains(&format!("holds fence {}", ours + 1)),
        "{error}"
    );
}

/// A worker SIGKILLed mid-cycle leaves its ledger row `running`; the next acquisition marks it
/// `uncertain` and completes its own. After the test's own Redis restarts empty (it keeps
/// nothing on disk), every row is still there.
#[test]
fn a_killed_holders_row_becomes_uncertain_and_the_ledger_survives_losing_redis() {
    let mut redis = RedisServer::start();
    let pg = PostgresServer::start();
    let p = Project::new();
    p.script("jobs/bin/wait", WAIT_FOR_ARGV1_GO);
    p.script("jobs/bin/done", "#!/bin/sh\necho done >> done.log\n");
    p.write(
        "jobs/app.toml",
        r#"
[[job]]
class = "KillJob"
lock = { key = "lock:kill", ttl_secs = 3, fence = "database" }
[[job.phase]]
name = "wait"
run = ["jobs/bin/wait", "kill"]
[[job.phase]]
name = "done"
run = ["jobs/bin/done"]
"#,
    );
    let mut a = worker(&redis, &pg, &p);
    enqueue(&redis, &["KillJob"]);
    wait_until("A's first phase to start", PATIENCE, || {
        p.path().join("kill.started").exists()
    });
    let fence_a = db_fence(&pg, "lock:kill");
    a.kill9();
    assert_eq!(ledger(&pg, "lock:kill")[0].1, "running");
    wait_until("A's lease to run out", PATIENCE, || {
        !redis_exists(&redis, "lock:kill")
    });

    std::fs::write(p.path().join("kill.go"), "").unwrap();
    let mut b = worker(&redis, &pg, &p);
    enqueue(&redis, &["KillJob"]);
    wait_until("a complete cycle after A's", PATIENCE, || {
        let rows = ledger(&pg, "lock:kill");
        rows.iter().any(|r| r.1 == "complete") && !rows.iter().any(|r| r.1 == "running")
    });
    b.stop(PATIENCE);
    let rows = ledger(&pg, "lock:kill");
    assert_eq!((rows[0].0, rows[0].1.as_str()), (fence_a, "uncertain"));
    assert!(rows[0].3.contains("no outcome recorded"), "{rows:?}");
    assert!(
        rows[1..].iter().all(|r| r.0 > fence_a && r.1 == "complete"),
        "{rows:?}"
    );

    redis.restart();
    assert_eq!(
        redis::cmd("DBSIZE")
            .query::<i64>(&mut redis.conn())
            .unwrap(),
        0,
        "the restarted Redis is empty"
    );
    assert_eq!(
        ledger(&pg, "lock:kill"),
        rows,
        "the ledger does not live in Redis"
    );
}

/// PostgreSQL stopped while a phase runs: the renewal cannot confirm the fence, the cycle stops
/// there (lease released), the process keeps running, and once PostgreSQL is back the next
/// cycle runs. The stopped cycle's outcome could not be written, so its row ends `uncertain`.
#[test]
fn postgres_stopped_mid_cycle_aborts_it_and_the_next_cycle_runs_when_it_is_back() {
    let redis = RedisServer::start();
    let mut pg = PostgresServer::start();
    let p = Project::new();
    p.script(
        "jobs/bin/wait-once",
        "#!/bin/sh\n[ -e first.done ] && exit 0\ntouch started\n\
         while [ ! -e go ]; do sleep 0.02; done\ntouch first.done\n",
    );
    p.script("jobs/bin/after", "#!/bin/sh\necho after >> after.log\n");
    p.write(
        "jobs/app.toml",
        r#"
[[job]]
class = "PgStopJob"
lock = { key = "lock:pgstop", ttl_secs = 30, fence = "database" }
[[job.phase]]
name = "wait"
run = ["jobs/bin/wait-once"]
[[job.phase]]
name = "after"
run = ["jobs/bin/after"]
"#,
    );
    let mut w = worker(&redis, &pg, &p);
    enqueue(&redis, &["PgStopJob"]);
    wait_until("the first phase to start", PATIENCE, || {
        p.path().join("started").exists()
    });
    pg.stop();
    std::fs::write(p.path().join("go"), "").unwrap();
    w.wait_for_line("lock released (lock lost)", PATIENCE);
    assert!(
        w.saw("could not confirm the fence with PostgreSQL"),
        "{}",
        w.output()
    );
    assert!(
        !p.path().join("after.log").exists(),
        "no phase after the failed proof"
    );
    assert!(!redis_exists(&redis, "lock:pgstop"));
    assert!(
        w.child.try_wait().unwrap().is_none(),
        "the worker keeps running"
    );

    pg.restart();
    enqueue(&redis, &["PgStopJob"]);
    wait_until("the next cycle's second phase", PATIENCE, || {
        read_or_empty(&p.path().join("after.log")).lines().count() == 1
    });
    w.wait_for_line("lock released (cycle complete)", PATIENCE);
    w.stop(PATIENCE);
    let rows = ledger(&pg, "lock:pgstop");
    let outcomes: Vec<&str> = rows.iter().map(|r| r.1.as_str()).collect();
    assert_eq!(outcomes, ["uncertain", "complete"], "{rows:?}");
    assert!(rows[1].0 > rows[0].0);
}

/// `fence = "database"` without a database URL stops `run` and `check` with one clear line
/// and exit 2; with a URL, `check` reaches PostgreSQL and never prints the password, and the
/// SQL of `db schema` applies twice (idempotent).
#[test]
fn database_fences_need_a_url_and_check_hides_the_password() {
    let p = Project::new();
    p.script("jobs/bin/x", "#!/bin/sh\nexit 0\n");
    p.write(
        "jobs/app.toml",
        r#"
[[job]]
class = "DbJob"
lock = { key = "lock:x", fence = "database" }
[[job.phase]]
name = "x"
run = ["jobs/bin/x"]
"#,
    );
    for sub in ["run", "check"] {
        let out = Command::new(bin())
            .args([sub, "-r", "redis://127.0.0.1:1/0"])
            .current_dir(p.path())
            .env_remove("DATABASE_URL")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{sub}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{sub}: {err}");
        assert!(
            err.contains("DbJob")
                && err.contains("fence = \"database\"")
                && err.contains("DATABASE_URL"),
            "{sub}: {err}"
        );
    }

    let redis = RedisServer::start();
    let pg = PostgresServer::start();
    let url = pg
        .url()
        .replace("postgres@", "postgres:not-shown-anywhere@");
    let out = Command::new(bin())
        .args(["check", "-r", &redis.url(), "--database-url", &url])
        .current_dir(p.path())
        .output()
        .unwrap();
    let text = output_text(&out);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(
        text.contains("PostgreSQL") && text.contains("postgres:***@"),
        "{text}"
    );
    assert!(!text.contains("not-shown-anywhere"), "{text}");

    let out = Command::new(bin()).args(["db", "schema"]).output().unwrap();
    let schema = String::from_utf8(out.stdout).unwrap();
    assert!(schema.contains("CREATE TABLE IF NOT EXISTS playguard_cycles"));
    pg.psql(&schema);
    pg.psql(&schema);
    assert_eq!(
        pg.psql(
            "SELECT count(*) FROM information_schema.tables WHERE table_name LIKE 'playguard_%'"
        ),
        "2"
    );
}

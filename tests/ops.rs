//! The operator commands `playguard locks` and `playguard cycles`, through real workers
//! running a slow-phase reconcile job against a private redis-server and a private PostgreSQL
//! cluster. Redis keys: `lock:c:*` (the cycles' locks), `playguard:locks:<identity>`,
//! `processes`, `<identity>`, `<identity>:work`. Tables: `playguard_cycles`, `playguard_fences`.

mod support;

use serde_json::Value;
use std::process::Command;
use std::time::Duration;
use support::*;

const PATIENCE: Duration = Duration::from_secs(30);

/// Three phases, the middle one slow (`<name>.go` lets it end); fences from PostgreSQL.
fn project() -> Project {
    Project::go_gated_cycle("lock:c:")
}

fn worker(redis: &RedisServer, pg: &PostgresServer, p: &Project) -> Worker {
    Worker::builder(redis)
        .jobs(p.path())
        .args(["-c", "3", "-t", "5"])
        .env("DATABASE_URL", pg.url())
        .start()
}

/// `playguard <args>` with exactly `env` (DATABASE_URL only when given): (exit, stdout, stderr).
fn playguard(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let out = Command::new(bin())
        .args(args)
        .env_remove("DATABASE_URL")
        .env_remove("REDIS_URL")
        .envs(env.iter().copied())
        .output()
        .expect("run playguard");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `playguard <sub> --json ...`, insisting on exit 0 and one JSON array on stdout.
fn json_of(args: &[&str], env: &[(&str, &str)]) -> Vec<Value> {
    let (code, out, err) = playguard(args, env);
    assert_eq!(code, 0, "playguard {args:?}: {err}");
    let v: Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("not JSON ({e}):\n{out}\n{err}"));
    v.as_array()
        .unwrap_or_else(|| panic!("not an array: {v}"))
        .clone()
}

fn locks(redis: &RedisServer, pg: Option<&PostgresServer>) -> Vec<Value> {
    let url = redis.url();
    let db = pg.map(|p| p.url());
    let env: Vec<(&str, &str)> = db.iter().map(|u| ("DATABASE_URL", u.as_str())).collect();
    json_of(&["locks", "-r", &url, "--json"], &env)
}

fn started(p: &Project, name: &str) {
    wait_until(&format!("{name}'s slow phase to start"), PATIENCE, || {
        p.path().join(format!("{name}.started")).exists()
    });
}

/// (id, outcome) of the ledger rows of `key`, oldest first, read with psql.
fn ledger(pg: &PostgresServer, key: &str) -> Vec<(i64, String)> {
    pg.psql(&format!(
        "SELECT id, outcome FROM playguard_cycles WHERE lock_key = '{key}' ORDER BY id"
    ))
    .lines()
    .filter(|l| !l.is_empty())
    .map(|l| {
        let (id, outcome) = l.split_once('|').unwrap();
        (id.parse().unwrap(), outcome.to_string())
    })
    .collect()
}

fn identity_of_the_one_process(redis: &RedisServer) -> String {
    let mut c = redis.conn();
    wait_until("one process in `processes`", PATIENCE, || {
        redis::cmd("SCARD")
            .arg("processes")
            .query::<i64>(&mut c)
            .unwrap()
            == 1
    });
    let ids: Vec<String> = redis::cmd("SMEMBERS")
        .arg("processes")
        .query(&mut c)
        .unwrap();
    ids[0].clone()
}

/// A running cycle is listed with its key, label, holder, host, jid, phase, lease left and the
/// fence it really uses (PostgreSQL's, not the Redis record's); a key taken over behind its
/// back shows as stale; once the cycle ends it is no longer listed.
#[test]
fn locks_lists_the_running_cycle_with_its_phase_and_fence_then_forgets_it() {
    let redis = RedisServer::start();
    let pg = PostgresServer::start();
    let p = project();
    let mut w = worker(&redis, &pg, &p);
    let identity = identity_of_the_one_process(&redis);
    let host = identity.rsplitn(3, ':').nth(2).unwrap().to_string();
    assert!(locks(&redis, Some(&pg)).is_empty(), "no lock before a job");
    let (code, out, _) = playguard(&["locks", "-r", &redis.url()], &[]);
    assert_eq!((code, out.as_str()), (0, "no locks held\n"));

    let jid = enqueue(&redis, &["MarqueeCycle", "7"]);
    started(&p, "7");
    // The phase reaches the work hash at the next heartbeat.
    let mut list = Vec::new();
    wait_until("locks --json shows phase apply", PATIENCE, || {
        list = locks(&redis, Some(&pg));
        list.len() == 1 && list[0]["phase"] == "apply"
    });
    let l = &list[0];
    let db_fence: i64 = pg
        .psql("SELECT fence FROM playguard_fences WHERE lock_key = 'lock:c:7'")
        .parse()
        .unwrap();
    let cycle_id: i64 = pg
        .psql("SELECT id FROM playguard_cycles WHERE lock_key = 'lock:c:7' AND outcome = 'running'")
        .parse()
        .unwrap();
    let record: String = redis::cmd("HGET")
        .arg(format!("playguard:locks:{identity}"))
        .arg("lock:c:7")
        .query(&mut redis.conn())
        .unwrap();
    let record: Value = serde_json::from_str(&record).unwrap();
    let redis_fence = record["fence"].as_i64().unwrap();
    assert_ne!(redis_fence, db_fence, "the two stores' fences differ");
    assert_eq!(l["key"], "lock:c:7", "{l}");
    assert_eq!(l["label"], "Marquee 7", "{l}");
    assert_eq!(l["identity"], identity.as_str(), "{l}");
    assert_eq!(l["host"], host.as_str(), "{l}");
    assert_eq!(l["jid"], jid.as_str(), "{l}");
    assert_eq!(l["class"], "MarqueeCycle", "{l}");
    assert_eq!(l["state"], "held", "{l}");
    assert_eq!(l["fence"], db_fence, "the database fence is shown: {l}");
    assert_eq!(l["fence_from"], "ledger", "{l}");
    assert_eq!(l["cycle_id"], cycle_id, "{l}");
    assert_eq!(l["ttl_ms"], 30_000, "{l}");
    let left = l["left_ms"].as_i64().unwrap();
    assert!(left > 0 && left <= 30_000, "{l}");
    assert!(l["held_ms"].as_i64().unwrap() >= 0, "{l}");
    assert!(l["acquired_at"].as_str().unwrap().ends_with('Z'), "{l}");

    // Without a database URL the Redis record's fence is all there is, and says so.
    let plain = locks(&redis, None);
    assert_eq!(plain[0]["fence"], redis_fence, "{plain:?}");
    assert_eq!(plain[0]["fence_from"], "redis");

    // The table: one header, one row naming the same things.
    let (code, out, err) = playguard(
        &["locks", "-r", &redis.url()],
        &[("DATABASE_URL", &pg.url())],
    );
    assert_eq!(code, 0, "{err}");
    eprintln!("playguard locks:\n{out}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "{out}");
    assert!(lines[0].starts_with("KEY "), "{out}");
    for needle in [
        "lock:c:7",
        "Marquee 7",
        &identity,
        &jid,
        "apply",
        &db_fence.to_string(),
        "held",
    ] {
        assert!(lines[1].contains(needle), "row lacks {needle:?}:\n{out}");
    }
    // Columns line up: a header starts where its cell starts.
    assert_eq!(
        lines[0].find("HOLDER"),
        lines[1].find(identity.as_str()),
        "{out}"
    );

    // Someone else's token in the key (a lease that ran out and was retaken): stale, no lease.
    redis::cmd("SET")
        .arg("lock:c:7")
        .arg("another-owner")
        .arg("PX")
        .arg(60_000)
        .query::<()>(&mut redis.conn())
        .unwrap();
    let stale = locks(&redis, Some(&pg));
    assert_eq!(stale.len(), 1, "{stale:?}");
    assert_eq!(stale[0]["state"], "stale", "{stale:?}");
    assert!(stale[0]["left_ms"].is_null(), "{stale:?}");

    p.go("7");
    wait_until("the cycle ended as lock_lost", PATIENCE, || {
        ledger(&pg, "lock:c:7").iter().any(|r| r.1 == "lock_lost")
    });
    wait_until("locks lists nothing once the cycle ended", PATIENCE, || {
        locks(&redis, Some(&pg)).is_empty()
    });
    // The other owner's key was left alone.
    let v: Option<String> = redis::cmd("GET")
        .arg("lock:c:7")
        .query(&mut redis.conn())
        .unwrap();
    assert_eq!(v.as_deref(), Some("another-owner"));
    redis::cmd("DEL")
        .arg("lock:c:7")
        .query::<()>(&mut redis.conn())
        .unwrap();

    // A second, clean cycle: held while it runs, gone after it completes.
    std::fs::remove_file(p.path().join("7.started")).unwrap();
    std::fs::remove_file(p.path().join("7.go")).unwrap();
    enqueue(&redis, &["MarqueeCycle", "7"]);
    started(&p, "7");
    wait_until("the new cycle is listed as held", PATIENCE, || {
        let l = locks(&redis, Some(&pg));
        l.len() == 1 && l[0]["state"] == "held"
    });
    p.go("7");
    wait_until("the cycle completed", PATIENCE, || {
        ledger(&pg, "lock:c:7").iter().any(|r| r.1 == "complete")
    });
    wait_until("no lock listed after completion", PATIENCE, || {
        locks(&redis, Some(&pg)).is_empty()
    });
    w.stop(PATIENCE);
}

/// The ledger through `playguard cycles`: complete, lock_lost and uncertain rows with their
/// phases and errors, newest first; `--key` filters and `--limit` limits. Without a database
/// URL only the running cycles are known (from Redis), and the output says so.
#[test]
fn cycles_lists_the_ledger_with_outcomes_key_filter_and_limit() {
    let redis = RedisServer::start();
    let pg = PostgresServer::start();
    let p = project();
    let db = pg.url();
    let env = [("DATABASE_URL", db.as_str())];

    // complete: Marquee 1.
    p.go("1");
    let mut a = worker(&redis, &pg, &p);
    enqueue(&redis, &["MarqueeCycle", "1"]);
    wait_until("Marquee 1 complete", PATIENCE, || {
        let r = ledger(&pg, "lock:c:1");
        r.len() == 1 && r[0].1 == "complete"
    });

    // lock_lost: Marquee 2's fence bumped in PostgreSQL while its slow phase runs.
    enqueue(&redis, &["MarqueeCycle", "2"]);
    started(&p, "2");
    pg.psql("UPDATE playguard_fences SET fence = fence + 1 WHERE lock_key = 'lock:c:2'");
    p.go("2");
    wait_until("Marquee 2 lock_lost", PATIENCE, || {
        ledger(&pg, "lock:c:2").iter().any(|r| r.1 == "lock_lost")
    });

    // uncertain: worker A SIGKILLed inside Marquee 3's slow phase; worker B runs the recovered
    // job, and its acquisition marks A's row uncertain.
    enqueue(&redis, &["MarqueeCycle", "3"]);
    started(&p, "3");
    let jid3 = pg.psql("SELECT jid FROM playguard_cycles WHERE lock_key = 'lock:c:3'");
    a.kill9();
    p.go("3");
    let mut b = worker(&redis, &pg, &p);
    wait_until("Marquee 3: uncertain, then complete", PATIENCE, || {
        let r: Vec<String> = ledger(&pg, "lock:c:3").into_iter().map(|r| r.1).collect();
        r == ["uncertain", "complete"]
    });

    let all = json_of(&["cycles", "--json"], &env);
    let (_, table, _) = playguard(&["cycles"], &env);
    eprintln!("playguard cycles:\n{table}");
    assert_eq!(all.len(), 4, "{all:#?}");
    // Newest first: ids descend.
    let ids: Vec<i64> = all.iter().map(|c| c["id"].as_i64().unwrap()).collect();
    assert!(ids.windows(2).all(|w| w[0] > w[1]), "{ids:?}");
    let by = |key: &str, outcome: &str| -> Value {
        all.iter()
            .find(|c| c["lock_key"] == key && c["outcome"] == outcome)
            .unwrap_or_else(|| panic!("no {outcome} row for {key}: {all:#?}"))
            .clone()
    };
    let done = by("lock:c:1", "complete");
    assert_eq!(done["phase"], "publish", "{done}");
    assert!(
        done["error"].is_null() && done["finished_at"].is_string(),
        "{done}"
    );
    assert_eq!(done["source"], "postgresql");
    assert!(done["took_ms"].as_i64().unwrap() >= 0);
    let lost = by("lock:c:2", "lock_lost");
    assert_eq!(lost["phase"], "apply", "{lost}");
    assert!(
        lost["error"]
            .as_str()
            .unwrap()
            .contains("playguard_fences holds fence"),
        "{lost}"
    );
    let unsure = by("lock:c:3", "uncertain");
    assert_eq!(unsure["jid"], jid3.as_str(), "{unsure}");
    assert!(
        unsure["error"]
            .as_str()
            .unwrap()
            .contains("no outcome recorded"),
        "{unsure}"
    );
    assert!(unsure["finished_at"].is_null(), "{unsure}");
    assert!(
        unsure["took_ms"].is_null(),
        "how long it ran is unknown: {unsure}"
    );
    let fence3: i64 = pg
        .psql(&format!(
            "SELECT fence FROM playguard_cycles WHERE jid = '{jid3}' AND outcome = 'uncertain'"
        ))
        .parse()
        .unwrap();
    assert_eq!(unsure["fence"], fence3);

    // --key filters, --limit limits (newest first).
    let three = json_of(&["cycles", "--json", "--key", "lock:c:3"], &env);
    let outcomes: Vec<&str> = three
        .iter()
        .map(|c| c["outcome"].as_str().unwrap())
        .collect();
    assert_eq!(outcomes, ["complete", "uncertain"], "{three:#?}");
    let newest = json_of(&["cycles", "--json", "--limit", "2"], &env);
    assert_eq!(newest.len(), 2);
    assert_eq!(newest[0]["id"], all[0]["id"]);
    assert_eq!(newest[1]["id"], all[1]["id"]);
    let one = json_of(
        &["cycles", "--json", "--key", "lock:c:3", "--limit", "1"],
        &env,
    );
    assert_eq!(one.len(), 1);
    assert_eq!(one[0]["outcome"], "complete");
    assert!(json_of(&["cycles", "--json", "--key", "lock:none"], &env).is_empty());

    // The table.
    let (code, out, err) = playguard(&["cycles", "--key", "lock:c:2"], &env);
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "{out}");
    assert!(
        lines[0].starts_with("ID ") && lines[0].contains("OUTCOME"),
        "{out}"
    );
    for needle in [
        "lock:c:2",
        "lock_lost",
        "apply",
        "playguard_fences holds fence",
    ] {
        assert!(lines[1].contains(needle), "row lacks {needle:?}:\n{out}");
    }
    let (code, _, err) = playguard(&["cycles", "--limit", "0"], &env);
    assert_eq!(code, 2, "--limit 0 is refused: {err}");

    // No database URL: only what Redis knows, a running cycle, and a note saying so.
    std::fs::remove_file(p.path().join("1.go")).unwrap();
    std::fs::remove_file(p.path().join("1.started")).unwrap();
    let jid = enqueue(&redis, &["MarqueeCycle", "1"]);
    started(&p, "1");
    let url = redis.url();
    let (code, out, err) = playguard(&["cycles", "-r", &url, "--json"], &[]);
    assert_eq!(code, 0, "{err}");
    let running: Vec<Value> = serde_json::from_str(&out).unwrap();
    assert_eq!(running.len(), 1, "{out}");
    assert_eq!(running[0]["jid"], jid.as_str());
    assert_eq!(running[0]["lock_key"], "lock:c:1");
    assert_eq!(running[0]["outcome"], "running");
    assert_eq!(running[0]["source"], "redis");
    assert!(running[0]["id"].is_null());
    assert!(err.contains("no database URL"), "{err}");
    let (code, out, _) = playguard(&["cycles", "-r", &url], &[]);
    assert_eq!(code, 0);
    assert!(out.contains("lock:c:1") && out.contains("running"), "{out}");
    assert!(out.contains("note: no database URL"), "{out}");
    // With the database, the same running cycle is in the ledger too.
    let now = json_of(&["cycles", "--json", "--limit", "1"], &env);
    assert_eq!(
        (now[0]["jid"].as_str(), now[0]["outcome"].as_str()),
        (Some(jid.as_str()), Some("running"))
    );
    p.go("1");
    wait_until("the last cycle completed", PATIENCE, || {
        json_of(&["cycles", "--json", "--limit", "1"], &env)[0]["outcome"] == "complete"
    });
    b.stop(PATIENCE);
}

/// Unreachable servers: exit 1 with one line naming the URL, its password hidden.
#[test]
fn unreachable_servers_are_one_line_without_the_password() {
    let port = free_port();
    let redis_url = format!("redis://:hunter2@127.0.0.1:{port}/0");
    let (code, out, err) = playguard(&["locks", "-r", &redis_url], &[]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains(&format!("redis://:***@127.0.0.1:{port}/0")),
        "{err}"
    );
    assert!(
        !err.contains("hunter2") && !out.contains("hunter2"),
        "{err}"
    );

    let db_url = format!("postgres://app:s3cret@127.0.0.1:{port}/app?sslmode=disable");
    let (code, out, err) = playguard(&["cycles", "--database-url", &db_url], &[]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains("cannot read playguard_cycles at postgres://app:***@"),
        "{err}"
    );
    assert!(!err.contains("s3cret") && !out.contains("s3cret"), "{err}");
    let (code, _, err) = playguard(&["cycles", "--database-url", "postgres://u:pw@h:x/d"], &[]);
    assert_eq!(code, 2, "{err}");
    assert!(!err.contains("pw@"), "{err}");
}

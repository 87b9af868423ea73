//! `playguard locks`: every token lock a worker holds now, with its holder, phase, time held,
//! lease left and fence. Read only. Redis keys: `processes` and the fields of
//! `playguard:fetchers` (the identities to look at), `playguard:locks:<identity>` (the holder
//! records `lua/lock_acquire.lua` writes at acquisition: field = lock key), `<identity>`
//! (field `info`: the holder's hostname), `<identity>:work` (the running phase, as of the last
//! heartbeat), and each recorded lock key (GET: does it still hold the recorded token; PTTL:
//! the lease left). With a database URL, the table `playguard_cycles` (the fence of the running
//! cycle: for `fence = "database"` locks it is PostgreSQL's, not the Redis record's).
//!
//! A record whose lock key no longer holds its token (the lease ran out, or another worker
//! took the key) is listed with state `stale` and no lease left: its holder has not released
//! it yet, or died and the orphan sweep has not come by. Locks taken with `--fetch basic` or
//! through the library API without a holder record are not recorded, so not listed.

use crate::connections::db::Db;
use crate::connections::redis_conn::Conn;
use crate::worker::error::{open_redis, parse_database, report, StartError};
use redis::Value;
use serde::Serialize;
use std::collections::HashMap;
use tokio_postgres::types::Type;

/// One recorded lock, as `--json` prints it.
#[derive(Debug, Clone, Serialize)]
pub struct Lock {
    /// The lock key, as the job's manifest rendered it.
    pub key: String,
    /// The manifest's label for the locked thing (a Marquee's name), when it gives one.
    pub label: Option<String>,
    /// The holder's Sidekiq identity (`hostname:pid:nonce`).
    pub identity: String,
    /// The holder's host, from its identity.
    pub host: String,
    /// The holding job's jid and class, as the Busy page shows them.
    pub jid: String,
    pub class: String,
    /// The phase running at the holder's last heartbeat (`null` between phases).
    pub phase: Option<String>,
    /// When the lock was taken (RFC 3339, UTC; the holder's clock).
    pub acquired_at: Option<String>,
    pub held_ms: Option<i64>,
    /// PTTL of the lock key; `null` when stale.
    pub left_ms: Option<i64>,
    pub ttl_ms: Option<i64>,
    pub fence: Option<i64>,
    /// `ledger`: the running cycle's row in `playguard_cycles` (the fence the cycle uses);
    /// `redis`: the holder record (the acquire script's fence).
    pub fence_from: &'static str,
    /// The running cycle's `playguard_cycles.id`, with a database.
    pub cycle_id: Option<i64>,
    /// `held` (the key holds the recorded token) or `stale`.
    pub state: &'static str,
    /// Unix ms, for `cycles` without a database; not printed.
    #[serde(skip)]
    pub acquired_ms: Option<i64>,
}

/// The locks found, sorted by key, and lines the operator should read (a database that did
/// not answer, say).
pub struct Found {
    pub locks: Vec<Lock>,
    pub notes: Vec<String>,
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn pairs(v: &Value) -> Vec<(Vec<u8>, Vec<u8>)> {
    redis::from_redis_value_ref(v).unwrap_or_default()
}

/// The hostname in `info`, else the identity's `hostname:pid:nonce` head.
fn host_of(identity: &str, info: Option<&[u8]>) -> String {
    info.and_then(|i| serde_json::from_slice::<serde_json::Value>(i).ok())
        .and_then(|i| {
            i.get("hostname")
                .and_then(|h| h.as_str())
                .map(str::to_string)
        })
        .unwrap_or_else(|| {
            identity
                .rsplitn(3, ':')
                .nth(2)
                .unwrap_or(identity)
                .to_string()
        })
}

/// jid → phase of the work entries (`{"payload": "<job JSON>", "phase": ...}`).
fn phases(work: &[(Vec<u8>, Vec<u8>)]) -> HashMap<String, Option<String>> {
    let mut out = HashMap::new();
    for (_tid, entry) in work {
        let Ok(e) = serde_json::from_slice::<serde_json::Value>(entry) else {
            continue;
        };
        let jid = e
            .get("payload")
            .and_then(|p| p.as_str())
            .and_then(|p| serde_json::from_str::<serde_json::Value>(p).ok())
            .and_then(|p| p.get("jid").and_then(|j| j.as_str()).map(str::to_string));
        if let Some(jid) = jid {
            let phase = e.get("phase").and_then(|p| p.as_str()).map(str::to_string);
            out.insert(jid, phase);
        }
    }
    out
}

/// Every lock recorded in `playguard:locks:<identity>` of every known identity, with the
/// ledger's fence when `db` is given (a database that does not answer becomes a note).
pub async fn collect(conn: &mut Conn, db: Option<&Db>) -> redis::RedisResult<Found> {
    let identities = known_identities(conn).await?;
    let recs = lock_records(conn, &identities).await?;
    let state = key_states(conn, recs.iter().map(|(_, _, key, _, _)| key)).await?;
    let now = super::now_ms();
    let mut locks: Vec<Lock> = recs
        .into_iter()
        .zip(state.chunks(2))
        .map(|(rec, st)| lock_of(rec, st, now))
        .collect();
    locks.sort_by(|a, b| a.key.cmp(&b.key).then(a.identity.cmp(&b.identity)));
    let notes = fence_notes(db, &mut locks).await;
    Ok(Found { locks, notes })
}

/// The identities in `processes` and `playguard:fetchers`, sorted, each once.
async fn known_identities(conn: &mut Conn) -> redis::RedisResult<Vec<String>> {
    let (procs, fetchers): (Vec<String>, Vec<String>) = redis::pipe()
        .smembers("processes")
        .hkeys(crate::process::liveness::FETCHERS_KEY)
        .query_async(conn)
        .await?;
    let mut identities = procs;
    identities.extend(fetchers);
    identities.sort();
    identities.dedup();
    Ok(identities)
}

/// (identity, host, lock key bytes, record, phase) of every holder record of `identities`,
/// read with each identity's `info` and work hash in one pipeline.
async fn lock_records(
    conn: &mut Conn,
    identities: &[String],
) -> redis::RedisResult<Vec<(String, String, Vec<u8>, serde_json::Value, Option<String>)>> {
    let mut pipe = redis::pipe();
    for id in identities {
        pipe.hgetall(crate::cycle::lock::locks_record_key(id))
            .hget(id, "info")
            .hgetall(format!("{id}:work"));
    }
    let replies: Vec<Value> = pipe.query_async(conn).await?;

    let mut recs = Vec::new();
    for (id, r) in identities.iter().zip(replies.chunks(3)) {
        let records = pairs(&r[0]);
        if records.is_empty() {
            continue;
        }
        let info: Option<Vec<u8>> = redis::from_redis_value_ref(&r[1]).unwrap_or(None);
        let host = host_of(id, info.as_deref());
        let running = phases(&pairs(&r[2]));
        for (key, json) in records {
            let rec: serde_json::Value = serde_json::from_slice(&json).unwrap_or_default();
            let jid = rec["jid"].as_str().unwrap_or_default().to_string();
            let phase = running.get(&jid).cloned().flatten();
            recs.push((id.clone(), host.clone(), key, rec, phase));
        }
    }
    Ok(recs)
}

/// GET and PTTL of each lock key, in one pipeline (none sent when there are no keys).
async fn key_states<'k>(
    conn: &mut Conn,
    keys: impl Iterator<Item = &'k Vec<u8>>,
) -> redis::RedisResult<Vec<Value>> {
    let mut pipe = redis::pipe();
    for key in keys {
        pipe.get(key).pttl(key);
    }
    Ok(if pipe.is_empty() {
        Vec::new()
    } else {
        pipe.query_async(conn).await?
    })
}

/// One record as a `Lock`, given its key's GET and PTTL replies (`st`): held when the key
/// still holds the recorded token.
fn lock_of(
    (identity, host, key, rec, phase): (String, String, Vec<u8>, serde_json::Value, Option<String>),
    st: &[Value],
    now: i64,
) -> Lock {
    let current: Option<Vec<u8>> = redis::from_redis_value_ref(&st[0]).unwrap_or(None);
    let token = rec["token"].as_str().unwrap_or_default();
    let held = !token.is_empty() && current.as_deref() == Some(token.as_bytes());
    let pttl: i64 = redis::from_redis_value_ref(&st[1]).unwrap_or(-2);
    let acquired = rec["acquired_at"].as_i64();
    Lock {
        key: text(&key),
        label: rec["label"].as_str().map(str::to_string),
        identity,
        host,
        jid: rec["jid"].as_str().unwrap_or_default().to_string(),
        class: rec["class"].as_str().unwrap_or_default().to_string(),
        phase,
        acquired_at: acquired.map(super::rfc3339),
        held_ms: acquired.map(|a| (now - a).max(0)),
        left_ms: (held && pttl >= 0).then_some(pttl),
        ttl_ms: rec["ttl_ms"].as_i64(),
        fence: rec["fence"].as_i64(),
        fence_from: "redis",
        cycle_id: None,
        state: if held { "held" } else { "stale" },
        acquired_ms: acquired,
    }
}

/// With a database and some locks, their fences from the ledger; the note to print when it
/// could not be read.
async fn fence_notes(db: Option<&Db>, locks: &mut [Lock]) -> Vec<String> {
    let mut notes = Vec::new();
    if let (Some(db), false) = (db, locks.is_empty()) {
        if let Err(e) = ledger_fences(db, locks).await {
            notes.push(format!(
                "could not read the fences from playguard_cycles at {} ({e}): the fences shown are the Redis acquire script's; a fence = \"database\" lock uses playguard_fences'",
                db.shown_url()
            ));
        }
    }
    notes
}

/// Replace each lock's fence by its running cycle's ledger fence (the one the cycle uses).
async fn ledger_fences(db: &Db, locks: &mut [Lock]) -> Result<(), crate::connections::db::DbError> {
    let keys: Vec<&str> = locks.iter().map(|l| l.key.as_str()).collect();
    let rows = db
        .query(
            "SELECT lock_key, jid, fence, id FROM playguard_cycles
              WHERE outcome = 'running' AND lock_key = ANY($1) ORDER BY id",
            &[(&keys, Type::TEXT_ARRAY)],
        )
        .await?;
    // The newest running row of a (key, jid) wins.
    let mut by: HashMap<(String, String), (i64, i64)> = HashMap::new();
    for r in rows {
        by.insert((r.get(0), r.get(1)), (r.get(2), r.get(3)));
    }
    for l in locks.iter_mut() {
        if let Some((fence, id)) = by.get(&(l.key.clone(), l.jid.clone())) {
            l.fence = Some(*fence);
            l.cycle_id = Some(*id);
            l.fence_from = "ledger";
        }
    }
    Ok(())
}

/// The aligned table of `playguard locks`.
pub fn render(locks: &[Lock]) -> String {
    let header = &[
        "KEY", "LABEL", "HOLDER", "HOST", "JID", "PHASE", "HELD", "LEFT", "FENCE", "STATE",
    ];
    super::render_rows(locks, "no locks held", header, |l| {
        vec![
            l.key.clone(),
            super::cell(l.label.as_deref()),
            l.identity.clone(),
            l.host.clone(),
            l.jid.clone(),
            super::cell(l.phase.as_deref()),
            super::duration(l.held_ms),
            super::duration(l.left_ms),
            l.fence.map(|f| f.to_string()).unwrap_or_else(|| "-".into()),
            l.state.to_string(),
        ]
    })
}

/// Open Redis (and the database when a URL is given) for an operator command, through the
/// one opener every subcommand uses.
pub async fn connect(
    redis_url: &str,
    database_url: Option<&str>,
    who: &str,
) -> Result<(Conn, Option<Db>), StartError> {
    let db = match database_url {
        Some(u) => Some(parse_database(u, who)?),
        None => None,
    };
    let (_, conn) = open_redis(redis_url, std::time::Duration::ZERO).await?;
    Ok((conn, db))
}

/// `collect`, or the one line an operator reads when Redis cannot be read (exit code 1).
pub async fn collect_or_report(
    conn: &mut crate::connections::redis_conn::Conn,
    db: Option<&crate::connections::db::Db>,
    redis_url: &str,
) -> Result<Found, i32> {
    collect(conn, db).await.map_err(|e| {
        eprintln!(
            "playguard: cannot read the locks from Redis at {}: {e}",
            crate::connections::redact::url(redis_url)
        );
        1
    })
}

/// `playguard locks [--json]`: exit 0, or 1 when Redis cannot be read, 2 for a bad URL.
pub async fn command(redis_url: &str, database_url: Option<&str>, json: bool) -> i32 {
    let (mut conn, db) = match connect(redis_url, database_url, "playguard-locks").await {
        Ok(c) => c,
        Err(e) => return report(&e),
    };
    let found = match collect_or_report(&mut conn, db.as_ref(), redis_url).await {
        Ok(f) => f,
        Err(code) => return code,
    };
    let notes: Vec<&str> = found.notes.iter().map(String::as_str).collect();
    super::print(&found.locks, || render(&found.locks), &notes, json);
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_from_info_or_identity() {
        assert_eq!(
            host_of("web-1:42:abcdef", Some(br#"{"hostname":"dyno.1"}"#)),
            "dyno.1"
        );
        assert_eq!(host_of("web-1:42:abcdef", None), "web-1");
        assert_eq!(host_of("odd", Some(b"not json")), "odd");
    }

    #[test]
    fn phases_by_jid() {
        let work = vec![
            (
                b"2s0".to_vec(),
                br#"{"queue":"q","payload":"{\"jid\":\"j1\"}","phase":"apply"}"#.to_vec(),
            ),
            (
                b"2s1".to_vec(),
                br#"{"queue":"q","payload":"{\"jid\":\"j2\"}"}"#.to_vec(),
            ),
            (b"2s2".to_vec(), b"garbage".to_vec()),
        ];
        let p = phases(&work);
        assert_eq!(p["j1"].as_deref(), Some("apply"));
        assert_eq!(p["j2"], None);
        assert_eq!(p.len(), 2);
    }
}

//! `playguard cycles [--key K] [--limit N]`: the most recent cycles, newest first. Read only.
//! With a database URL, from the ledger table `playguard_cycles` (every cycle that acquired
//! its lock, with its outcome). Without one, Redis keeps no history: only the cycles running
//! now are known, from the holder records `playguard locks` reads (`processes`,
//! `playguard:fetchers`, `playguard:locks:<identity>`, `<identity>`, `<identity>:work` and the
//! lock keys; see `locks.rs`), and the output says so.

use crate::connections::db::Db;
use crate::worker::error::{parse_database, report};
use serde::Serialize;
use tokio_postgres::types::Type;

/// One cycle, as `--json` prints it.
#[derive(Debug, Clone, Serialize)]
pub struct Cycle {
    /// `playguard_cycles.id`; `null` for a cycle known only from Redis.
    pub id: Option<i64>,
    pub lock_key: String,
    pub jid: String,
    pub fence: Option<i64>,
    pub identity: String,
    /// RFC 3339, UTC.
    pub started_at: Option<String>,
    pub finished_at: Option<String>,
    /// running, complete, failed, lock_lost, interrupted, cancelled or uncertain.
    pub outcome: String,
    /// The phase it ended in (or, running, the phase it is in).
    pub phase: Option<String>,
    pub error: Option<String>,
    /// finished_at − started_at, or the time so far for a running cycle.
    pub took_ms: Option<i64>,
    /// `postgresql` (the ledger) or `redis` (a held lock, no ledger).
    pub source: &'static str,
}

/// What is said when there is no ledger to read.
pub const NO_DATABASE: &str = "no database URL (DATABASE_URL or --database-url): Redis keeps no cycle history, so only the cycles running now are listed (from the held locks); the ledger playguard_cycles needs the database";

const COLUMNS: &str = "id, lock_key, jid, fence, identity,
       (extract(epoch FROM started_at) * 1000)::bigint,
       (extract(epoch FROM finished_at) * 1000)::bigint,
       outcome, phase, error";

/// The newest `limit` ledger rows (of `key` only, when given).
pub async fn from_ledger(
    db: &Db,
    key: Option<&str>,
    limit: i64,
) -> Result<Vec<Cycle>, crate::connections::db::DbError> {
    let rows = match key {
        Some(k) => {
            db.query(
                &format!(
                    "SELECT {COLUMNS} FROM playguard_cycles WHERE lock_key = $1
                      ORDER BY started_at DESC, id DESC LIMIT $2"
                ),
                &[(&k, Type::TEXT), (&limit, Type::INT8)],
            )
            .await?
        }
        None => {
            db.query(
                &format!(
                    "SELECT {COLUMNS} FROM playguard_cycles
                      ORDER BY started_at DESC, id DESC LIMIT $1"
                ),
                &[(&limit, Type::INT8)],
            )
            .await?
        }
    };
    let now = super::now_ms();
    Ok(rows
        .iter()
        .map(|r| {
            let started: i64 = r.get(5);
            let finished: Option<i64> = r.get(6);
            let outcome: String = r.get(7);
            // A row marked uncertain has no end time: how long it ran is not known.
            let took_ms = match finished {
                Some(f) => Some(f - started),
                None if outcome == "running" => Some(now - started),
                None => None,
            };
            Cycle {
                id: Some(r.get(0)),
                lock_key: r.get(1),
                jid: r.get(2),
                fence: Some(r.get(3)),
                identity: r.get(4),
                started_at: Some(super::rfc3339(started)),
                finished_at: finished.map(super::rfc3339),
                outcome,
                phase: r.get(8),
                error: r.get(9),
                took_ms,
                source: "postgresql",
            }
        })
        .collect())
}

/// Without a ledger: the held locks as running cycles, newest first.
pub fn from_locks(locks: Vec<super::locks::Lock>, key: Option<&str>, limit: usize) -> Vec<Cycle> {
    let mut held: Vec<super::locks::Lock> = locks
        .into_iter()
        .filter(|l| l.state == "held" && key.is_none_or(|k| l.key == k))
        .collect();
    held.sort_by_key(|l| std::cmp::Reverse(l.acquired_ms));
    held.truncate(limit);
    held.into_iter()
        .map(|l| Cycle {
            id: None,
            lock_key: l.key,
            jid: l.jid,
            fence: l.fence,
            identity: l.identity,
            started_at: l.acquired_at,
            finished_at: None,
            outcome: "running".into(),
            phase: l.phase,
            error: None,
            took_ms: l.held_ms,
            source: "redis",
        })
        .collect()
}

/// The aligned table of `playguard cycles`.
pub fn render(cycles: &[Cycle]) -> String {
    let header = &[
        "ID",
        "KEY",
        "OUTCOME",
        "PHASE",
        "FENCE",
        "JID",
        "HOLDER",
        "STARTED (UTC)",
        "TOOK",
        "ERROR",
    ];
    super::render_rows(cycles, "no cycles", header, |c| {
        vec![
            c.id.map(|i| i.to_string()).unwrap_or_else(|| "-".into()),
            c.lock_key.clone(),
            c.outcome.clone(),
            super::cell(c.phase.as_deref()),
            c.fence.map(|f| f.to_string()).unwrap_or_else(|| "-".into()),
            c.jid.clone(),
            c.identity.clone(),
            c.started_at
                .as_deref()
                .and_then(|s| chrono::DateTime::parse_from_rfc3339(s).ok())
                .map(|t| super::clock(t.timestamp_millis()))
                .unwrap_or_else(|| "-".into()),
            super::duration(c.took_ms),
            super::clip(c.error.as_deref().unwrap_or("-"), 70),
        ]
    })
}

/// `playguard cycles`: exit 0, 1 when the source cannot be read, 2 for a bad URL.
pub async fn command(
    redis_url: &str,
    database_url: Option<&str>,
    key: Option<&str>,
    limit: u32,
    json: bool,
) -> i32 {
    let (cycles, note) = match database_url {
        Some(url) => {
            let db = match parse_database(url, "playguard-cycles") {
                Ok(d) => d,
                Err(e) => return report(&e),
            };
            match from_ledger(&db, key, limit.into()).await {
                Ok(c) => (c, None),
                Err(e) => {
                    eprintln!(
                        "playguard: cannot read playguard_cycles at {}: {e} (`playguard run` with this URL creates the table; `playguard db schema` prints it)",
                        db.shown_url()
                    );
                    return 1;
                }
            }
        }
        None => {
            let (mut conn, _) =
                match super::locks::connect(redis_url, None, "playguard-cycles").await {
                    Ok(c) => c,
                    Err(e) => return report(&e),
                };
            match super::locks::collect_or_report(&mut conn, None, redis_url).await {
                Ok(f) => (from_locks(f.locks, key, limit as usize), Some(NO_DATABASE)),
                Err(code) => return code,
            }
        }
    };
    let notes: Vec<&str> = note.into_iter().collect();
    super::print(&cycles, || render(&cycles), &notes, json);
    0
}

//! A cycle's progress where Sidekiq 8.1's Busy and Retries pages read it: the hash `it-<jid>`
//! that its iterable jobs keep (lib/sidekiq/job/iterable.rb, `flush_state`), with `ex` (how
//! many times the job has run, this run included), `c` (the cursor, JSON: the phase running)
//! and `rt` (seconds run, over all runs), kept 30 days from the first write (`STATE_TTL`).
//! 8.1's api.rb (`IterableJobQuery`) reads them with HGETALL for each busy or retrying jid.
//! Keys: `it-<jid>` (`lua/iteration_flush.lua`; its `cancelled` field is `job/cancel.rs`'s).
//!
//! As Sidekiq: read at the start (the runs and runtime so far), written at each phase
//! boundary and when a run fails or is handed back, removed when the job is done. A cancelled
//! run removes the progress fields but leaves `cancelled` to expire, so a copy of the same
//! jid (a recovered duplicate) is stopped too.

use crate::connections::redis_conn::Conn;
use crate::job::cancel::{key, FIELD};
use std::collections::HashMap;
use tokio::time::Instant;

/// Sidekiq's `Iterable::STATE_TTL`: one month, in seconds.
pub const STATE_TTL: u64 = 30 * 24 * 60 * 60;

static FLUSH: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("../../lua/iteration_flush.lua")));

/// One run's progress record.
pub struct Progress {
    conn: Conn,
    key: String,
    /// `ex`: the earlier runs' count plus this one.
    executions: i64,
    /// `rt` of the earlier runs.
    prior_runtime: f64,
    started: Instant,
    /// The cursor as JSON: the phase last written (or found), for the write at a failure.
    cursor: Option<String>,
    /// Whether `it-<jid>` holds progress fields (found at the start, or written since).
    touched: bool,
}

/// How a run's record ends.
pub enum End {
    /// Done (complete, skipped, lock lost): the key is removed, as Sidekiq's `cleanup`.
    Done,
    /// Cancelled: the progress fields go, `cancelled` stays until its TTL.
    Cancelled,
    /// Failed or handed back: written once more, for the Retries page and the next run.
    Kept,
}

impl Progress {
    /// Read `it-<jid>` (one HGETALL): the record of this run and, if set, the cancel flag.
    /// A Redis error starts a fresh record (it only feeds the Web UI).
    pub async fn start(conn: &Conn, jid: &str) -> (Progress, Option<String>) {
        let key = key(jid);
        let mut c = conn.clone();
        let state: HashMap<String, String> = redis::cmd("HGETALL")
            .arg(&key)
            .query_async(&mut c)
            .await
            .unwrap_or_else(|e| {
                tracing::warn!(error = %e, "could not read the job's iteration state; starting a fresh one");
                HashMap::new()
            });
        let field = |f: &str| state.get(f).map(String::as_str);
        let progress = Progress {
            conn: conn.clone(),
            key,
            // Ruby's to_i / to_f: what does not parse counts as 0.
            executions: field("ex").and_then(|v| v.parse().ok()).unwrap_or(0) + 1,
            prior_runtime: field("rt").and_then(|v| v.parse().ok()).unwrap_or(0.0),
            started: Instant::now(),
            cursor: field("c").map(str::to_string),
            touched: ["ex", "c", "rt"].iter().any(|f| state.contains_key(*f)),
        };
        (progress, state.get(FIELD).cloned())
    }

    /// Write the record with `phase` as the cursor (one EVALSHA); the reply is the cancel
    /// flag, read in the same step: whether the job is cancelled now.
    pub async fn flush(&mut self, phase: &str) -> bool {
        let cursor = serde_json::to_string(phase).unwrap_or_default();
        self.cursor = Some(cursor);
        self.write().await.is_some()
    }

    async fn write(&mut self) -> Option<String> {
        let runtime = self.prior_runtime + self.started.elapsed().as_secs_f64();
        let mut c = self.conn.clone();
        let reply: redis::RedisResult<Option<String>> = FLUSH
            .key(&self.key)
            .arg(self.executions)
            .arg(self.cursor.as_deref().unwrap_or("null"))
            .arg(runtime)
            .arg(STATE_TTL)
            .invoke_async(&mut c)
            .await;
        self.touched = true;
        reply.unwrap_or_else(|e| {
            tracing::warn!(error = %e, key = %self.key, "could not write the cycle's progress");
            None
        })
    }

    /// The record's end (nothing to do when it was never written nor found).
    pub async fn end(mut self, how: End) {
        if !self.touched {
            return;
        }
        let mut c = self.conn.clone();
        let done: redis::RedisResult<()> = match how {
            End::Kept => {
                self.write().await;
                return;
            }
            End::Done => {
                redis::cmd("UNLINK")
                    .arg(&self.key)
                    .query_async(&mut c)
                    .await
            }
            End::Cancelled => {
                redis::cmd("HDEL")
                    .arg(&self.key)
                    .arg(&["ex", "c", "rt"][..])
                    .query_async(&mut c)
                    .await
            }
        };
        if let Err(e) = done {
            tracing::warn!(error = %e, key = %self.key, "could not clear the cycle's progress; it expires by its ttl");
        }
    }
}

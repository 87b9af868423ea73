//! The application's PostgreSQL (`DATABASE_URL` / `--database-url`): a few connections kept
//! open and reopened when they break, every statement bounded on the server
//! (`statement_timeout`) and on the client (a deadline), and the schema of playguard's tables
//! `playguard_fences` and `playguard_cycles`. Touches no Redis keys.
//!
//! Each statement playguard sends is a single statement (no open transaction spans two
//! calls), so one connection can carry the statements of several cycles at once; the pool
//! only spreads them over a few server backends.
//!
//! TLS (`sslmode`, `sslrootcert`) as libpq understands it is set up by `db_tls.rs`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio_postgres::config::{Host, SslMode};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, NoTls, Row};
use tokio_postgres_rustls::MakeRustlsConnect;

/// Server-side limit of every statement, set on each connection.
pub const STATEMENT_TIMEOUT: Duration = Duration::from_secs(5);
/// Client-side limit of a call (connecting included): a paused or unreachable server must end
/// a renewal as "lock lost", not hang it.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// How long connecting may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// Connections kept open.
pub const POOL_SIZE: usize = 3;

/// The tables, created by `run` when missing and printed by `playguard db schema`.
pub const SCHEMA: &str = "\
CREATE TABLE IF NOT EXISTS playguard_fences (
    lock_key    text PRIMARY KEY,
    fence       bigint NOT NULL,
    identity    text,
    jid         text,
    acquired_at timestamptz
);

CREATE TABLE IF NOT EXISTS playguard_cycles (
    id          bigserial PRIMARY KEY,
    lock_key    text NOT NULL,
    jid         text NOT NULL,
    fence       bigint NOT NULL,
    identity    text NOT NULL,
    started_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz,
    outcome     text NOT NULL DEFAULT 'running'
                CONSTRAINT playguard_cycles_outcome_check
                CHECK (outcome IN ('running', 'complete', 'failed', 'lock_lost', 'interrupted', 'cancelled', 'uncertain')),
    phase       text,
    error       text
);

-- Tables made before outcome 'cancelled' existed get it added to their check.
DO $$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_constraint
                    WHERE conname = 'playguard_cycles_outcome_check'
                      AND pg_get_constraintdef(oid) LIKE '%cancelled%') THEN
        ALTER TABLE playguard_cycles DROP CONSTRAINT IF EXISTS playguard_cycles_outcome_check;
        ALTER TABLE playguard_cycles ADD CONSTRAINT playguard_cycles_outcome_check
            CHECK (outcome IN ('running', 'complete', 'failed', 'lock_lost', 'interrupted', 'cancelled', 'uncertain'));
    END IF;
END $$;

CREATE INDEX IF NOT EXISTS playguard_cycles_running
    ON playguard_cycles (lock_key) WHERE outcome = 'running';
CREATE INDEX IF NOT EXISTS playguard_cycles_key_started
    ON playguard_cycles (lock_key, started_at DESC);
";

/// Any advisory-lock number would do; this one is "playguard" in ASCII, so two processes
/// starting at once do not race each other's CREATE TABLE.
const SCHEMA_LOCK: i64 = 0x706c_6179_6775_6172;

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("{}", pg_message(.0))]
    Pg(#[from] tokio_postgres::Error),
    #[error("no answer from PostgreSQL within {0:?}")]
    Timeout(Duration),
    #[error("{0}")]
    Config(String),
}

/// A handle on the database; cheap to clone.
#[derive(Clone)]
pub struct Db {
    inner: Arc<Inner>,
}

struct Inner {
    config: tokio_postgres::Config,
    /// `None`: plain TCP (sslmode=disable, or a Unix socket).
    tls: Option<MakeRustlsConnect>,
    slots: Vec<tokio::sync::Mutex<Option<Arc<Client>>>>,
    next: AtomicUsize,
    shown: String,
    /// The worker identity recorded with each acquisition and cycle.
    holder: String,
}

impl std::fmt::Debug for Db {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Db")
            .field("url", &self.inner.shown)
            .finish()
    }
}

/// The server's own message for a statement error, else the client error with its cause
/// ("error connecting to server: Connection refused").
fn pg_message(e: &tokio_postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        return format!("{}: {}", db.severity(), db.message());
    }
    let text = match std::error::Error::source(e) {
        Some(cause) => format!("{e}: {cause}"),
        None => e.to_string(),
    };
    match crate::connections::db_tls::hint(e) {
        Some(hint) => format!("{text} ({hint})"),
        None => text,
    }
}

/// Carry a connection's traffic until it closes.
async fn drive<F>(connection: F)
where
    F: std::future::Future<Output = Result<(), tokio_postgres::Error>>,
{
    if let Err(e) = connection.await {
        tracing::debug!(error = %e, "PostgreSQL connection closed");
    }
}

impl Db {
    /// Parse `url` (a libpq URL or key=value string) without connecting. `holder` is this
    /// process's identity, written with every acquisition.
    pub fn new(url: &str, holder: &str) -> Result<Db, DbError> {
        let shown = crate::connections::redact::url(url);
        let bad = |e: String| DbError::Config(format!("database URL {shown}: {e}"));
        let env = |k: &str| std::env::var(k).ok();
        let (rest, tls) = crate::connections::db_tls::split_url(url, &env).map_err(bad)?;
        let mut config: tokio_postgres::Config = rest
            .parse()
            .map_err(|e| DbError::Config(format!("bad database URL {shown}: {e}")))?;
        // libpq uses no TLS on a Unix socket, whatever sslmode says; tokio-postgres would
        // ask the server for it and fail under require.
        let hosts = config.get_hosts();
        let unix_only = !hosts.is_empty() && hosts.iter().all(|h| matches!(h, Host::Unix(_)));
        let connector = if unix_only {
            config.ssl_mode(SslMode::Disable);
            None
        } else {
            config.ssl_mode(tls.mode.pg_mode());
            tls.connector().map_err(bad)?
        };
        // The user's own `options` are kept; ours are added after them.
        let options = format!(
            "{} -c statement_timeout={}",
            config.get_options().unwrap_or(""),
            STATEMENT_TIMEOUT.as_millis()
        );
        config.options(options.trim_start());
        if config.get_application_name().is_none() {
            config.application_name("playguard");
        }
        config.connect_timeout(CONNECT_TIMEOUT);
        config.keepalives_idle(Duration::from_secs(30));
        Ok(Db {
            inner: Arc::new(Inner {
                config,
                tls: connector,
                slots: (0..POOL_SIZE)
                    .map(|_| tokio::sync::Mutex::new(None))
                    .collect(),
                next: AtomicUsize::new(0),
                shown,
                holder: holder.to_string(),
            }),
        })
    }

    /// The URL with its password hidden, for log lines and messages.
    pub fn shown_url(&self) -> &str {
        &self.inner.shown
    }

    pub fn holder(&self) -> &str {
        &self.inner.holder
    }

    async fn connect(&self) -> Result<Arc<Client>, DbError> {
        let config = &self.inner.config;
        let client = match &self.inner.tls {
            None => {
                let (client, connection) = config.connect(NoTls).await?;
                tokio::spawn(drive(connection));
                client
            }
            Some(tls) => {
                let (client, connection) = config.connect(tls.clone()).await?;
                tokio::spawn(drive(connection));
                client
            }
        };
        Ok(Arc::new(client))
    }

    /// A connection from the pool, opened (again) when its slot is empty or closed.
    async fn client(&self) -> Result<(usize, Arc<Client>), DbError> {
        let i = self.inner.next.fetch_add(1, Ordering::Relaxed) % self.inner.slots.len();
        let mut slot = self.inner.slots[i].lock().await;
        if let Some(c) = slot.as_ref().filter(|c| !c.is_closed()) {
            return Ok((i, c.clone()));
        }
        *slot = None;
        let c = self.connect().await?;
        *slot = Some(c.clone());
        Ok((i, c))
    }

    /// Forget slot `i`'s connection after a failed call, so the next call reconnects.
    async fn discard(&self, i: usize, c: &Arc<Client>) {
        let mut slot = self.inner.slots[i].lock().await;
        if slot.as_ref().is_some_and(|s| Arc::ptr_eq(s, c)) {
            *slot = None;
        }
    }

    /// One statement with typed parameters (one round trip: no separate prepare), bounded by
    /// [`CALL_TIMEOUT`] including the connect.
    pub async fn query(
        &self,
        sql: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<Vec<Row>, DbError> {
        let call = async {
            let (i, c) = self.client().await?;
            match c.query_typed(sql, params).await {
                Ok(rows) => Ok(rows),
                Err(e) => {
                    // A statement error on a live connection leaves it usable; a broken one
                    // is replaced.
                    if c.is_closed() || e.as_db_error().is_none() {
                        self.discard(i, &c).await;
                    }
                    Err(DbError::Pg(e))
                }
            }
        };
        match tokio::time::timeout(CALL_TIMEOUT, call).await {
            Ok(r) => r,
            Err(_) => {
                // The server may be paused with our connections open: start afresh.
                for slot in &self.inner.slots {
                    if let Ok(mut s) = slot.try_lock() {
                        *s = None;
                    }
                }
                Err(DbError::Timeout(CALL_TIMEOUT))
            }
        }
    }

    /// Create the tables when missing. Idempotent; concurrent starts wait for each other.
    pub async fn ensure_schema(&self) -> Result<(), DbError> {
        let sql = format!("BEGIN;\nSELECT pg_advisory_xact_lock({SCHEMA_LOCK});\n{SCHEMA}COMMIT;");
        let call = async {
            // A connection of its own: a failed batch must not leave a pooled one mid-transaction.
            let c = self.connect().await?;
            c.batch_execute(&sql).await?;
            Ok(())
        };
        tokio::time::timeout(CALL_TIMEOUT, call)
            .await
            .unwrap_or(Err(DbError::Timeout(CALL_TIMEOUT)))
    }

    /// The server's version string (for `check` and the start line).
    pub async fn server_version(&self) -> Result<String, DbError> {
        let rows = self.query("SHOW server_version", &[]).await?;
        Ok(rows
            .first()
            .map(|r| r.get::<_, String>(0))
            .unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_modes_are_accepted_and_bad_urls_hide_the_password() {
        for mode in ["disable", "allow", "prefer", "require"] {
            let db = Db::new(&format!("postgres://u:pw@h/d?sslmode={mode}"), "id").unwrap();
            assert_eq!(db.inner.tls.is_none(), mode == "disable", "{mode}");
        }
        // libpq: nothing to verify against is an error, and it names no password.
        let e = Db::new("postgres://u:pw@h/d?sslmode=verify-full", "id").unwrap_err();
        assert!(e.to_string().contains("sslrootcert"), "{e}");
        assert!(!e.to_string().contains("pw"), "{e}");
        let e = Db::new("postgres://u:pw@h/d?sslmode=always", "id").unwrap_err();
        assert!(!e.to_string().contains("pw"), "{e}");
        let e = Db::new("postgres://u:pw@h:notaport/d", "id").unwrap_err();
        assert!(!e.to_string().contains("pw"), "{e}");
        // A Unix socket never uses TLS, as with libpq.
        let db = Db::new("postgres://u@%2Frun%2Fpostgresql/d?sslmode=require", "id").unwrap();
        assert!(db.inner.tls.is_none());
    }
}

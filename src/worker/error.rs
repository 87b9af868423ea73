//! Why a subcommand could not start or reach what it needs, and the one map from that to the
//! process exit code (docs/configuration.md: 2 for what only a change of configuration or of server fixes,
//! 1 for a server that may answer later). Every subcommand opens Redis with `open_redis` and
//! ends a failed start with `report`. Touches no Redis keys (a PING and, on a start, INFO).

use crate::connections::db::{Db, DbError};
use crate::connections::redis_conn::{Client, Conn};
use std::time::{Duration, Instant};

/// Why a subcommand could not start: `report` turns each into one stderr line and its exit code.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A bad flag, URL or manifest, no job class, a missing database URL.
    #[error("{0}")]
    Config(String),
    /// Redis did not answer, or dropped the connection while we asked it something.
    #[error("cannot reach Redis at {url}: {err}")]
    RedisUnreachable { url: String, err: redis::RedisError },
    /// Redis answers but is older than `redis_conn::MIN_SERVER`: retrying will not help.
    #[error("Redis {version} at {url} is too old: playguard needs {}.{} or newer",
        crate::connections::redis_conn::MIN_SERVER.0, crate::connections::redis_conn::MIN_SERVER.1)]
    RedisTooOld { url: String, version: String },
    #[error("cannot reach PostgreSQL at {url}: {err}")]
    Database { url: String, err: String },
}

impl StartError {
    /// What `check_server` found wrong with the Redis at `url` (shown redacted).
    pub fn from_server(url: &str, e: crate::connections::redis_conn::ServerError) -> StartError {
        use crate::connections::redis_conn::ServerError;
        match e {
            ServerError::Unreachable(err) => StartError::RedisUnreachable {
                url: url.to_string(),
                err,
            },
            ServerError::TooOld { version } => StartError::RedisTooOld {
                url: url.to_string(),
                version,
            },
        }
    }

    /// The process exit code: 2 for what only a change of configuration (or of server)
    /// fixes, 1 for a server that may answer later.
    pub fn exit_code(&self) -> i32 {
        match self {
            StartError::Config(_) | StartError::RedisTooOld { .. } => 2,
            StartError::RedisUnreachable { .. } | StartError::Database { .. } => 1,
        }
    }
}

/// The Redis server's version, or why it will not do (too old; the connection dropped while
/// asking). `url` is the redacted URL the error names.
pub async fn redis_version(conn: &mut Conn, url: &str) -> Result<String, StartError> {
    crate::connections::redis_conn::check_server(conn)
        .await
        .map_err(|e| StartError::from_server(url, e))
}

/// A database URL that does not parse is a configuration error, as a Redis URL is.
pub fn parse_database(url: &str, who: &str) -> Result<Db, StartError> {
    Db::new(url, who).map_err(|e| StartError::Config(e.to_string()))
}

/// PostgreSQL at `db` did not answer (or refused what we asked).
pub fn database_error(db: &Db, e: DbError) -> StartError {
    StartError::Database {
        url: db.shown_url().to_string(),
        err: e.to_string(),
    }
}

/// One line on stderr for a failed start, and the exit code it calls for.
pub fn report(e: &StartError) -> i32 {
    match e {
        StartError::Config(_) => eprintln!("playguard: configuration error: {e}"),
        _ => eprintln!("playguard: {e}"),
    }
    e.exit_code()
}

/// The one way a subcommand opens Redis: parse the URL (one that does not parse is a
/// configuration error, not an unreachable server), connect and PING. A Redis that answers
/// `LOADING` (restarted, reading its dataset back) is there and about to serve: a worker waits
/// up to `loading_wait` for it rather than exit as if it were unreachable, since under foreman
/// one process that exits stops the whole Procfile.
pub async fn open_redis(url: &str, loading_wait: Duration) -> Result<(Client, Conn), StartError> {
    let shown = crate::connections::redact::url(url);
    let client = crate::connections::redis_conn::client(url)
        .map_err(|e| StartError::Config(format!("bad Redis URL {shown:?}: {e}")))?;
    let started = Instant::now();
    let mut told = false;
    loop {
        let attempt = async {
            let mut conn = crate::connections::redis_conn::shared(&client).await?;
            redis::cmd("PING").query_async::<()>(&mut conn).await?;
            Ok::<_, redis::RedisError>(conn)
        }
        .await;
        match attempt {
            Ok(conn) => return Ok((client, conn)),
            Err(e) if e.code() == Some("LOADING") && started.elapsed() < loading_wait => {
                if !told {
                    tracing::warn!(redis = %shown, "Redis is loading its dataset; waiting for it");
                    told = true;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Err(err) => return Err(StartError::RedisUnreachable { url: shown, err }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::StartError;
    use crate::connections::redis_conn::ServerError;

    #[test]
    fn exit_codes_follow_the_readme() {
        let url = "redis://127.0.0.1:6379/0";
        let dropped = redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::BrokenPipe));
        let unreachable = StartError::from_server(url, ServerError::Unreachable(dropped));
        assert!(matches!(unreachable, StartError::RedisUnreachable { .. }));
        assert_eq!(unreachable.exit_code(), 1);
        let old = StartError::from_server(
            url,
            ServerError::TooOld {
                version: "5.0.0".into(),
            },
        );
        assert_eq!(old.exit_code(), 2);
        assert_eq!(
            old.to_string(),
            format!("Redis 5.0.0 at {url} is too old: playguard needs 6.2 or newer")
        );
        assert_eq!(StartError::Config("x".into()).exit_code(), 2);
        let db = StartError::Database {
            url: "postgres://db".into(),
            err: "refused".into(),
        };
        assert_eq!(db.exit_code(), 1);
    }
}

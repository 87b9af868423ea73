//! Redis connections: one shared multiplexed connection for ordinary commands (with an explicit
//! response timeout, since redis-rs >= 1.0 defaults to 500 ms), and dedicated connections for
//! blocking pops so a BRPOP/BLMOVE never stalls the shared pipe. Touches no keys itself.

use redis::aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::{AsyncConnectionConfig, Client, RedisResult};

/// The shared connection type: multiplexed, and it reconnects by itself after Redis restarts.
pub type Conn = ConnectionManager;
use std::time::Duration;

/// How long an ordinary command may take before we call it an error.
pub const RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);
/// Reply deadline on blocking-pop connections (the pops block for 2 s server-side).
pub const BLOCKING_RESPONSE_TIMEOUT: Duration = Duration::from_secs(12);
/// How long connecting may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// PEM file of the CA that signed the Redis server's certificate, for `rediss://` URLs whose
/// server is not signed by a public root (public roots are built in).
pub const CA_ENV: &str = "PLAYGUARD_REDIS_CA";

/// Open a client for `url` (`redis://`, `rediss://`, user:password@, `/db`). `rediss://` checks
/// the server against public roots, or the CA in `$PLAYGUARD_REDIS_CA`; a URL ending in
/// `#insecure` skips verification (as Heroku-style Redis needs, like Sidekiq's
/// `verify_mode: VERIFY_NONE`).
pub fn client(url: &str) -> RedisResult<Client> {
    // rustls needs a process-wide crypto provider; a second install is a harmless no-op.
    let _ = rustls::crypto::ring::default_provider().install_default();
    match std::env::var_os(CA_ENV) {
        Some(path) if url.starts_with("rediss://") => {
            let root = std::fs::read(&path).map_err(|e| {
                redis::RedisError::from((
                    redis::ErrorKind::InvalidClientConfig,
                    "cannot read the CA file named by PLAYGUARD_REDIS_CA",
                    format!("{}: {e}", std::path::Path::new(&path).display()),
                ))
            })?;
            Client::build_with_tls(
                url,
                redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(root),
                },
            )
        }
        _ => Client::open(url),
    }
}

/// The shared connection: pipelined, every reply bounded by `response_timeout`, reconnecting in
/// the background after an error (the failed request itself still reports the error).
pub async fn shared_with_timeout(client: &Client, response_timeout: Duration) -> RedisResult<Conn> {
    let cfg = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(CONNECT_TIMEOUT))
        .set_response_timeout(Some(response_timeout))
        .set_number_of_retries(2)
        .set_max_delay(Duration::from_millis(500));
    client.get_connection_manager_with_config(cfg).await
}

pub async fn shared(client: &Client) -> RedisResult<Conn> {
    shared_with_timeout(client, RESPONSE_TIMEOUT).await
}

/// A connection of its own for blocking commands. Its reply deadline sits well above the 2 s
/// server-side timeout of our BRPOP/BLMOVE (redis-rs's 500 ms default would cut them off) but
/// is bounded, so a half-open TCP connection cannot stop fetching forever while the heartbeat
/// (on the shared connection) says the process is fine. As with Sidekiq's read timeout, a
/// basic-fetch BRPOP given up on by the client can still pop on a paused server; with reliable
/// fetch such a job waits in our working list and goes back to its queue at our next stop.
pub async fn dedicated(client: &Client) -> RedisResult<MultiplexedConnection> {
    let cfg = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(CONNECT_TIMEOUT))
        .set_response_timeout(Some(BLOCKING_RESPONSE_TIMEOUT));
    client
        .get_multiplexed_async_connection_with_config(&cfg)
        .await
}

/// The oldest server playguard runs against: reliable fetch and the poller use `RPOP key
/// count`, `BLMOVE` and `ZRANGE ... BYSCORE`, all new in Redis 6.2 (Sidekiq 7 needs 6.2 too).
pub const MIN_SERVER: (u32, u32) = (6, 2);

/// Parse "major.minor.patch" from an INFO reply's `redis_version:` line.
pub fn server_version(info: &str) -> Option<(u32, u32, u32)> {
    let v = info
        .lines()
        .find_map(|l| l.strip_prefix("redis_version:"))?
        .trim();
    let mut it = v.split('.').map(|n| n.parse::<u32>().ok());
    Some((it.next()??, it.next()??, it.next().flatten().unwrap_or(0)))
}

/// PING, then refuse a server too old for the commands we send, with a clear message.
pub async fn check_server(conn: &mut Conn) -> Result<String, String> {
    let info: String = match redis::cmd("INFO").arg("server").query_async(conn).await {
        Ok(i) => i,
        // INFO renamed away or denied by ACL (it is in @dangerous), as on some managed
        // Redis: like Sidekiq's FAKE_INFO fallback, carry on without knowing the version.
        // (Any error reply from the server; a connection error still fails.)
        Err(e) if e.code().is_some() => {
            tracing::warn!(error = %e, "cannot read the Redis version (INFO refused); assuming it is recent");
            return Ok("unknown".into());
        }
        Err(e) => return Err(e.to_string()),
    };
    match server_version(&info) {
        Some((ma, mi, pa)) if (ma, mi) >= MIN_SERVER => Ok(format!("{ma}.{mi}.{pa}")),
        Some((ma, mi, pa)) => Err(format!(
            "Redis {ma}.{mi}.{pa} is too old: playguard needs {}.{} or newer",
            MIN_SERVER.0, MIN_SERVER.1
        )),
        // Servers that speak the protocol but hide their version (proxies): let them try.
        None => Ok("unknown".into()),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn parses_versions() {
        let info = "# Server\r\nredis_version:7.0.15\r\nredis_mode:standalone\r\n";
        assert_eq!(super::server_version(info), Some((7, 0, 15)));
        assert_eq!(
            super::server_version("redis_version:6.0.16\n"),
            Some((6, 0, 16))
        );
        assert!((6, 0) < super::MIN_SERVER && (7, 0) >= super::MIN_SERVER);
    }
}

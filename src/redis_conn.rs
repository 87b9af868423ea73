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

/// A connection of its own for blocking commands: no response timeout, because a BRPOP with a
/// 2 s server-side timeout must not be cut off by the client at 500 ms, and a pop given up
/// on by the client can still run on a paused server, whose reply would then be lost. The
/// fetch loop ends these waits with CLIENT UNBLOCK, and bounds how long it waits at shutdown.
pub async fn dedicated(client: &Client) -> RedisResult<MultiplexedConnection> {
    let cfg = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(CONNECT_TIMEOUT))
        .set_response_timeout(None);
    client
        .get_multiplexed_async_connection_with_config(&cfg)
        .await
}

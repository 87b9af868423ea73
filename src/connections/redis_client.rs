//! A `redis::Client` for one server's URL, with our TLS rules: `rediss://` checks the server
//! against public roots or the CA named by `$PLAYGUARD_REDIS_CA`. Shared by `redis_conn.rs`
//! (the primary, or the one server) and `sentinel.rs` (the sentinels, and the primary they
//! name), so neither needs the other for it. Touches no keys.

use redis::io::tcp::{socket2::TcpKeepalive, TcpSettings};
use redis::{IntoConnectionInfo, RedisResult};
use std::time::Duration;

/// PEM file of the CA that signed the Redis server's certificate, for `rediss://` URLs whose
/// server is not signed by a public root (public roots are built in).
pub const CA_ENV: &str = "PLAYGUARD_REDIS_CA";

/// Open a client for `url` (`redis://`, `rediss://`, user:password@, `/db`). `rediss://` checks
/// the server against public roots, or the CA in `$PLAYGUARD_REDIS_CA`; a URL ending in
/// `#insecure` skips verification (as Heroku-style Redis needs, like Sidekiq's
/// `verify_mode: VERIFY_NONE`).
pub fn plain_client(url: &str) -> RedisResult<redis::Client> {
    // rustls needs a process-wide crypto provider; a second install is a harmless no-op.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let info = url.into_connection_info()?;
    let tcp = tcp_settings(info.tcp_settings().clone());
    let info = info.set_tcp_settings(tcp);
    match std::env::var_os(CA_ENV) {
        Some(path) if url.starts_with("rediss://") => {
            let root = std::fs::read(&path).map_err(|e| {
                redis::RedisError::from((
                    redis::ErrorKind::InvalidClientConfig,
                    "cannot read the CA file named by PLAYGUARD_REDIS_CA",
                    format!("{}: {e}", std::path::Path::new(&path).display()),
                ))
            })?;
            redis::Client::build_with_tls(
                info,
                redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(root),
                },
            )
        }
        _ => redis::Client::open(info),
    }
}

/// Keepalive probes after 5 s idle, every 2 s, 3 of them, and TCP_USER_TIMEOUT of 10 s on
/// every Redis socket: a server that died without a RST (a host gone, a VIP moved, a cable
/// pulled) is noticed in about 11 s, not after the kernel's 15 minutes of retransmissions, and
/// the connection is then made again by name. Idle blocking pops send nothing unacknowledged,
/// so the user timeout never cuts a pop that is merely waiting.
fn tcp_settings(base: TcpSettings) -> TcpSettings {
    let keepalive = TcpKeepalive::new()
        .with_time(Duration::from_secs(5))
        .with_interval(Duration::from_secs(2))
        .with_retries(3);
    base.set_keepalive(keepalive)
        .set_user_timeout(Duration::from_secs(10))
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_client_has_keepalive_and_a_user_timeout() {
        for url in ["redis://127.0.0.1:6379/0", "rediss://h:6380/1#insecure"] {
            let c = super::plain_client(url).unwrap();
            let tcp = c.get_connection_info().tcp_settings();
            assert!(tcp.keepalive().is_some(), "{url}");
            assert_eq!(
                tcp.user_timeout(),
                Some(std::time::Duration::from_secs(10)),
                "{url}"
            );
        }
    }
}

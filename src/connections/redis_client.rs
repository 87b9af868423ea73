//! A `redis::Client` for one server's URL, with our TLS rules: `rediss://` checks the server
//! against public roots or the CA named by `$PLAYGUARD_REDIS_CA`. Shared by `redis_conn.rs`
//! (the primary, or the one server) and `sentinel.rs` (the sentinels, and the primary they
//! name), so neither needs the other for it. Touches no keys.

use redis::RedisResult;

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
                url,
                redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(root),
                },
            )
        }
        _ => redis::Client::open(url),
    }
}

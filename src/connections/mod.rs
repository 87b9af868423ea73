//! Connections: one Redis server's client (TLS, ACL), the Sentinel resolver, the shared and
//! blocking connections that follow a failover, the PostgreSQL pool and its TLS, and the
//! redaction of secrets in URLs. Touches no Redis keys of its own.

pub mod db;
pub mod db_tls;
pub mod follow;
pub mod redact;
pub mod redis_client;
pub mod redis_conn;
pub mod sentinel;

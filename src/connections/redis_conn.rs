//! Redis connections: one shared multiplexed connection for ordinary commands (with an explicit
//! response timeout, since redis-rs >= 1.0 defaults to 500 ms), and dedicated connections for
//! blocking pops so a BRPOP/BLMOVE never stalls the shared pipe. With a `redis-sentinel://` URL
//! both find the current primary through the sentinels and follow it after a failover
//! (`sentinel.rs`). Clients for one server come from `redis_client.rs`. Touches no keys
//! itself.

pub use crate::connections::redis_client::{plain_client, CA_ENV};
use crate::connections::sentinel::{Backoff, Resolver, SentinelUrl};
use redis::aio::{
    ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection,
};
use redis::{AsyncConnectionConfig, Cmd, RedisFuture, RedisResult, Value};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

/// How long an ordinary command may take before we call it an error.
pub const RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);
/// Reply deadline on blocking-pop connections (the pops block for 2 s server-side).
pub const BLOCKING_RESPONSE_TIMEOUT: Duration = Duration::from_secs(12);
/// How long connecting may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// Where connections go: one server, or whichever server the sentinels name as primary.
// One per process (held by the Worker): its size does not matter, boxing would only add noise.
#[allow(clippy::large_enum_variant)]
#[derive(Clone)]
pub enum Client {
    Plain(redis::Client),
    Sentinel(Arc<Resolver>),
}

impl From<redis::Client> for Client {
    fn from(c: redis::Client) -> Client {
        Client::Plain(c)
    }
}

/// Open a client for `url`: `redis://`/`rediss://` (see [`plain_client`]) or
/// `redis-sentinel://`/`rediss-sentinel://` (sentinels; nothing is contacted yet).
pub fn client(url: &str) -> RedisResult<Client> {
    if crate::connections::sentinel::is_sentinel_url(url) {
        let parsed = SentinelUrl::parse(url)?;
        // Fail on a malformed primary URL now, not at the first failover.
        plain_client(&parsed.server_url("127.0.0.1", 6379))?;
        return Ok(Client::Sentinel(Arc::new(Resolver::new(
            parsed,
            CONNECT_TIMEOUT,
        ))));
    }
    plain_client(url).map(Client::Plain)
}

/// The shared connection, cloned into every task. For a plain URL it is the ConnectionManager
/// itself (no extra cost per command); behind sentinels it is the manager of the current
/// primary, swapped for a new one when the primary moves.
#[derive(Clone)]
pub struct Conn(Shared);

#[derive(Clone)]
enum Shared {
    Plain(ConnectionManager),
    Sentinel(Arc<Follow>),
}

/// The sentinel case: the current primary's manager, and at most one re-resolution at a time.
struct Follow {
    resolver: Arc<Resolver>,
    current: RwLock<(String, ConnectionManager)>,
    refreshing: AtomicBool,
    response_timeout: Duration,
    db: i64,
    watcher: std::sync::Mutex<Option<tokio::task::AbortHandle>>,
}

impl Drop for Follow {
    fn drop(&mut self) {
        if let Some(w) = self
            .watcher
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            w.abort();
        }
    }
}

/// Whether an error means "this may no longer be the primary": the connection failed, or the
/// server answered as a replica (READONLY; MASTERDOWN from a replica that lost its primary; a
/// MULTI aborted because a command in it was refused).
fn primary_suspect(e: &redis::RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_timeout()
        || matches!(
            e.kind(),
            ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown | ServerErrorKind::ExecAbort)
        )
        // A script's redis.call refused by a replica carries the code inside its message.
        || e.to_string().contains("READONLY")
}

fn value_suspect(v: &Value) -> bool {
    match v {
        Value::ServerError(e) => matches!(e.code(), "READONLY" | "MASTERDOWN" | "EXECABORT"),
        Value::Array(items) => items.iter().any(value_suspect),
        _ => false,
    }
}

impl Follow {
    fn manager(&self) -> ConnectionManager {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .1
            .clone()
    }

    /// Pass a reply through, asking the sentinels again when it suggests the primary moved.
    fn check<T>(
        self: &Arc<Self>,
        r: RedisResult<T>,
        suspect: impl Fn(&T) -> bool,
    ) -> RedisResult<T> {
        match &r {
            Err(e) if primary_suspect(e) => self.refresh(),
            Ok(v) if suspect(v) => self.refresh(),
            _ => {}
        }
        r
    }

    /// Ask the sentinels again in the background, with jittered backoff until a server that
    /// says it is the primary answers; then new requests go there. Requests in flight (and
    /// the one that failed) keep their errors: callers retry, or end a cycle as lock lost.
    fn refresh(self: &Arc<Self>) {
        if self.refreshing.swap(true, Ordering::AcqRel) {
            return;
        }
        let me = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut backoff = Backoff::new();
            loop {
                let Some(f) = me.upgrade() else { return };
                match f.resolver.primary().await {
                    Ok((addr, client)) => match manager(&client, f.response_timeout).await {
                        Ok(m) => {
                            let previous = std::mem::replace(
                                &mut *f.current.write().unwrap_or_else(|e| e.into_inner()),
                                (addr.clone(), m),
                            );
                            if previous.0 != addr {
                                tracing::warn!(primary = %addr, previous = %previous.0, master = %f.resolver.url.master,
                                    "Redis Sentinel: following the new primary");
                            }
                            // A pause before the next refresh may start, so a burst of errors
                            // from requests already in flight does not re-resolve at once.
                            tokio::time::sleep(backoff.pause()).await;
                            f.refreshing.store(false, Ordering::Release);
                            return;
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "Redis Sentinel: cannot connect to the primary; asking again")
                        }
                    },
                    Err(e) => {
                        tracing::warn!(error = %e, "Redis Sentinel: no primary yet; asking again")
                    }
                }
                drop(f);
                tokio::time::sleep(backoff.pause()).await;
            }
        });
    }
}

impl Conn {
    /// The primary this connection talks to, when it was found through sentinels.
    pub fn primary(&self) -> Option<String> {
        match &self.0 {
            Shared::Plain(_) => None,
            Shared::Sentinel(f) => Some(format!(
                "{} (sentinel master {})",
                f.current.read().unwrap_or_else(|e| e.into_inner()).0,
                f.resolver.url.master
            )),
        }
    }
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match &mut self.0 {
            Shared::Plain(m) => m.req_packed_command(cmd),
            Shared::Sentinel(f) => {
                let f = f.clone();
                Box::pin(async move {
                    let r = f.manager().req_packed_command(cmd).await;
                    f.check(r, value_suspect)
                })
            }
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match &mut self.0 {
            Shared::Plain(m) => m.req_packed_commands(pipeline, offset, count),
            Shared::Sentinel(f) => {
                let f = f.clone();
                Box::pin(async move {
                    let r = f
                        .manager()
                        .req_packed_commands(pipeline, offset, count)
                        .await;
                    f.check(r, |vs| vs.iter().any(value_suspect))
                })
            }
        }
    }

    fn get_db(&self) -> i64 {
        match &self.0 {
            Shared::Plain(m) => m.get_db(),
            Shared::Sentinel(f) => f.db,
        }
    }
}

async fn manager(
    client: &redis::Client,
    response_timeout: Duration,
) -> RedisResult<ConnectionManager> {
    let cfg = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(CONNECT_TIMEOUT))
        .set_response_timeout(Some(response_timeout))
        .set_number_of_retries(2)
        .set_max_delay(Duration::from_millis(500));
    client.get_connection_manager_with_config(cfg).await
}

/// The shared connection: pipelined, every reply bounded by `response_timeout`, reconnecting in
/// the background after an error (the failed request itself still reports the error). Behind
/// sentinels it also watches `+switch-master` and re-resolves the primary after an error.
pub async fn shared_with_timeout(
    client: &(impl Into<Client> + Clone),
    response_timeout: Duration,
) -> RedisResult<Conn> {
    match client.clone().into() {
        Client::Plain(c) => Ok(Conn(Shared::Plain(manager(&c, response_timeout).await?))),
        Client::Sentinel(resolver) => {
            let (addr, c) = resolver.primary().await?;
            let f = Arc::new(Follow {
                db: resolver.url.db,
                resolver: resolver.clone(),
                current: RwLock::new((addr, manager(&c, response_timeout).await?)),
                refreshing: AtomicBool::new(false),
                response_timeout,
                watcher: std::sync::Mutex::new(None),
            });
            let me = Arc::downgrade(&f);
            let task = tokio::spawn(async move {
                resolver
                    .watch(|| match me.upgrade() {
                        Some(f) => {
                            f.refresh();
                            true
                        }
                        None => false,
                    })
                    .await
            });
            *f.watcher.lock().unwrap_or_else(|e| e.into_inner()) = Some(task.abort_handle());
            Ok(Conn(Shared::Sentinel(f)))
        }
    }
}

pub async fn shared(client: &(impl Into<Client> + Clone)) -> RedisResult<Conn> {
    shared_with_timeout(client, RESPONSE_TIMEOUT).await
}

/// A connection of its own for blocking commands. Its reply deadline sits well above the 2 s
/// server-side timeout of our BRPOP/BLMOVE (redis-rs's 500 ms default would cut them off) but
/// is bounded, so a half-open TCP connection cannot stop fetching forever while the heartbeat
/// (on the shared connection) says the process is fine. As with Sidekiq's read timeout, a
/// basic-fetch BRPOP given up on by the client can still pop on a paused server; with reliable
/// fetch such a job waits in our working list and goes back to its queue at our next stop.
/// Behind sentinels every call asks them for the current primary (the fetch loop reconnects
/// after any error, so a failover costs it one error and one pause).
pub async fn dedicated(client: &Client) -> RedisResult<MultiplexedConnection> {
    let cfg = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(CONNECT_TIMEOUT))
        .set_response_timeout(Some(BLOCKING_RESPONSE_TIMEOUT));
    let c = match client {
        Client::Plain(c) => c.clone(),
        Client::Sentinel(r) => r.primary().await?.1,
    };
    c.get_multiplexed_async_connection_with_config(&cfg).await
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

/// Why `check_server` refuses a server. The two exit differently (README): a server that
/// stops answering is unreachable (exit 1), one that answers with an old version is refused
/// by name (exit 2), so callers branch on this rather than on a message.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The connection failed while asking (dropped, timed out): as if Redis were not there.
    #[error(transparent)]
    Unreachable(#[from] redis::RedisError),
    /// The server answered with a version older than `MIN_SERVER`.
    #[error("Redis {version} is too old: playguard needs {}.{} or newer", MIN_SERVER.0, MIN_SERVER.1)]
    TooOld { version: String },
}

/// Ask for the server's version and refuse one too old for the commands we send.
pub async fn check_server(conn: &mut Conn) -> Result<String, ServerError> {
    let info: String = match redis::cmd("INFO").arg("server").query_async(conn).await {
        Ok(i) => i,
        // INFO renamed away or denied by ACL (it is in @dangerous), as on some managed
        // Redis: like Sidekiq's FAKE_INFO fallback, carry on without knowing the version.
        // (Any error reply from the server; a connection error still fails.)
        Err(e) if e.code().is_some() => {
            tracing::warn!(error = %e, "cannot read the Redis version (INFO refused); assuming it is recent");
            return Ok("unknown".into());
        }
        Err(e) => return Err(ServerError::Unreachable(e)),
    };
    match server_version(&info) {
        Some((ma, mi, pa)) if (ma, mi) >= MIN_SERVER => Ok(format!("{ma}.{mi}.{pa}")),
        Some((ma, mi, pa)) => Err(ServerError::TooOld {
            version: format!("{ma}.{mi}.{pa}"),
        }),
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

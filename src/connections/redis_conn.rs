//! Redis connections: one shared multiplexed connection for ordinary commands (with an explicit
//! response timeout, since redis-rs >= 1.0 defaults to 500 ms), and dedicated connections for
//! blocking pops so a BRPOP/BLMOVE never stalls the shared pipe. Both go to the server the
//! shared connection follows (`follow.rs`: by name, or through the sentinels of a
//! `redis-sentinel://` URL, `sentinel.rs`) and leave it together. Clients for one server come
//! from `redis_client.rs`. Touches no keys itself.

pub use crate::connections::follow::CONNECT_TIMEOUT;
use crate::connections::follow::{value_suspect, Follow, Source};
pub use crate::connections::redis_client::{plain_client, CA_ENV};
use crate::connections::sentinel::{Resolver, SentinelUrl};
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::{AsyncConnectionConfig, Cmd, RedisFuture, RedisResult, Value};
use std::sync::Arc;
use std::time::Duration;

/// How long an ordinary command may take before we call it an error.
pub const RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);
/// Reply deadline on blocking-pop connections (the pops block for 2 s server-side).
pub const BLOCKING_RESPONSE_TIMEOUT: Duration = Duration::from_secs(12);

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

/// The shared connection, cloned into every task: the manager of the server in use now
/// (`follow.rs`), left for the primary found again when a reply says it may no longer be it.
#[derive(Clone)]
pub struct Conn(Arc<Follow>);

impl Conn {
    /// The primary this connection talks to, when it was found through sentinels.
    pub fn primary(&self) -> Option<String> {
        match &self.0.source {
            Source::Plain(_) => None,
            Source::Sentinel(r) => Some(format!(
                "{} (sentinel master {})",
                self.0
                    .current()
                    .server
                    .map(|s| s.addr.clone())
                    .unwrap_or_default(),
                r.url.master
            )),
        }
    }

    /// Run `hook` with every new primary's manager before anything else goes there (a server
    /// of another run id than the one left: a failover, not a reconnect).
    pub fn on_new_primary(&self, hook: crate::connections::follow::OnPrimary) {
        *self.0.on_primary.lock().unwrap_or_else(|e| e.into_inner()) = Some(hook);
    }

    /// The generation of the server in use (bumped each time one is left).
    pub fn generation(&self) -> u64 {
        self.0.current().generation
    }

    /// Resolves once the server of `generation` has been left.
    pub async fn left(&self, generation: u64) {
        self.0.left(generation).await
    }

    /// An error on a connection of ours to the server of `generation` (a dedicated one): leave
    /// that server if it says it may no longer be the primary.
    pub fn suspect(&self, generation: u64, e: redis::RedisError) -> redis::RedisError {
        match self.0.check::<()>(generation, Err(e), |_| false) {
            Err(e) => e,
            Ok(()) => unreachable!("an error stays an error"),
        }
    }

    /// A connection of its own for blocking commands, to the server in use now, and that
    /// server's generation. Its reply deadline sits well above the 2 s server-side timeout of
    /// our BRPOP/BLMOVE (redis-rs's 500 ms default would cut them off) but is bounded, so a
    /// half-open TCP connection cannot stop fetching forever while the heartbeat (on the shared
    /// connection) says the process is fine. As with Sidekiq's read timeout, a basic-fetch
    /// BRPOP given up on by the client can still pop on a paused server; with reliable fetch
    /// such a job waits in our working list and goes back to its queue at our next stop.
    pub async fn dedicated(&self) -> RedisResult<(u64, MultiplexedConnection)> {
        let cfg = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(CONNECT_TIMEOUT))
            .set_response_timeout(Some(BLOCKING_RESPONSE_TIMEOUT));
        let (generation, server) = self.0.server().await?;
        let c = server
            .client
            .get_multiplexed_async_connection_with_config(&cfg)
            .await;
        Ok((generation, c.map_err(|e| self.suspect(generation, e))?))
    }
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        let f = self.0.clone();
        Box::pin(async move {
            let (generation, s) = f.server().await?;
            let r = s.manager.clone().req_packed_command(cmd).await;
            f.check(generation, r, value_suspect)
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        let f = self.0.clone();
        Box::pin(async move {
            let (generation, s) = f.server().await?;
            let r = s
                .manager
                .clone()
                .req_packed_commands(pipeline, offset, count)
                .await;
            f.check(generation, r, |vs| vs.iter().any(value_suspect))
        })
    }

    fn get_db(&self) -> i64 {
        match &self.0.source {
            Source::Plain(c) => c.get_connection_info().redis_settings().db(),
            Source::Sentinel(r) => r.url.db,
        }
    }
}

/// The shared connection: pipelined, every reply bounded by `response_timeout`. A reply that
/// says the server may no longer be the primary (READONLY, MASTERDOWN, LOADING, a reset, a
/// timeout) makes it leave that server and find the primary again, by name or through the
/// sentinels, whose `+switch-master` notices it also watches (the failed request itself
/// still reports its error: callers retry, or end a cycle as lock lost).
pub async fn shared_with_timeout(
    client: &(impl Into<Client> + Clone),
    response_timeout: Duration,
) -> RedisResult<Conn> {
    match client.clone().into() {
        Client::Plain(c) => Ok(Conn(
            Follow::start(Source::Plain(c), response_timeout).await?,
        )),
        Client::Sentinel(resolver) => {
            let f = Follow::start(Source::Sentinel(resolver.clone()), response_timeout).await?;
            let me = Arc::downgrade(&f);
            let task = tokio::spawn(async move {
                resolver
                    .watch(|to| match me.upgrade() {
                        Some(f) => {
                            f.switched(to);
                            true
                        }
                        None => false,
                    })
                    .await
            });
            *f.watcher.lock().unwrap_or_else(|e| e.into_inner()) = Some(task.abort_handle());
            Ok(Conn(f))
        }
    }
}

pub async fn shared(client: &(impl Into<Client> + Clone)) -> RedisResult<Conn> {
    shared_with_timeout(client, RESPONSE_TIMEOUT).await
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

/// Why `check_server` refuses a server. The two exit differently (docs/configuration.md): a server that
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

//! Following the primary: the server the shared connection talks to now, and leaving it at once
//! when it may no longer be the primary. A plain `redis://` URL is followed by name (a VIP, a
//! DNS name, a Kubernetes Service moved to another server: reconnect and ask again), a
//! `redis-sentinel://` URL through the sentinels (`sentinel.rs`), preferring the address a
//! `+switch-master` notice announced. Each server left bumps a generation, so the dedicated
//! connections (`redis_conn.rs`, the blocking pops) leave it too, and errors of requests sent
//! to a server already left do not make us leave the next one. Touches no keys.

use crate::connections::sentinel::{Backoff, Resolver};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{RedisError, RedisResult, Value};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

/// How long connecting may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// Where the primary is found: one name, or the sentinels.
// One per process (held by the shared connection): its size does not matter.
#[allow(clippy::large_enum_variant)]
pub enum Source {
    Plain(redis::Client),
    Sentinel(Arc<Resolver>),
}

/// The server in use: its address, a client for it (dedicated connections), its manager, and
/// its run id (INFO), which tells another server behind the same name from the same one.
#[derive(Clone)]
pub struct Server {
    pub addr: String,
    pub client: redis::Client,
    pub manager: ConnectionManager,
    pub run_id: Option<String>,
}

/// Run with a new primary's manager before anything else is sent there (the fetch layer's
/// reconcile after a failover, set by the launcher).
pub type OnPrimary =
    Arc<dyn Fn(ConnectionManager) -> futures::future::BoxFuture<'static, ()> + Send + Sync>;

/// How long the hook may hold back the new primary.
const ON_PRIMARY_BUDGET: Duration = Duration::from_secs(10);

/// What the shared connection uses now. `server` is None from the moment a server is left
/// until the next primary answers: requests wait for it rather than go to the old one.
#[derive(Clone)]
pub struct Current {
    pub generation: u64,
    /// Shared, so a request's look-up costs a reference count, not a copy of the client.
    pub server: Option<Arc<Server>>,
}

pub struct Follow {
    pub source: Source,
    state: watch::Sender<Current>,
    refreshing: AtomicBool,
    response_timeout: Duration,
    /// The primary a `+switch-master` notice named, tried before asking the sentinels.
    announced: Mutex<Option<(String, u16)>>,
    pub on_primary: Mutex<Option<OnPrimary>>,
    pub watcher: Mutex<Option<tokio::task::AbortHandle>>,
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

/// Whether an error means "this may no longer be the primary": the connection failed or timed
/// out, or the server answered as a replica or as one not ready (READONLY; MASTERDOWN from a
/// replica that lost its primary; LOADING; a blocked pop UNBLOCKED because the server became a
/// replica; a MULTI aborted because a command in it was refused).
pub fn primary_suspect(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_timeout()
        || e.code().is_some_and(suspect_code)
        // A script's redis.call refused by a replica carries the code inside its message.
        || e.to_string().contains("READONLY")
}

fn suspect_code(code: &str) -> bool {
    matches!(
        code,
        "READONLY" | "MASTERDOWN" | "LOADING" | "UNBLOCKED" | "EXECABORT"
    )
}

/// The same, for an error reply inside a successful reply (a pipeline's or a MULTI's).
pub fn value_suspect(v: &Value) -> bool {
    match v {
        Value::ServerError(e) => suspect_code(e.code()),
        Value::Array(items) => items.iter().any(value_suspect),
        _ => false,
    }
}

impl Follow {
    /// Connect to the primary named by `source` and follow it.
    pub async fn start(source: Source, response_timeout: Duration) -> RedisResult<Arc<Follow>> {
        let server = connect(&source, None, response_timeout).await?;
        Ok(Arc::new(Follow {
            source,
            state: watch::Sender::new(Current {
                generation: 0,
                server: Some(Arc::new(server)),
            }),
            refreshing: AtomicBool::new(false),
            response_timeout,
            announced: Mutex::new(None),
            on_primary: Mutex::new(None),
            watcher: Mutex::new(None),
        }))
    }

    pub fn current(&self) -> Current {
        self.state.borrow().clone()
    }

    /// The server to send to, and its generation; while none is known yet, wait for one up
    /// to the response timeout.
    pub async fn server(&self) -> RedisResult<(u64, Arc<Server>)> {
        {
            let c = self.state.borrow();
            if let Some(s) = &c.server {
                return Ok((c.generation, s.clone()));
            }
        }
        let mut rx = self.state.subscribe();
        let found =
            tokio::time::timeout(self.response_timeout, rx.wait_for(|c| c.server.is_some())).await;
        match found {
            Ok(Ok(c)) => Ok((c.generation, c.server.clone().expect("waited for it"))),
            _ => Err(RedisError::from((
                redis::ErrorKind::Io,
                "no primary to send to yet (following a failover)",
            ))),
        }
    }

    /// Resolves once the server of `generation` has been left.
    pub async fn left(&self, generation: u64) {
        let mut rx = self.state.subscribe();
        let _ = rx.wait_for(|c| c.generation != generation).await;
    }

    /// A request sent in `generation` got `r`: leave that server if the reply says it may no
    /// longer be the primary (and it is still the one in use).
    pub fn check<T>(
        self: &Arc<Self>,
        generation: u64,
        r: RedisResult<T>,
        suspect: impl Fn(&T) -> bool,
    ) -> RedisResult<T> {
        let why = match &r {
            Err(e) if primary_suspect(e) => Some(e.to_string()),
            Ok(v) if suspect(v) => Some("a replica's or a loading server's error reply".into()),
            _ => None,
        };
        if let Some(why) = why {
            self.leave(generation, &why);
        }
        r
    }

    /// A `+switch-master` notice named the new primary: leave the old one now.
    pub fn switched(self: &Arc<Self>, to: Option<(String, u16)>) {
        let (generation, now) = {
            let c = self.state.borrow();
            (c.generation, c.server.as_ref().map(|s| s.addr.clone()))
        };
        // Already there (a READONLY led us to it first): nothing to leave.
        if let (Some((host, port)), Some(now)) = (&to, now) {
            if now == format!("{host}:{port}") {
                return;
            }
        }
        *self.announced.lock().unwrap_or_else(|e| e.into_inner()) = to;
        self.leave(generation, "+switch-master");
    }

    /// Stop sending to the server of `generation` (new requests wait), and find the primary
    /// again in the background, with jittered backoff until one that says so answers.
    fn leave(self: &Arc<Self>, generation: u64, why: &str) {
        if self.state.borrow().generation != generation
            || self.refreshing.swap(true, Ordering::AcqRel)
        {
            return;
        }
        let mut left = None;
        self.state.send_modify(|c| {
            c.generation += 1;
            left = c.server.take();
        });
        let old = left.as_ref().map(|s| s.addr.clone()).unwrap_or_default();
        let old_run = left.and_then(|s| s.run_id.clone());
        tracing::warn!(server = %old, reason = %why, "Redis: leaving this server, finding the primary again");
        let me = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut backoff = Backoff::new();
            loop {
                let Some(f) = me.upgrade() else { return };
                let announced = f.announced.lock().unwrap_or_else(|e| e.into_inner()).take();
                match connect(&f.source, announced, f.response_timeout).await {
                    Ok(s) => {
                        tracing::warn!(primary = %s.addr, previous = %old, "Redis: following the primary");
                        if s.run_id.is_none() || s.run_id != old_run {
                            f.before_use(&s).await;
                        }
                        f.state.send_modify(|c| c.server = Some(Arc::new(s)));
                        f.refreshing.store(false, Ordering::Release);
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "Redis: no primary answers yet; asking again")
                    }
                }
                drop(f);
                tokio::time::sleep(backoff.pause()).await;
            }
        });
    }
}

impl Follow {
    /// Run the hook (the reconcile) on a new primary, bounded in time.
    async fn before_use(&self, s: &Server) {
        let hook = self
            .on_primary
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let Some(hook) = hook {
            if tokio::time::timeout(ON_PRIMARY_BUDGET, hook(s.manager.clone()))
                .await
                .is_err()
            {
                tracing::warn!(primary = %s.addr, "Redis: the failover reconcile did not finish in time; going on");
            }
        }
    }
}

/// Connect to the primary: by name (refusing a server that says it is a replica, as a name
/// not moved yet may still lead to the demoted one), or through the sentinels, trying first
/// the address a `+switch-master` notice announced.
async fn connect(
    source: &Source,
    announced: Option<(String, u16)>,
    response_timeout: Duration,
) -> RedisResult<Server> {
    let (addr, client) = match source {
        Source::Plain(c) => (c.get_connection_info().addr().to_string(), c.clone()),
        Source::Sentinel(r) => match announced {
            Some((host, port)) => match r.primary_at(&host, port).await {
                Ok(found) => found,
                Err(_) => r.primary().await?,
            },
            None => r.primary().await?,
        },
    };
    let mut manager = manager(&client, response_timeout).await?;
    // A server still loading its dataset answers LOADING to everything: taking it now would
    // only make the next request leave it again, a reconnect per request; wait with backoff.
    if let Err(e) = redis::cmd("PING").query_async::<()>(&mut manager).await {
        if e.code() == Some("LOADING") {
            return Err(e);
        }
    }
    if matches!(source, Source::Plain(_)) {
        refuse_replica(&mut manager, &addr).await?;
    }
    let run_id = run_id(&mut manager).await;
    Ok(Server {
        addr,
        client,
        manager,
        run_id,
    })
}

/// The server's `run_id` (INFO server), or None where INFO is refused.
async fn run_id(m: &mut ConnectionManager) -> Option<String> {
    let info: String = redis::cmd("INFO").arg("server").query_async(m).await.ok()?;
    info.lines()
        .find_map(|l| l.strip_prefix("run_id:"))
        .map(|r| r.trim().to_string())
}

/// `ROLE` says "slave": not the primary (yet). A server that refuses ROLE (renamed, or denied
/// by an ACL on a managed Redis) or answers it oddly (a proxy) is taken at its word.
async fn refuse_replica(m: &mut ConnectionManager, addr: &str) -> RedisResult<()> {
    let role: RedisResult<Value> = redis::cmd("ROLE").query_async(m).await;
    let first = match role {
        Ok(Value::Array(v)) => v.into_iter().next(),
        Ok(_) => None,
        Err(e) if e.code().is_some() && !primary_suspect(&e) => None,
        Err(e) => return Err(e),
    };
    match first {
        Some(Value::BulkString(b)) if b.as_slice() == b"slave" => Err(replica(addr)),
        Some(Value::SimpleString(s)) if s == "slave" => Err(replica(addr)),
        _ => Ok(()),
    }
}

fn replica(addr: &str) -> RedisError {
    RedisError::from((
        redis::ErrorKind::Io,
        "the server behind the name is a replica (not moved yet)",
        addr.to_string(),
    ))
}

/// A connection manager to one server, with our connect and reply deadlines.
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

//! Token lock with fencing numbers, for jobs that must never run twice at once (one Marquee,
//! one reconciler). Redis keys: `<key>` (the lock; its value is the holder's UUIDv4 token),
//! `<key>:fence` (the last fence handed out), the holder record hash
//! `playguard:locks:<identity>` when a [`Holder`] is given (field = lock key), the `<key>`
//! passed to [`once`] (a plain `1` with a TTL), and the hash `<key>` passed to [`fenced_set`]
//! (`{fence, value}`).
//!
//! A random token per acquisition makes renewal and release compare-and-act scripts
//! ([`Lease::renew`] is compare-and-PEXPIRE, [`Lease::release`] compare-and-DEL), so a holder whose
//! lease ran out can neither extend nor delete the next owner's lock (a holder paused past its
//! lease wakes to find both refused). The token cannot stop a stalled holder's writes already on
//! their way; the fence does: the acquire script hands out `max(counter + 1, Redis clock in µs)`
//! with the `SET NX`, and the store refuses a write older than one it accepted. What the fence
//! protects, the SQL recipe, and the PostgreSQL fence store are in docs/fencing.md.
//!
//! Limits: one Redis, no Redlock quorum (the fence, not a quorum, guards the writes); `<key>` and
//! `<key>:fence` must share a hash slot on Redis Cluster (`lock:{marquee-7}`); leases are whole
//! milliseconds.

use crate::connections::redis_conn::Conn as MultiplexedConnection;
use redis::{ErrorKind, RedisError, RedisResult, Script, Value};
use std::sync::LazyLock;
use std::time::Duration;
use tokio::time::Instant;

static ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../lua/lock_acquire.lua")));
static RENEW: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../lua/lock_renew.lua")));
static RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../lua/lock_release.lua")));
static FENCED_SET: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../lua/fenced_set.lua")));

/// The smallest safety margin: covers scheduling delay between checking [`Lease::remaining`]
/// and acting on it, plus clock-rate differences between this host and Redis.
pub const MIN_SAFETY_MARGIN: Duration = Duration::from_millis(50);

/// How much earlier than Redis we consider a lease over: `max(ttl / 10, 50 ms)`, and when
/// that would not be shorter than `ttl` (a TTL of 50 ms or less), `ttl / 2`. The local
/// deadline is `start of the last successful acquire/renew request + ttl - margin`.
pub const fn safety_margin(ttl: Duration) -> Duration {
    let ttl_ns = ttl.as_nanos();
    let tenth = ttl_ns / 10;
    let floor = MIN_SAFETY_MARGIN.as_nanos();
    let mut margin = if tenth > floor { tenth } else { floor };
    if margin >= ttl_ns {
        margin = ttl_ns / 2;
    }
    if margin > u64::MAX as u128 {
        margin = u64::MAX as u128;
    }
    Duration::from_nanos(margin as u64)
}

/// Why a renewal could not confirm ownership. Every variant means the same thing to the
/// caller: stop the protected work now, then [`Lease::release`] (which is safe to call).
/// (Not `Eq`: `RedisError` is only `PartialEq`, comparing error kinds.)
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LockLost {
    /// The key holds another acquisition's token: our lease ran out and someone took it.
    #[error("lock lost: the key now holds another owner's token")]
    NotOwner,
    /// The key is gone (expired, deleted, or Redis restarted without it). Not recreated.
    #[error("lock lost: the key no longer exists (expired, deleted, or Redis lost it)")]
    Missing,
    /// Redis could not be asked (timeout, connection refused or dropped, script error).
    /// We cannot prove we still own the lock, so we act as if we do not. The error itself is
    /// kept (also as the `source`), so callers can tell a timeout from a refused connection.
    #[error("lock lost: could not confirm ownership with Redis: {0}")]
    Redis(#[source] RedisError),
    /// Redis answered something the renew script never returns. Treated as lost rather
    /// than guessed at (redsync#38/#61 read a mismatched reply type as success).
    #[error("lock lost: unexpected reply from the renew script: {0}")]
    UnexpectedReply(String),
}

/// An acquired lock. Holds a clone of the connection it was acquired on, so renew and
/// release need no arguments. Dropping a `Lease` does not release it (that would need an
/// async call in `Drop`); the key then expires after at most `ttl`.
pub struct Lease {
    /// The lock key; `<key>:fence` holds the last fence handed out.
    key: String,
    /// UUIDv4 written as the key's value; proof of ownership for renew and release.
    token: String,
    /// The fence the acquire script gave this acquisition; attach it to every guarded write.
    fence: i64,
    /// Lease length sent to Redis (whole milliseconds).
    ttl: Duration,
    /// The holder record hash this acquisition was written to; release drops it from there.
    record: Option<String>,
    /// When we stop trusting the lease locally: request start + ttl - safety margin.
    /// Moved forward by each successful renew; pulled to "now" by a failed one.
    deadline: Instant,
    conn: MultiplexedConnection,
}

impl std::fmt::Debug for Lease {
    // The token is left out on purpose: it is the only proof of ownership, and Debug output
    // ends up in logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("key", &self.key)
            .field("fence", &self.fence)
            .field("ttl", &self.ttl)
            .field("remaining", &self.remaining())
            .finish_non_exhaustive()
    }
}

/// The TTL as whole milliseconds for PX/PEXPIRE; at least 1 ms.
fn ttl_millis(ttl: Duration) -> RedisResult<u64> {
    let ms = ttl.as_millis();
    if ms == 0 {
        return Err(RedisError::from((
            ErrorKind::InvalidClientConfig,
            "lock ttl must be at least 1 ms",
        )));
    }
    u64::try_from(ms)
        .map_err(|_| RedisError::from((ErrorKind::InvalidClientConfig, "lock ttl too large")))
}

fn local_deadline(sent_at: Instant, ttl: Duration) -> Instant {
    sent_at + ttl.saturating_sub(safety_margin(ttl))
}

fn unexpected(what: &'static str, reply: &Value) -> RedisError {
    RedisError::from((ErrorKind::UnexpectedReturnType, what, format!("{reply:?}")))
}

/// A script's yes/no reply: the integer 1 is `true`, 0 is `false`, anything else an error.
fn one_or_zero(reply: Value, what: &'static str) -> RedisResult<bool> {
    match reply {
        Value::Int(1) => Ok(true),
        Value::Int(0) => Ok(false),
        other => Err(unexpected(what, &other)),
    }
}

/// Who takes a lock, recorded atomically with the acquisition in `record` (the hash
/// `playguard:locks:<identity>`, field = the lock key) as
/// `{"token","jid","fence","label","class","acquired_at" (unix ms),"ttl_ms"}`, so the orphan
/// sweep can release the lock if this process dies holding it.
#[derive(Debug, Clone)]
pub struct Holder {
    pub record: String,
    pub jid: String,
    pub class: String,
    pub label: Option<String>,
}

impl Holder {
    /// The record JSON around the fence (only the script knows it): (before, after).
    fn json_parts(&self, token: &str, ttl_ms: u64) -> (String, String) {
        let s = |v: &str| serde_json::Value::from(v).to_string();
        let label = self
            .label
            .as_deref()
            .map(s)
            .unwrap_or_else(|| "null".into());
        let acquired_at = chrono::Utc::now().timestamp_millis();
        (
            format!(r#"{{"token":{},"jid":{},"fence":"#, s(token), s(&self.jid)),
            format!(
                r#","label":{label},"class":{},"acquired_at":{acquired_at},"ttl_ms":{ttl_ms}}}"#,
                s(&self.class)
            ),
        )
    }
}

/// Try once to take `key` for `ttl` (no holder record; see [`acquire_as`]).
pub async fn acquire(
    conn: &MultiplexedConnection,
    key: &str,
    ttl: Duration,
) -> RedisResult<Option<Lease>> {
    acquire_as(conn, key, ttl, None).await
}

/// Try once to take `key` for `ttl`, recording `holder` when given. `Ok(None)` means another holder has it; the caller
/// should skip this cycle rather than wait. The lease's local deadline is counted from
/// before the request was sent, so network and queueing time shorten it, never lengthen it.
///
/// An `Err` (say a response timeout) does not prove the lock was not taken: the script may
/// still run on the server, leaving a key nobody holds the token for. It expires after `ttl`;
/// treat the error like "locked" and skip the cycle.
pub async fn acquire_as(
    conn: &MultiplexedConnection,
    key: &str,
    ttl: Duration,
    holder: Option<&Holder>,
) -> RedisResult<Option<Lease>> {
    let ttl_ms = ttl_millis(ttl)?;
    let ttl = Duration::from_millis(ttl_ms);
    let token = uuid::Uuid::new_v4().to_string();
    let mut c = conn.clone();
    let sent_at = Instant::now();
    let mut inv = ACQUIRE.key(key);
    inv.key(format!("{key}:fence")).arg(&token).arg(ttl_ms);
    if let Some(h) = holder {
        let (before, after) = h.json_parts(&token, ttl_ms);
        inv.key(&h.record).arg(before).arg(after);
    }
    let reply: Value = inv.invoke_async(&mut c).await?;
    match &reply {
        // Lua `false` is nil under RESP2 and a boolean under RESP3.
        Value::Nil | Value::Boolean(false) => Ok(None),
        Value::Array(items) => match items.as_slice() {
            [Value::BulkString(echo), Value::Int(fence)] if echo.as_slice() == token.as_bytes() => {
                Ok(Some(Lease {
                    key: key.to_owned(),
                    token,
                    fence: *fence,
                    ttl,
                    record: holder.map(|h| h.record.clone()),
                    deadline: local_deadline(sent_at, ttl),
                    conn: c,
                }))
            }
            _ => Err(unexpected("unexpected lock_acquire reply", &reply)),
        },
        _ => Err(unexpected("unexpected lock_acquire reply", &reply)),
    }
}

impl Lease {
    /// Extend the lease to a full `ttl` from now, only if the key still holds our token.
    ///
    /// A late call (after [`Lease::remaining`] reached zero) is still sent: Redis, not our
    /// clock, decides whether the key is ours, and if it is, renewing is correct. The caller
    /// must not have *worked* past the deadline, which is what the local deadline is for.
    ///
    /// Any failure (other owner, missing key, any Redis error including a response timeout,
    /// an unexpected reply) is `LockLost`, and the local deadline is pulled to now so
    /// `remaining()` reads zero from then on. A timed-out request may still run on the
    /// server later; that can only extend our own key, which `release` then deletes.
    pub async fn renew(&mut self) -> Result<(), LockLost> {
        let outcome = self.renew_once().await;
        match &outcome {
            Ok(sent_at) => self.deadline = local_deadline(*sent_at, self.ttl),
            Err(_) => self.deadline = self.deadline.min(Instant::now()),
        }
        outcome.map(|_| ())
    }

    async fn renew_once(&mut self) -> Result<Instant, LockLost> {
        let ttl_ms = ttl_millis(self.ttl).map_err(LockLost::Redis)?;
        let sent_at = Instant::now();
        let reply: Value = RENEW
            .key(&self.key)
            .arg(&self.token)
            .arg(ttl_ms)
            .invoke_async(&mut self.conn)
            .await
            .map_err(LockLost::Redis)?;
        // Exact type and value: only the integer 1 means renewed.
        match reply {
            Value::Int(1) => Ok(sent_at),
            Value::Int(0) => Err(LockLost::Missing),
            Value::Int(-1) => Err(LockLost::NotOwner),
            other => Err(LockLost::UnexpectedReply(format!("{other:?}"))),
        }
    }

    /// Delete the key only if it still holds our token. `Ok(true)` if this call deleted it,
    /// `Ok(false)` if it was already gone or belongs to someone else (left untouched).
    /// Safe, and expected, after `LockLost`.
    pub async fn release(&self) -> RedisResult<bool> {
        match self.release_reply().await? {
            Value::Int(1) => Ok(true),
            Value::Int(0 | -1) => Ok(false),
            other => Err(unexpected("unexpected lock_release reply", &other)),
        }
    }

    /// Release, proving as [`Lease::renew`] would that the key held our token up to this
    /// moment: the same comparison, made by the compare-and-DEL itself. For the end of work
    /// that needs no more lease (a cycle's last phase), it saves the renewal's round trip.
    /// `Err` is exactly renew's: the work was not proven guarded. After `LockLost::Redis` the
    /// key may still be ours; [`Lease::release`] is still safe to call.
    pub async fn release_proving(&self) -> Result<(), LockLost> {
        match self.release_reply().await.map_err(LockLost::Redis)? {
            Value::Int(1) => Ok(()),
            Value::Int(0) => Err(LockLost::Missing),
            Value::Int(-1) => Err(LockLost::NotOwner),
            other => Err(LockLost::UnexpectedReply(format!("{other:?}"))),
        }
    }

    async fn release_reply(&self) -> RedisResult<Value> {
        let mut c = self.conn.clone();
        let mut inv = RELEASE.key(&self.key);
        if let Some(r) = &self.record {
            inv.key(r);
        }
        inv.arg(&self.token).invoke_async(&mut c).await
    }

    /// The fencing number of this acquisition; pass it with every guarded write.
    pub fn fence(&self) -> i64 {
        self.fence
    }

    /// The UUIDv4 stored in the key.
    pub fn token(&self) -> &str {
        &self.token
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    /// The lease length sent to Redis (whole milliseconds).
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Time left before the local deadline (monotonic clock); zero once it has passed or a
    /// renewal failed. Start no new work that could outlast it.
    pub fn remaining(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }

    /// Last successful acquire/renew request start + ttl - [`safety_margin`].
    pub fn deadline(&self) -> Instant {
        self.deadline
    }
}

/// "Don't fire this twice": `SET key 1 NX PX ttl`, no token, no renewal, no release. `true`
/// for the first caller in each `ttl` window, `false` for everyone else. Use it for
/// per-tick dispatch fingerprints, not for work that must be exclusive while it runs.
pub async fn first_in_window(
    conn: &MultiplexedConnection,
    key: &str,
    ttl: Duration,
) -> RedisResult<bool> {
    let ttl_ms = ttl_millis(ttl)?;
    let mut c = conn.clone();
    let reply: Value = redis::cmd("SET")
        .arg(key)
        .arg(1)
        .arg("NX")
        .arg("PX")
        .arg(ttl_ms)
        .query_async(&mut c)
        .await?;
    match reply {
        Value::Okay => Ok(true),
        Value::Nil => Ok(false),
        other => Err(unexpected("unexpected SET NX reply", &other)),
    }
}

/// Write `value` into the hash `key` as `{fence, value}` only if the stored fence is
/// `<= fence` (or absent). `Ok(false)` means a newer holder has written: the caller is stale
/// and must stop. docs/fencing.md has the SQL form of the same rule.
pub async fn fenced_set(
    conn: &MultiplexedConnection,
    key: &str,
    fence: i64,
    value: &str,
) -> RedisResult<bool> {
    let mut c = conn.clone();
    let reply: Value = FENCED_SET
        .key(key)
        .arg(fence)
        .arg(value)
        .invoke_async(&mut c)
        .await?;
    one_or_zero(reply, "unexpected fenced_set reply")
}

/// The hash of the token locks a process holds: field = lock key, value = the holder record
/// JSON written by `lua/lock_acquire.lua` (see `lock::Holder`).
pub fn locks_record_key(identity: &str) -> String {
    format!("playguard:locks:{identity}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn margin_is_a_tenth_with_a_floor_and_below_ttl() {
        assert_eq!(
            safety_margin(Duration::from_secs(900)),
            Duration::from_secs(90)
        );
        assert_eq!(
            safety_margin(Duration::from_millis(300)),
            Duration::from_millis(50)
        );
        assert_eq!(
            safety_margin(Duration::from_millis(40)),
            Duration::from_millis(20)
        );
        for ms in [1u64, 2, 50, 51, 499, 500, 501] {
            let ttl = Duration::from_millis(ms);
            assert!(safety_margin(ttl) < ttl, "margin for {ms} ms");
        }
    }

    #[test]
    fn zero_ttl_is_rejected() {
        assert!(ttl_millis(Duration::from_micros(900)).is_err());
        assert_eq!(ttl_millis(Duration::from_micros(1500)).unwrap(), 1);
    }
}

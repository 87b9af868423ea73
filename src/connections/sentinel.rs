//! Redis Sentinel: the `redis-sentinel://` URL, finding the current primary through the
//! sentinels (`SENTINEL get-master-addr-by-name`, then `ROLE` on the address named, so a
//! sentinel that has not yet seen a failover cannot send us to a replica), and the
//! `+switch-master` notices that tell us to ask again. Touches no keys.

use futures::StreamExt;
use redis::{RedisError, RedisResult};
use std::time::Duration;

/// The sentinels' password, when they need one (the URL's password is the primary's).
pub const PASSWORD_ENV: &str = "PLAYGUARD_SENTINEL_PASSWORD";
pub const DEFAULT_PORT: u16 = 26379;

/// A parsed `redis-sentinel://[[user]:password@]host1[:port1][,host2[:port2]…][/db]#master`.
#[derive(Clone, Debug, PartialEq)]
pub struct SentinelUrl {
    pub tls: bool,
    pub sentinels: Vec<(String, u16)>,
    pub master: String,
    pub username: Option<String>,
    pub password: Option<String>,
    pub db: i64,
}

fn bad(what: &str) -> RedisError {
    RedisError::from((
        redis::ErrorKind::InvalidClientConfig,
        "bad redis-sentinel URL",
        what.to_string(),
    ))
}

/// Whether `url` names sentinels rather than a server.
pub fn is_sentinel_url(url: &str) -> bool {
    url.starts_with("redis-sentinel://") || url.starts_with("rediss-sentinel://")
}

impl SentinelUrl {
    pub fn parse(url: &str) -> RedisResult<SentinelUrl> {
        let (tls, rest) = if let Some(r) = url.strip_prefix("redis-sentinel://") {
            (false, r)
        } else if let Some(r) = url.strip_prefix("rediss-sentinel://") {
            (true, r)
        } else {
            return Err(bad(
                "it must start with redis-sentinel:// or rediss-sentinel://",
            ));
        };
        let (rest, master) = rest
            .split_once('#')
            .ok_or_else(|| bad("the master name is missing (…#master_name)"))?;
        let master = decode(master)?;
        if master.is_empty() {
            return Err(bad("the master name after # is empty"));
        }
        let (userinfo, rest) = match rest.rsplit_once('@') {
            Some((u, r)) => (Some(u), r),
            None => (None, rest),
        };
        let (hosts, db) = match rest.split_once('/') {
            Some((h, "")) => (h, 0),
            Some((h, d)) => (
                h,
                d.parse::<i64>()
                    .map_err(|_| bad("the database after / is not a number"))?,
            ),
            None => (rest, 0),
        };
        let (username, password) = match userinfo {
            None => (None, None),
            Some(u) => match u.split_once(':') {
                Some((user, pass)) => (
                    Some(decode(user)?).filter(|s| !s.is_empty()),
                    Some(decode(pass)?),
                ),
                None => (Some(decode(u)?).filter(|s| !s.is_empty()), None),
            },
        };
        let mut sentinels = Vec::new();
        for h in hosts.split(',') {
            sentinels.push(host_port(h)?);
        }
        Ok(SentinelUrl {
            tls,
            sentinels,
            master,
            username,
            password,
            db,
        })
    }

    /// The URL of the server at `host:port` (the primary), with the URL's credentials and db.
    pub fn server_url(&self, host: &str, port: u16) -> String {
        let auth = match (&self.username, &self.password) {
            (None, None) => String::new(),
            (u, p) => format!(
                "{}:{}@",
                encode(u.as_deref().unwrap_or("")),
                encode(p.as_deref().unwrap_or(""))
            ),
        };
        let scheme = if self.tls { "rediss" } else { "redis" };
        format!("{scheme}://{auth}{}:{port}/{}", bracket(host), self.db)
    }

    /// The URL of one sentinel (its password from `PLAYGUARD_SENTINEL_PASSWORD`).
    fn sentinel_url(&self, host: &str, port: u16) -> String {
        let auth = match std::env::var(PASSWORD_ENV) {
            Ok(p) if !p.is_empty() => format!(":{}@", encode(&p)),
            _ => String::new(),
        };
        let scheme = if self.tls { "rediss" } else { "redis" };
        format!("{scheme}://{auth}{}:{port}", bracket(host))
    }
}

fn bracket(host: &str) -> String {
    if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_string()
    }
}

fn host_port(h: &str) -> RedisResult<(String, u16)> {
    if h.is_empty() {
        return Err(bad("a sentinel host is empty"));
    }
    let (host, port) = if let Some(r) = h.strip_prefix('[') {
        let (host, after) = r
            .split_once(']')
            .ok_or_else(|| bad("an IPv6 address lacks its ]"))?;
        (host, after.strip_prefix(':'))
    } else {
        match h.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (h, None),
        }
    };
    let port = match port {
        None => DEFAULT_PORT,
        Some(p) => p
            .parse()
            .map_err(|_| bad("a sentinel port is not a number"))?,
    };
    Ok((host.to_string(), port))
}

fn decode(s: &str) -> RedisResult<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = s
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| bad("a %-escape is malformed"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| bad("a %-escape is not UTF-8"))
}

fn encode(s: &str) -> String {
    s.bytes()
        .map(|c| match c {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (c as char).to_string()
            }
            _ => format!("%{c:02X}"),
        })
        .collect()
}

/// Finds the current primary. Every sentinel connection is short-lived and bounded by
/// `timeout`, so an unreachable sentinel costs one timeout, never a hang.
pub struct Resolver {
    pub url: SentinelUrl,
    timeout: Duration,
}

impl Resolver {
    pub fn new(url: SentinelUrl, timeout: Duration) -> Resolver {
        Resolver { url, timeout }
    }

    async fn connect(&self, url: &str) -> RedisResult<redis::aio::MultiplexedConnection> {
        let client = crate::connections::redis_client::plain_client(url)?;
        let cfg = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.timeout))
            .set_response_timeout(Some(self.timeout));
        client
            .get_multiplexed_async_connection_with_config(&cfg)
            .await
    }

    /// What the sentinels say the primary is: the first sentinel that answers wins.
    async fn ask(&self) -> RedisResult<(String, u16)> {
        let mut last = None;
        for (host, port) in &self.url.sentinels {
            let res = async {
                let mut c = self.connect(&self.url.sentinel_url(host, *port)).await?;
                redis::cmd("SENTINEL")
                    .arg("get-master-addr-by-name")
                    .arg(&self.url.master)
                    .query_async::<Option<(String, u16)>>(&mut c)
                    .await
            }
            .await;
            match res {
                Ok(Some(addr)) => return Ok(addr),
                Ok(None) => {
                    last = Some(RedisError::from((
                        redis::ErrorKind::InvalidClientConfig,
                        "sentinel does not know the master",
                        format!("{host}:{port} knows no master named {:?}", self.url.master),
                    )))
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.expect("a sentinel URL names at least one sentinel"))
    }

    /// The primary's `host:port` and a client for it, once `ROLE` there says "master".
    pub async fn primary(&self) -> RedisResult<(String, redis::Client)> {
        let (host, port) = self.ask().await?;
        self.primary_at(&host, port).await
    }

    /// `host:port` and a client for it, if `ROLE` there says "master" (the address a
    /// `+switch-master` notice named, or one a sentinel gave).
    pub async fn primary_at(&self, host: &str, port: u16) -> RedisResult<(String, redis::Client)> {
        let url = self.url.server_url(host, port);
        let mut c = self.connect(&url).await?;
        let role: Vec<redis::Value> = redis::cmd("ROLE").query_async(&mut c).await?;
        let role = match role.first() {
            Some(redis::Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
            Some(redis::Value::SimpleString(s)) => s.clone(),
            _ => String::new(),
        };
        if role != "master" {
            return Err(RedisError::from((
                redis::ErrorKind::Io,
                "the server the sentinels name is not a primary (yet)",
                format!("{host}:{port} says its role is {role:?}"),
            )));
        }
        Ok((
            format!("{}:{port}", bracket(host)),
            crate::connections::redis_client::plain_client(&url)?,
        ))
    }

    /// Subscribe to `+switch-master` on one sentinel after another; `notify` runs for every
    /// notice about our master, with the new primary's address it names. Returns only if
    /// `notify` says to stop (its owner is gone).
    pub async fn watch(&self, mut notify: impl FnMut(Option<(String, u16)>) -> bool) {
        let mut backoff = Backoff::new();
        loop {
            for (host, port) in &self.url.sentinels {
                let url = self.url.sentinel_url(host, *port);
                let sub = async {
                    let client = crate::connections::redis_client::plain_client(&url)?;
                    let mut ps = tokio::time::timeout(self.timeout, client.get_async_pubsub())
                        .await
                        .map_err(|_| {
                            RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut))
                        })??;
                    ps.subscribe("+switch-master").await?;
                    Ok::<_, RedisError>(ps)
                }
                .await;
                let Ok(mut ps) = sub else { continue };
                backoff.reset();
                let mut msgs = ps.on_message();
                while let Some(msg) = msgs.next().await {
                    let text = String::from_utf8_lossy(msg.get_payload_bytes()).into_owned();
                    // "<master> <old ip> <old port> <new ip> <new port>"
                    let f: Vec<&str> = text.split(' ').collect();
                    if f.first() == Some(&self.url.master.as_str()) {
                        tracing::warn!(notice = %text, "Redis Sentinel: +switch-master");
                        let to = match (f.get(3), f.get(4).and_then(|p| p.parse().ok())) {
                            (Some(h), Some(p)) => Some((h.to_string(), p)),
                            _ => None,
                        };
                        if !notify(to) {
                            return;
                        }
                    }
                }
            }
            tokio::time::sleep(backoff.pause()).await;
        }
    }
}

/// Jittered exponential backoff, 50 ms doubling up to 1 s (each pause drawn from the upper
/// half of the step, so a fleet does not ask the sentinels in lockstep).
pub struct Backoff {
    step: Duration,
}

impl Backoff {
    const FIRST: Duration = Duration::from_millis(50);
    const MAX: Duration = Duration::from_secs(1);

    pub fn new() -> Backoff {
        Backoff { step: Self::FIRST }
    }

    pub fn reset(&mut self) {
        self.step = Self::FIRST;
    }

    pub fn pause(&mut self) -> Duration {
        let ms = self.step.as_millis() as u64;
        let pause = Duration::from_millis(ms / 2 + rand::random_range(0..=ms / 2));
        self.step = (self.step * 2).min(Self::MAX);
        pause
    }
}

impl Default for Backoff {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_lettuce_form() {
        let u =
            SentinelUrl::parse("redis-sentinel://:p%40ss@h1,h2:26380,[::1]:5/3#mymaster").unwrap();
        assert_eq!(
            u.sentinels,
            vec![
                ("h1".into(), 26379),
                ("h2".into(), 26380),
                ("::1".into(), 5)
            ]
        );
        assert_eq!((u.master.as_str(), u.db, u.tls), ("mymaster", 3, false));
        assert_eq!(
            (u.username.as_deref(), u.password.as_deref()),
            (None, Some("p@ss"))
        );
        assert_eq!(
            u.server_url("10.0.0.1", 6379),
            "redis://:p%40ss@10.0.0.1:6379/3"
        );
        let t = SentinelUrl::parse("rediss-sentinel://app:pw@s1#m").unwrap();
        assert!(t.tls);
        assert_eq!(t.server_url("h", 1), "rediss://app:pw@h:1/0");
        assert!(SentinelUrl::parse("redis-sentinel://h1").is_err());
        assert!(SentinelUrl::parse("redis-sentinel://h1:x#m").is_err());
        assert!(SentinelUrl::parse("redis-sentinel://h1/#").is_err());
    }

    #[test]
    fn backoff_is_bounded_and_jittered() {
        let mut b = Backoff::new();
        let pauses: Vec<_> = (0..10).map(|_| b.pause()).collect();
        assert!(pauses[0] >= Duration::from_millis(25) && pauses[0] <= Duration::from_millis(50));
        assert!(pauses.iter().all(|p| *p <= Backoff::MAX));
        assert!(pauses[9] >= Backoff::MAX / 2);
    }
}

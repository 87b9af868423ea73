//! Failure events to Sentry (or any service that speaks its protocol), through the `sentry`
//! crate's own client: on when `SENTRY_DSN` is set, with `SENTRY_ENVIRONMENT` and
//! `SENTRY_RELEASE` read as sentry-ruby reads them (without `SENTRY_RELEASE`, the release it
//! would find, and the server's name as it gives it: `deploy.rs`). An event carries what
//! sentry-sidekiq gives a job's error (tests/sentry_parity.rs compares the two field by
//! field): the transaction `Sidekiq/<Class>`, tags `queue` and `jid` (and `sidekiq.<tag>` for
//! the payload's `tags`), the payload's `sentry_user` as the user, the exception's module,
//! the `sidekiq` context (a failed run's payload as fetched, with `context` and its queue),
//! plus playguard's own: the event (`failure`, `death`, `poison`, `lock_lost`), the phase,
//! the command's last stderr lines. `args` (and the raw `jobstr`) leave only for classes
//! whose manifest entry says `report_args = true`. Grouped by class and error class (the
//! fingerprint: there is no stack trace to group by). The crate sends from a thread of its
//! own and drops what it cannot queue: a capture never blocks. Touches no Redis keys.

use crate::job::report::{Kind, Report};
use crate::report::limit::{Limiter, Verdict};
use sentry::protocol::{Context, Event, Exception, Level, Map, Value};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// stderr lines an event carries at most.
const STDERR_LINES: usize = 20;
/// How long a clean stop waits for queued events to leave.
pub const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one request to Sentry may take, connection included: past it that event is lost
/// and the sending thread goes on with the next.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The Sentry side of a worker: its client, the rate limit, who opted in to `args`.
pub struct SentryOut {
    client: Arc<sentry::Client>,
    limiter: Limiter,
    report_args: HashSet<String>,
}

/// What the environment asks for: None without `SENTRY_DSN` (or with an empty one); an error
/// (a configuration error, exit 2) for a DSN that does not parse. The DSN's key never reaches
/// a log line: only its host and project are shown.
pub fn from_env(report_args: HashSet<String>) -> Result<Option<SentryOut>, String> {
    let Some(dsn) = std::env::var("SENTRY_DSN")
        .ok()
        .filter(|d| !d.trim().is_empty())
    else {
        return Ok(None);
    };
    let dsn: sentry::types::Dsn = dsn
        .trim()
        .parse()
        .map_err(|e| format!("SENTRY_DSN does not parse as a Sentry DSN: {e}"))?;
    let shown = format!("{}://{}/{}", dsn.scheme(), dsn.host(), dsn.project_id());
    let environment = environment();
    let root = std::env::current_dir().unwrap_or_else(|_| ".".into());
    let release = crate::report::deploy::detect(&root);
    let mut opts = sentry::ClientOptions::default();
    opts.dsn = Some(dsn);
    opts.environment = Some(environment.clone().into());
    opts.release = release.clone().map(Into::into);
    opts.server_name = Some(crate::report::deploy::server_name().into());
    opts.default_integrations = false;
    opts.shutdown_timeout = FLUSH_TIMEOUT;
    opts.transport = Some(Arc::new(TimedUreq));
    let client = Arc::new(sentry::Client::from(sentry::apply_defaults(opts)));
    // Never dropped: dropping the client joins its sending thread, which may be inside a
    // request (up to REQUEST_TIMEOUT per queued event); the process's exit must not wait for
    // that. What is queued is flushed at a clean stop, within FLUSH_TIMEOUT (`flush`).
    std::mem::forget(client.clone());
    tracing::info!(sentry = %shown, environment = %environment, release = release.as_deref().unwrap_or("-"),
        "failures are reported to Sentry");
    Ok(Some(SentryOut {
        client,
        limiter: Limiter::new(crate::report::limit::INTERVAL),
        report_args,
    }))
}

/// The crate's ureq transport with our own agent: rustls (ring), and REQUEST_TIMEOUT on every
/// request.
struct TimedUreq;

impl sentry::TransportFactory for TimedUreq {
    fn create_transport_with_options(
        &self,
        options: sentry::TransportOptions,
    ) -> Arc<dyn sentry::Transport> {
        let tls = ureq::tls::TlsConfig::builder()
            .provider(ureq::tls::TlsProvider::Rustls)
            .build();
        let agent = ureq::Agent::config_builder()
            .tls_config(tls)
            .timeout_global(Some(REQUEST_TIMEOUT))
            .build()
            .new_agent();
        Arc::new(
            sentry::transports::UreqHttpTransportOptions::from(options)
                .with_agent(agent)
                .build(),
        )
    }
}

/// sentry-ruby's order: SENTRY_CURRENT_ENV, SENTRY_ENVIRONMENT, RAILS_ENV, RACK_ENV, else
/// "development".
fn environment() -> String {
    [
        "SENTRY_CURRENT_ENV",
        "SENTRY_ENVIRONMENT",
        "RAILS_ENV",
        "RACK_ENV",
    ]
    .iter()
    .find_map(|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
    .unwrap_or_else(|| "development".to_string())
}

/// The event tag of a report: a failed run that killed its job is a death.
pub fn event_name(r: &Report) -> &'static str {
    match (r.kind, r.died) {
        (Kind::Failure, true) => "death",
        (kind, _) => kind.as_str(),
    }
}

/// The class a report is about: ActiveJob's `wrapped`, else the payload's `class`.
pub fn class_of(job: &Value) -> String {
    named_class(job).unwrap_or("unknown").to_string()
}

/// ActiveJob's `wrapped`, else the payload's `class`, if it names one.
fn named_class(job: &Value) -> Option<&str> {
    let s = |k: &str| job.get(k).and_then(Value::as_str);
    s("wrapped").or(s("class"))
}

impl SentryOut {
    /// Send the report's event, unless its (event, class, error class) already sent one in
    /// this interval: then it is counted. Returns whether it was sent.
    pub fn send(&self, r: &Report, job: &Value) -> bool {
        let event = event_name(r);
        let class = class_of(job);
        let key = (event, class.clone(), r.error.class.clone());
        match self.limiter.check(key, Instant::now()) {
            Verdict::Suppress { first } => {
                if first {
                    tracing::warn!(event, class = %class, error_class = %r.error.class,
                        "Sentry: more {event} events of this class and error within {}s are counted, not sent",
                        crate::report::limit::INTERVAL.as_secs());
                }
                false
            }
            Verdict::Send { suppressed } => {
                if suppressed > 0 {
                    tracing::info!(event, class = %class, error_class = %r.error.class, suppressed,
                        "Sentry: events held back by the rate limit since the last one sent");
                }
                let ev = self.event(r, job, &class, suppressed);
                self.client.capture_event(ev, None);
                true
            }
        }
    }

    /// The event, field by field.
    fn event(&self, r: &Report, job: &Value, class: &str, suppressed: u64) -> Event<'static> {
        let event = event_name(r);
        let mut ev = Event::new();
        ev.level = Level::Error;
        // sentry-sidekiq's name; the bare `Sidekiq` when no class is named (a payload that
        // is not a job).
        ev.transaction = Some(match named_class(job) {
            Some(c) => format!("Sidekiq/{c}"),
            None => "Sidekiq".to_string(),
        });
        ev.fingerprint = vec![class.to_string().into(), r.error.class.clone().into()].into();
        ev.logger = Some("playguard".into());
        ev.exception = vec![Exception {
            ty: r.error.class.clone(),
            value: Some(r.error.message.clone()),
            // As sentry-ruby: the class's namespace.
            module: r.error.class.rsplit_once("::").map(|(m, _)| m.to_string()),
            ..Default::default()
        }]
        .into();
        ev.tags = tags(r, job, event);
        ev.user = user(job);
        ev.contexts.insert(
            "sidekiq".into(),
            Context::Other(self.sidekiq_context(r, job, class)),
        );
        ev.contexts.insert(
            "playguard".into(),
            Context::Other(playguard_context(r, event)),
        );
        ev.extra
            .insert("suppressed".into(), Value::from(suppressed));
        ev
    }

    /// The payload with its queue, as sentry-sidekiq's context: for a failed run, the payload
    /// as fetched with the `context` and `jobstr` Sidekiq gives its error handlers
    /// (processor.rb); `args` and `jobstr` only if opted in; ActiveJob's `_aj_` key prefixes
    /// taken off, as sentry-sidekiq does.
    fn sidekiq_context(&self, r: &Report, job: &Value, class: &str) -> Map<String, Value> {
        let mut ctx: Map<String, Value> = match without_aj_prefix(job) {
            Value::Object(m) => m.into_iter().collect(),
            other => Map::from([("payload".to_string(), other)]),
        };
        let open = self.report_args.contains(class);
        if !open {
            ctx.remove("args");
        }
        if let Some(fetched) = &r.fetched {
            ctx.insert("context".into(), Value::from("Job raised exception"));
            if open {
                ctx.insert("jobstr".into(), Value::from(&**fetched));
            }
        }
        ctx.insert("queue".into(), Value::from(&*r.queue));
        ctx
    }

    /// Send what is queued, for up to FLUSH_TIMEOUT; whether all of it left. The crate's flush
    /// blocks (and may block past its timeout while its queue is full), so it runs on a thread
    /// of its own that nothing joins: neither the runtime nor the exit waits for it.
    pub async fn flush(&self) -> bool {
        let client = self.client.clone();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let spawned = std::thread::Builder::new()
            .name("sentry-flush".into())
            .spawn(move || {
                let _ = tx.send(client.flush(Some(FLUSH_TIMEOUT)));
            });
        if spawned.is_err() {
            return false;
        }
        let wait = FLUSH_TIMEOUT + Duration::from_secs(1);
        matches!(tokio::time::timeout(wait, rx).await, Ok(Ok(true)))
    }
}

/// `queue`, `jid` (as sentry-sidekiq), `sidekiq.<tag>` per payload tag, and `event`, `class`,
/// `phase` (playguard's) for a team to filter on.
fn tags(r: &Report, job: &Value, event: &str) -> Map<String, String> {
    let mut tags = Map::new();
    tags.insert("queue".into(), r.queue.to_string());
    if let Some(jid) = job.get("jid").and_then(Value::as_str) {
        tags.insert("jid".into(), jid.to_string());
    }
    for t in job
        .get("tags")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        if let Some(t) = t.as_str() {
            tags.insert(format!("sidekiq.{t}"), "true".into());
        }
    }
    tags.insert("event".into(), event.to_string());
    tags.insert("class".into(), class_of(job));
    if let Some(p) = &r.phase {
        tags.insert("phase".into(), p.clone());
    }
    tags
}

/// `v` with every object key's leading `_aj_` taken off (`_aj_symbol_keys` is shown as
/// `symbol_keys`): sentry-sidekiq shows ActiveJob's reserved keys so, and a user who searches
/// an event for them finds them under the same names.
fn without_aj_prefix(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.iter()
                .map(|(k, v)| {
                    let k = k.strip_prefix("_aj_").unwrap_or(k);
                    (k.to_string(), without_aj_prefix(v))
                })
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.iter().map(without_aj_prefix).collect()),
        other => other.clone(),
    }
}

/// The payload's `sentry_user` (sentry-sidekiq's client middleware puts the enqueuing
/// request's user there), as sentry-sidekiq's server middleware sets it on the scope. An
/// app's `Sentry.set_user(id: user.id)` makes a numeric id: kept, as the string Sentry stores.
fn user(job: &Value) -> Option<sentry::protocol::User> {
    let Value::Object(m) = job.get("sentry_user")? else {
        return None;
    };
    let mut u = sentry::protocol::User::default();
    for (k, v) in m {
        let text = match v {
            Value::String(s) => Some(s.clone()),
            Value::Number(n) => Some(n.to_string()),
            _ => None,
        };
        match k.as_str() {
            "id" => u.id = text,
            "email" => u.email = text,
            "username" => u.username = text,
            "ip_address" => u.ip_address = text.and_then(|t| t.parse().ok()),
            _ => {
                u.other.insert(k.clone(), v.clone());
            }
        }
    }
    Some(u)
}

/// The event, the phase and the command's last stderr lines (oldest first).
fn playguard_context(r: &Report, event: &str) -> Map<String, Value> {
    let mut ctx = Map::new();
    ctx.insert("event".into(), Value::from(event));
    if let Some(p) = &r.phase {
        ctx.insert("phase".into(), Value::from(p.as_str()));
    }
    if !r.error.backtrace.is_empty() {
        // The failure keeps stderr's last line first (Sidekiq's backtrace order).
        let mut lines: Vec<&String> = r.error.backtrace.iter().take(STDERR_LINES).collect();
        lines.reverse();
        ctx.insert("stderr".into(), serde_json::json!(lines));
    }
    ctx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_payloads_sentry_user_is_the_events_user() {
        let job = serde_json::json!({"sentry_user": {"id": 42, "email": "a@example.com",
            "ip_address": "10.0.0.1", "segment": "pro"}});
        let u = user(&job).unwrap();
        assert_eq!(u.id.as_deref(), Some("42"));
        assert_eq!(u.email.as_deref(), Some("a@example.com"));
        assert_eq!(u.ip_address.unwrap().to_string(), "10.0.0.1");
        assert_eq!(u.other["segment"], "pro");
        assert!(user(&serde_json::json!({"sentry_user": "x"})).is_none());
        assert!(user(&serde_json::json!({"class": "X"})).is_none());
    }

    #[test]
    fn activejobs_reserved_key_prefix_is_taken_off_at_every_depth() {
        let job = serde_json::json!({"_aj_top": 1, "args": [{"arguments": [{"_aj_globalid":
            "gid://app/M/7"}, {"mode": "x", "_aj_symbol_keys": ["mode"]}]}], "a_aj_": 2});
        assert_eq!(
            without_aj_prefix(&job),
            serde_json::json!({"top": 1, "args": [{"arguments": [{"globalid": "gid://app/M/7"},
                {"mode": "x", "symbol_keys": ["mode"]}]}], "a_aj_": 2})
        );
    }
}

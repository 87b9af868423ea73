//! The entries of a manifest file as they are written: `[[job]]` (with its `lock` and
//! `[[job.phase]]`s), `[[periodic]]` and `[[hook]]`. Touches no Redis keys.

use super::cron;
use serde::Deserialize;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    /// The manifest file this entry came from (for error messages).
    #[serde(skip)]
    pub file: String,
    pub class: String,
    #[serde(default)]
    pub run: Option<Vec<String>>,
    #[serde(default)]
    pub timeout_secs: Option<u64>,
    #[serde(default)]
    pub lock: Option<LockSpec>,
    #[serde(default)]
    pub on_lock_lost: Option<String>,
    /// What Sidekiq's cancel does to a running phase: "boundary" (default) or "kill".
    #[serde(default)]
    pub on_cancel: Option<String>,
    #[serde(default, rename = "phase")]
    pub phases: Vec<PhaseSpec>,
    /// Names of the worker's environment variables its commands get (None = all of them);
    /// the PLAYGUARD_* variables are set either way.
    #[serde(default)]
    pub env: Option<Vec<String>>,
    /// Whether failure events to Sentry carry the job's `args` (they may hold personal data).
    #[serde(default)]
    pub report_args: bool,
    /// Seconds before each retry: a list by retry count, or an expression of `count`.
    #[serde(default)]
    pub retry_in: Option<toml::Value>,
    /// Replaces the payload's `retry` count (as Ruby's `sidekiq_options retry:`).
    #[serde(default)]
    pub max_retries: Option<i64>,
    /// A command run with the job when it dies (`sidekiq_retries_exhausted`), as a `death` hook.
    #[serde(default)]
    pub on_exhausted: Option<Vec<String>>,
    /// `retry_in` and `max_retries`, checked when the manifest is loaded.
    #[serde(skip)]
    pub policy: Option<crate::job::retry_policy::Policy>,
}

/// A `[[hook]]` entry: a command run on a failure event (`report/hooks.rs`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HookSpec {
    /// The manifest file this entry came from (for error messages).
    #[serde(skip)]
    pub file: String,
    pub on: String,
    pub run: Vec<String>,
    #[serde(default)]
    pub timeout_secs: Option<f64>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LockSpec {
    pub key: String,
    #[serde(default = "default_ttl")]
    pub ttl_secs: f64,
    #[serde(default = "default_when_locked")]
    pub when_locked: String,
    /// How logs name what the lock guards, e.g. "Marquee {args.0}" (default: the key).
    #[serde(default)]
    pub label: Option<String>,
    /// Where fences come from: "redis" (default) or "database" (needs a database URL).
    #[serde(default)]
    pub fence: Option<String>,
}

impl LockSpec {
    /// The validated `fence` setting.
    pub fn fence_source(&self) -> crate::cycle::fences::FenceSource {
        self.fence
            .as_deref()
            .and_then(|f| crate::cycle::fences::FenceSource::parse(f).ok())
            .unwrap_or_default()
    }
}

fn default_ttl() -> f64 {
    900.0
}

fn default_when_locked() -> String {
    "skip".into()
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PhaseSpec {
    pub name: String,
    pub run: Vec<String>,
    #[serde(default)]
    pub timeout_secs: Option<f64>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeriodicSpec {
    pub name: String,
    /// Every this many seconds, on wall-clock multiples; or `cron` (with `tz`), not both.
    #[serde(default)]
    pub every_secs: Option<u64>,
    /// A cron line (`cron.rs`), run in the zone `tz` (default UTC).
    #[serde(default)]
    pub cron: Option<String>,
    #[serde(default)]
    pub tz: Option<String>,
    /// `cron` and `tz`, parsed when the manifest is loaded.
    #[serde(skip)]
    pub schedule: Option<cron::CronSchedule>,
    pub class: String,
    #[serde(default = "default_queue")]
    pub queue: String,
    #[serde(default)]
    pub for_each_member_of: Option<String>,
    /// Fixed arguments when there is no set to fan out over.
    #[serde(default)]
    pub args: Vec<toml::Value>,
    #[serde(default)]
    pub retry: Option<toml::Value>,
}

fn default_queue() -> String {
    "default".into()
}

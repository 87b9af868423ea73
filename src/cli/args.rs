//! The command line's shape as clap reads it: the subcommands and their flags, with the
//! environment variables that stand in for them. Touches no Redis keys.

use crate::fetch::FetchMode;
use crate::logging::LogFormat;
use crate::metrics::sidekiq_tab::Mode as SidekiqMetrics;
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "playguard",
    version,
    about = "A Sidekiq-compatible background worker",
    args_conflicts_with_subcommands = true
)]
pub(super) struct Cli {
    #[command(subcommand)]
    pub(super) cmd: Option<Cmd>,
    #[command(flatten)]
    pub(super) run: RunArgs,
}

#[derive(Subcommand)]
pub(super) enum Cmd {
    /// Run the worker (the default).
    Run(RunArgs),
    /// Push a job as the Sidekiq client would.
    Enqueue(EnqueueArgs),
    /// Validate the manifests and reach Redis (and PostgreSQL when a database URL is set).
    Check(CheckArgs),
    /// Database helpers: `playguard db schema` prints the SQL of playguard's tables.
    #[command(subcommand)]
    Db(DbCmd),
    /// List the locks workers hold: key, label, holder, jid, phase, held, left, fence.
    Locks(LocksArgs),
    /// List recent cycles from the ledger (PostgreSQL), or the running ones Redis knows.
    Cycles(CyclesArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    #[command(hide = true)]
    Completions { shell: clap_complete::Shell },
    /// Print the man page (roff), or write one page per command into DIR.
    #[command(hide = true)]
    Man { dir: Option<PathBuf> },
}

#[derive(Subcommand)]
pub(super) enum DbCmd {
    /// Print the CREATE TABLE statements of playguard_fences and playguard_cycles.
    Schema,
}

/// `--database-url`, shared by `run` and `check`. The env value is never shown in --help.
#[derive(Args, Clone, Default)]
pub(super) struct DatabaseUrl {
    /// PostgreSQL URL (postgres://user:password@host/db?sslmode=require, any libpq sslmode):
    /// fences for `fence = "database"` locks and the cycle ledger.
    #[arg(long = "database-url", env = "DATABASE_URL", hide_env_values = true)]
    pub(super) database_url: Option<String>,
}

/// `-r`, shared by every subcommand.
#[derive(Args, Clone, Default)]
pub(super) struct RedisUrl {
    /// Redis URL (redis://, rediss://, user:password@, /db).
    #[arg(
        short = 'r',
        long = "redis",
        env = "REDIS_URL",
        // The environment's value may hold a password: never show it in --help.
        hide_env_values = true,
        default_value = "redis://127.0.0.1:6379/0"
    )]
    pub(super) url: String,
}

#[derive(Args, Clone, Default)]
pub(super) struct RunArgs {
    #[command(flatten)]
    pub(super) redis: RedisUrl,
    #[command(flatten)]
    pub(super) database: DatabaseUrl,
    /// Queue to process, optionally with a weight: -q critical,3 -q default. Repeatable.
    #[arg(short = 'q', long = "queue")]
    pub(super) queues: Vec<String>,
    /// Concurrency (jobs at once). Default 5, as Sidekiq 7.
    #[arg(short = 'c', long)]
    pub(super) concurrency: Option<usize>,
    /// Shutdown timeout in seconds. Default 25.
    #[arg(short = 't', long)]
    pub(super) timeout: Option<f64>,
    /// Sidekiq YAML config (default: config/sidekiq.yml when present).
    #[arg(short = 'C', long = "config")]
    pub(super) config: Option<PathBuf>,
    /// Job manifest folder.
    #[arg(short = 'j', long = "jobs", default_value = "jobs")]
    pub(super) jobs: PathBuf,
    /// Environment (else APP_ENV, RAILS_ENV, RACK_ENV, development); picks the YAML section.
    #[arg(short = 'e', long = "environment")]
    pub(super) environment: Option<String>,
    /// Process tag shown on the Busy page.
    #[arg(short = 'g', long)]
    pub(super) tag: Option<String>,
    /// text or json.
    #[arg(long = "log-format", value_enum, default_value_t = LogFormat::Text)]
    pub(super) log_format: LogFormat,
    /// reliable (default: nothing is lost on SIGKILL) or basic (Sidekiq OSS BRPOP).
    #[arg(long, value_enum, default_value_t = FetchMode::Reliable)]
    pub(super) fetch: FetchMode,
    /// Average scheduled-poll interval in seconds (Sidekiq's average_scheduled_poll_interval).
    #[arg(long = "poll-interval")]
    pub(super) poll_interval: Option<f64>,
    /// Payloads longer than this many bytes go to the dead set unparsed. Default 10 MB.
    #[arg(long = "max-payload-bytes")]
    pub(super) max_payload_bytes: Option<usize>,
    /// A job interrupted by shutdown more than N times goes to dead. Default 3.
    #[arg(long = "max-interruptions")]
    pub(super) max_interruptions: Option<u32>,
    /// Serve Prometheus /metrics, /health and /ready here, e.g. 127.0.0.1:9394.
    #[arg(long = "metrics-addr")]
    pub(super) metrics_addr: Option<std::net::SocketAddr>,
    /// Write the Metrics-tab keys of Sidekiq 7.x, 8.x, both (default) or none (off).
    #[arg(long = "sidekiq-metrics", value_enum, default_value_t = SidekiqMetrics::Both)]
    pub(super) sidekiq_metrics: SidekiqMetrics,
    /// Run reliable fetch even when Redis's maxmemory-policy may evict keys (a WARN instead of
    /// a refused start; see docs/operations.md).
    #[arg(long = "allow-eviction")]
    pub(super) allow_eviction: bool,
    /// Enqueue the schedule sidekiq-cron keeps in Redis, as the gem's poller does.
    #[arg(long = "sidekiq-cron")]
    pub(super) sidekiq_cron: bool,
}

#[derive(Args)]
pub(super) struct EnqueueArgs {
    /// The Sidekiq class name.
    pub(super) class: String,
    /// Arguments, each a JSON value (a bare word is taken as a string; -5 is a number).
    #[arg(allow_negative_numbers = true)]
    pub(super) args: Vec<String>,
    #[command(flatten)]
    pub(super) redis: RedisUrl,
    #[arg(long, default_value = "default")]
    pub(super) queue: String,
    /// Run in this many seconds (goes to the schedule set).
    #[arg(long = "in")]
    pub(super) in_secs: Option<f64>,
    /// N, true or false.
    #[arg(long)]
    pub(super) retry: Option<String>,
}

#[derive(Args)]
pub(super) struct CheckArgs {
    #[arg(short = 'j', long = "jobs", default_value = "jobs")]
    pub(super) jobs: PathBuf,
    #[command(flatten)]
    pub(super) redis: RedisUrl,
    #[command(flatten)]
    pub(super) database: DatabaseUrl,
}

#[derive(Args)]
pub(super) struct LocksArgs {
    #[command(flatten)]
    pub(super) redis: RedisUrl,
    /// With it, the fence shown is the running cycle's ledger fence.
    #[command(flatten)]
    pub(super) database: DatabaseUrl,
    /// One JSON array instead of the table.
    #[arg(long)]
    pub(super) json: bool,
}

#[derive(Args)]
pub(super) struct CyclesArgs {
    #[command(flatten)]
    pub(super) redis: RedisUrl,
    #[command(flatten)]
    pub(super) database: DatabaseUrl,
    /// Only the cycles of this lock key.
    #[arg(long)]
    pub(super) key: Option<String>,
    /// At most this many cycles, newest first.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub(super) limit: u32,
    /// One JSON array instead of the table.
    #[arg(long)]
    pub(super) json: bool,
}

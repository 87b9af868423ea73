//! The command line, with Sidekiq's habits: `playguard [run]`, `playguard enqueue`,
//! `playguard check`, and the hidden `completions` and `man` the package is built with
//! (`generate.rs`). Flags win over `-C config/sidekiq.yml`, which wins over Sidekiq 7's
//! defaults. A configuration error is one clear line and a non-zero exit.

use crate::fetch::FetchMode;
use crate::job::handler::Registry;
use crate::logging::LogFormat;
use crate::manifest::jobs as manifest_jobs;
use crate::metrics::sidekiq_tab::Mode as SidekiqMetrics;
use crate::worker::config::{self, Config};
use crate::worker::error::{
    database_error, open_redis, parse_database, redis_version, report, StartError,
};
use clap::{Args, CommandFactory, Parser, Subcommand};

mod check;
mod enqueue;
mod generate;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "playguard",
    version,
    about = "A Sidekiq-compatible background worker",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Subcommand)]
enum Cmd {
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
enum DbCmd {
    /// Print the CREATE TABLE statements of playguard_fences and playguard_cycles.
    Schema,
}

/// `--database-url`, shared by `run` and `check`. The env value is never shown in --help.
#[derive(Args, Clone, Default)]
struct DatabaseUrl {
    /// PostgreSQL URL (postgres://user:password@host/db?sslmode=require, any libpq sslmode):
    /// fences for `fence = "database"` locks and the cycle ledger.
    #[arg(long = "database-url", env = "DATABASE_URL", hide_env_values = true)]
    database_url: Option<String>,
}

/// `-r`, shared by every subcommand.
#[derive(Args, Clone, Default)]
struct RedisUrl {
    /// Redis URL (redis://, rediss://, user:password@, /db).
    #[arg(
        short = 'r',
        long = "redis",
        env = "REDIS_URL",
        // The environment's value may hold a password: never show it in --help.
        hide_env_values = true,
        default_value = "redis://127.0.0.1:6379/0"
    )]
    url: String,
}

#[derive(Args, Clone, Default)]
struct RunArgs {
    #[command(flatten)]
    redis: RedisUrl,
    #[command(flatten)]
    database: DatabaseUrl,
    /// Queue to process, optionally with a weight: -q critical,3 -q default. Repeatable.
    #[arg(short = 'q', long = "queue")]
    queues: Vec<String>,
    /// Concurrency (jobs at once). Default 5, as Sidekiq 7.
    #[arg(short = 'c', long)]
    concurrency: Option<usize>,
    /// Shutdown timeout in seconds. Default 25.
    #[arg(short = 't', long)]
    timeout: Option<f64>,
    /// Sidekiq YAML config (default: config/sidekiq.yml when present).
    #[arg(short = 'C', long = "config")]
    config: Option<PathBuf>,
    /// Job manifest folder.
    #[arg(short = 'j', long = "jobs", default_value = "jobs")]
    jobs: PathBuf,
    /// Environment (else APP_ENV, RAILS_ENV, RACK_ENV, development); picks the YAML section.
    #[arg(short = 'e', long = "environment")]
    environment: Option<String>,
    /// Process tag shown on the Busy page.
    #[arg(short = 'g', long)]
    tag: Option<String>,
    /// text or json.
    #[arg(long = "log-format", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// reliable (default: nothing is lost on SIGKILL) or basic (Sidekiq OSS BRPOP).
    #[arg(long, value_enum, default_value_t = FetchMode::Reliable)]
    fetch: FetchMode,
    /// Average scheduled-poll interval in seconds (Sidekiq's average_scheduled_poll_interval).
    #[arg(long = "poll-interval")]
    poll_interval: Option<f64>,
    /// Payloads longer than this many bytes go to the dead set unparsed. Default 10 MB.
    #[arg(long = "max-payload-bytes")]
    max_payload_bytes: Option<usize>,
    /// A job interrupted by shutdown more than N times goes to dead. Default 3.
    #[arg(long = "max-interruptions")]
    max_interruptions: Option<u32>,
    /// Serve Prometheus /metrics, /health and /ready here, e.g. 127.0.0.1:9394.
    #[arg(long = "metrics-addr")]
    metrics_addr: Option<std::net::SocketAddr>,
    /// Write the Metrics-tab keys of Sidekiq 7.x, 8.x, both (default) or none (off).
    #[arg(long = "sidekiq-metrics", value_enum, default_value_t = SidekiqMetrics::Both)]
    sidekiq_metrics: SidekiqMetrics,
    /// Run reliable fetch even when Redis's maxmemory-policy may evict keys (a WARN instead of
    /// a refused start; see docs/operations.md).
    #[arg(long = "allow-eviction")]
    allow_eviction: bool,
    /// Enqueue the schedule sidekiq-cron keeps in Redis, as the gem's poller does.
    #[arg(long = "sidekiq-cron")]
    sidekiq_cron: bool,
}

#[derive(Args)]
struct EnqueueArgs {
    /// The Sidekiq class name.
    class: String,
    /// Arguments, each a JSON value (a bare word is taken as a string; -5 is a number).
    #[arg(allow_negative_numbers = true)]
    args: Vec<String>,
    #[command(flatten)]
    redis: RedisUrl,
    #[arg(long, default_value = "default")]
    queue: String,
    /// Run in this many seconds (goes to the schedule set).
    #[arg(long = "in")]
    in_secs: Option<f64>,
    /// N, true or false.
    #[arg(long)]
    retry: Option<String>,
}

#[derive(Args)]
struct CheckArgs {
    #[arg(short = 'j', long = "jobs", default_value = "jobs")]
    jobs: PathBuf,
    #[command(flatten)]
    redis: RedisUrl,
    #[command(flatten)]
    database: DatabaseUrl,
}

#[derive(Args)]
struct LocksArgs {
    #[command(flatten)]
    redis: RedisUrl,
    /// With it, the fence shown is the running cycle's ledger fence.
    #[command(flatten)]
    database: DatabaseUrl,
    /// One JSON array instead of the table.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct CyclesArgs {
    #[command(flatten)]
    redis: RedisUrl,
    #[command(flatten)]
    database: DatabaseUrl,
    /// Only the cycles of this lock key.
    #[arg(long)]
    key: Option<String>,
    /// At most this many cycles, newest first.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    limit: u32,
    /// One JSON array instead of the table.
    #[arg(long)]
    json: bool,
}

fn environment(flag: Option<String>) -> String {
    flag.or_else(|| {
        ["APP_ENV", "RAILS_ENV", "RACK_ENV"]
            .iter()
            .find_map(|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
    })
    .unwrap_or_else(|| "development".into())
}

fn build_config(a: RunArgs) -> Result<(Config, LogFormat), String> {
    let mut c = Config {
        redis_url: a.redis.url,
        env: environment(a.environment),
        jobs_dir: a.jobs,
        fetch: a.fetch,
        metrics_addr: a.metrics_addr,
        sidekiq_metrics: a.sidekiq_metrics,
        database_url: a.database.database_url.filter(|u| !u.is_empty()),
        allow_eviction: a.allow_eviction,
        sidekiq_cron: a.sidekiq_cron,
        ..Config::default()
    };
    let file = match a.config {
        Some(p) => Some(p),
        None => Some(PathBuf::from("config/sidekiq.yml")).filter(|p| p.exists()),
    };
    if let Some(path) = file {
        let f = config::load_file(&path, &c.env).map_err(|e| e.to_string())?;
        f.apply_cron(&mut c);
        if let Some(n) = f.concurrency {
            c.concurrency = n;
        }
        if let Some(t) = f.timeout {
            c.timeout = Duration::from_secs_f64(t.max(0.0));
        }
        if let Some(q) = f.queues {
            if !q.is_empty() {
                c.queues = crate::job::queues::QueueOrder::new(q);
            }
        }
        c.tag = f.tag;
        c.labels = f.labels.unwrap_or_default();
        if let Some(p) = f.poll_interval_average {
            c.poll_interval_average = p;
        }
    }
    if !a.queues.is_empty() {
        c.queues = crate::job::queues::QueueOrder::new(
            a.queues
                .iter()
                .map(|q| config::parse_queue_arg(q))
                .collect::<Result<_, _>>()?,
        );
    }
    if let Some(n) = a.concurrency {
        c.concurrency = n;
    }
    if let Some(n) = a.max_payload_bytes {
        c.max_payload_bytes = n;
    }
    if let Some(n) = a.max_interruptions {
        c.max_interruptions = n;
    }
    if c.concurrency == 0 {
        return Err("concurrency must be at least 1".into());
    }
    if let Some(t) = a.timeout {
        if !(t >= 0.0 && t.is_finite()) {
            return Err(format!("-t {t}: the timeout must be a number of seconds"));
        }
        c.timeout = Duration::from_secs_f64(t);
    }
    if a.tag.is_some() {
        c.tag = a.tag;
    }
    if let Some(p) = a.poll_interval {
        if !(p > 0.0 && p.is_finite()) {
            return Err("--poll-interval must be > 0".into());
        }
        c.poll_interval_average = p;
    }
    Ok((c, a.log_format))
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// Entry point of the binary.
pub fn main() -> i32 {
    main_with(Registry::new())
}

/// Entry point for embedders: the full CLI, with Rust handlers already registered.
pub fn main_with(registry: Registry) -> i32 {
    // This executable also runs as the worker's command guardian: before anything else starts.
    if let Some(code) = crate::commands::guardian::main_if_requested() {
        return code;
    }
    let cli = Cli::parse();
    match cli.cmd {
        None => run(cli.run, registry),
        Some(Cmd::Run(a)) => run(a, registry),
        Some(Cmd::Enqueue(a)) => enqueue::enqueue(a),
        Some(Cmd::Check(a)) => check::check(a, &registry),
        Some(Cmd::Completions { shell }) => generate::completions(Cli::command(), shell),
        Some(Cmd::Man { dir }) => generate::man(Cli::command(), dir.as_deref()),
        Some(Cmd::Db(DbCmd::Schema)) => {
            print!("{}", crate::connections::db::SCHEMA);
            0
        }
        Some(Cmd::Locks(a)) => {
            let db = a.database.database_url.filter(|u| !u.is_empty());
            runtime().block_on(crate::ops::locks::command(
                &a.redis.url,
                db.as_deref(),
                a.json,
            ))
        }
        Some(Cmd::Cycles(a)) => {
            let db = a.database.database_url.filter(|u| !u.is_empty());
            runtime().block_on(crate::ops::cycles::command(
                &a.redis.url,
                db.as_deref(),
                a.key.as_deref(),
                a.limit,
                a.json,
            ))
        }
    }
}

fn run(a: RunArgs, registry: Registry) -> i32 {
    let (config, log_format) = match build_config(a) {
        Ok(c) => c,
        Err(e) => return report(&StartError::Config(e)),
    };
    let _log_guard = crate::logging::init(log_format);
    use tracing::Instrument;
    let fut = crate::launcher::run(config, registry).instrument(crate::logging::root().clone());
    match runtime().block_on(fut) {
        Ok(()) => 0,
        Err(e) => report(&e),
    }
}

//! `playguard run`: the flags laid over `config/sidekiq.yml` laid over Sidekiq 7's defaults,
//! then the launcher. Touches no Redis keys itself (the launcher does).

use super::args::RunArgs;
use crate::job::handler::Registry;
use crate::logging::LogFormat;
use crate::worker::config::{self, Config};
use crate::worker::error::{report, StartError};
use std::path::PathBuf;
use std::time::Duration;

fn environment(flag: Option<String>) -> String {
    flag.or_else(|| {
        ["APP_ENV", "RAILS_ENV", "RACK_ENV"]
            .iter()
            .find_map(|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
    })
    .unwrap_or_else(|| "development".into())
}

pub(super) fn build_config(a: RunArgs) -> Result<(Config, LogFormat), String> {
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

pub(super) fn run(a: RunArgs, registry: Registry) -> i32 {
    let (config, log_format) = match build_config(a) {
        Ok(c) => c,
        Err(e) => return report(&StartError::Config(e)),
    };
    let _log_guard = crate::logging::init(log_format);
    use tracing::Instrument;
    let fut = crate::launcher::run(config, registry).instrument(crate::logging::root().clone());
    match super::runtime().block_on(fut) {
        Ok(()) => 0,
        Err(e) => report(&e),
    }
}

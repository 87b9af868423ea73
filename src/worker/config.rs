//! Worker configuration: Sidekiq 7 defaults, then `config/sidekiq.yml` (the subset playguard
//! understands, after its ERB (`erb.rs`), with its environment section merged over the top
//! level), then flags, which win.
//! Touches no Redis keys.

use crate::job::queues::QueueOrder;
use std::path::{Path, PathBuf};
use std::time::Duration;
use yaml_rust2::{Yaml, YamlLoader};

#[derive(Debug, Clone)]
pub struct Config {
    pub redis_url: String,
    pub queues: QueueOrder,
    pub concurrency: usize,
    /// Shutdown timeout (`-t`, Sidekiq's 25 s).
    pub timeout: Duration,
    pub jobs_dir: PathBuf,
    pub env: String,
    pub tag: Option<String>,
    pub labels: Vec<String>,
    /// `--fetch`: reliable (the default) or basic.
    pub fetch: crate::fetch::FetchMode,
    /// Sidekiq's average_scheduled_poll_interval (seconds).
    pub poll_interval_average: f64,
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// Heartbeat period (Sidekiq 6.4's 5 s; remote signals are read at each beat).
    pub beat_interval: Duration,
    /// Which Sidekiq versions' Metrics-tab keys to write (`--sidekiq-metrics`).
    pub sidekiq_metrics: crate::metrics::sidekiq_tab::Mode,
    /// A fetched payload longer than this is not parsed: it goes to `dead` as is.
    pub max_payload_bytes: usize,
    /// The application's PostgreSQL (`DATABASE_URL` / `--database-url`), if any.
    pub database_url: Option<String>,
    /// `--allow-eviction`: run reliable fetch on a Redis whose maxmemory-policy may evict keys.
    pub allow_eviction: bool,
    /// Shutdown requeues a job gets before it goes to dead (`--max-interruptions`).
    pub max_interruptions: u32,
    /// `--sidekiq-cron` / `sidekiq_cron: true`: fire the gem's schedule (`loops/sidekiq_cron.rs`).
    pub sidekiq_cron: bool,
    /// The gem's `cron_poll_interval` (seconds, 30; 0 turns its poller off).
    pub cron_poll_interval: f64,
    /// The gem's `cron_history_size`: the jid-history entries kept per cron job (10).
    pub cron_history_size: i64,
}

/// Default of `--max-payload-bytes`: far above any job Sidekiq's client writes (its args are
/// meant to be ids), low enough that one bad push cannot make every worker parse gigabytes.
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 10 * 1024 * 1024;

impl Default for Config {
    fn default() -> Self {
        Config {
            redis_url: "redis://127.0.0.1:6379/0".into(),
            queues: QueueOrder::new(vec![("default".into(), 0)]),
            concurrency: 5,
            timeout: Duration::from_secs(25),
            jobs_dir: PathBuf::from("jobs"),
            env: "development".into(),
            tag: None,
            labels: Vec::new(),
            fetch: crate::fetch::FetchMode::Reliable,
            poll_interval_average: 5.0,
            metrics_addr: None,
            beat_interval: Duration::from_secs(5),
            sidekiq_metrics: crate::metrics::sidekiq_tab::Mode::default(),
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
            database_url: None,
            allow_eviction: false,
            max_interruptions: crate::job::interrupted::DEFAULT_MAX_INTERRUPTIONS,
            sidekiq_cron: false,
            cron_poll_interval: 30.0,
            cron_history_size: 10,
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("{file}: {message}")]
pub struct ConfigError {
    pub file: String,
    pub message: String,
}

/// What a sidekiq.yml may set.
#[derive(Debug, Default, Clone)]
pub struct FileConfig {
    pub concurrency: Option<usize>,
    pub timeout: Option<f64>,
    pub queues: Option<Vec<(String, u32)>>,
    pub tag: Option<String>,
    pub labels: Option<Vec<String>>,
    pub poll_interval_average: Option<f64>,
    pub sidekiq_cron: Option<bool>,
    pub cron_poll_interval: Option<f64>,
    pub cron_history_size: Option<i64>,
}

impl FileConfig {
    /// The sidekiq-cron keys, over `c` (the flag `--sidekiq-cron` is set already and stays).
    pub fn apply_cron(&self, c: &mut Config) {
        c.sidekiq_cron |= self.sidekiq_cron.unwrap_or(false);
        c.cron_poll_interval = self.cron_poll_interval.unwrap_or(c.cron_poll_interval);
        c.cron_history_size = self.cron_history_size.unwrap_or(c.cron_history_size);
    }
}

/// Parse `-q name[,weight]`.
pub fn parse_queue_arg(s: &str) -> Result<(String, u32), String> {
    let (name, weight) = match s.split_once(',') {
        Some((n, w)) => (
            n,
            w.trim()
                .parse::<u32>()
                .map_err(|_| format!("queue {s:?}: weight must be a whole number"))?,
        ),
        None => (s, 0),
    };
    let name = name.trim();
    if name.is_empty() {
        return Err(format!("queue {s:?}: empty name"));
    }
    Ok((name.to_string(), weight))
}

fn key<'a>(map: &'a yaml_rust2::yaml::Hash, name: &str) -> Option<&'a Yaml> {
    // Sidekiq symbolizes keys: `concurrency:` and `:concurrency:` mean the same.
    map.get(&Yaml::String(name.to_string()))
        .or_else(|| map.get(&Yaml::String(format!(":{name}"))))
}

fn apply(section: &yaml_rust2::yaml::Hash, out: &mut FileConfig) -> Result<(), String> {
    if let Some(v) = key(section, "concurrency") {
        out.concurrency = Some(
            v.as_i64()
                .filter(|n| *n > 0)
                .ok_or("concurrency must be a positive integer")? as usize,
        );
    }
    if let Some(v) = key(section, "timeout") {
        out.timeout = Some(
            v.as_f64()
                .or_else(|| v.as_i64().map(|i| i as f64))
                .ok_or("timeout must be a number of seconds")?,
        );
    }
    for name in ["average_scheduled_poll_interval", "poll_interval_average"] {
        if let Some(v) = key(section, name) {
            out.poll_interval_average = Some(
                v.as_f64()
                    .or_else(|| v.as_i64().map(|i| i as f64))
                    .ok_or(format!("{name} must be a number"))?,
            );
        }
    }
    if let Some(v) = key(section, "sidekiq_cron") {
        out.sidekiq_cron = Some(v.as_bool().ok_or("sidekiq_cron must be true or false")?);
    }
    if let Some(v) = key(section, "cron_poll_interval") {
        out.cron_poll_interval = Some(
            v.as_f64()
                .or_else(|| v.as_i64().map(|i| i as f64))
                .filter(|s| *s >= 0.0)
                .ok_or("cron_poll_interval must be a number of seconds")?,
        );
    }
    if let Some(v) = key(section, "cron_history_size") {
        out.cron_history_size = Some(
            v.as_i64()
                .ok_or("cron_history_size must be a whole number")?,
        );
    }
    if let Some(v) = key(section, "tag") {
        out.tag = v.as_str().map(str::to_string);
    }
    if let Some(Yaml::Array(items)) = key(section, "labels") {
        out.labels = Some(
            items
                .iter()
                .filter_map(|i| i.as_str().map(str::to_string))
                .collect(),
        );
    }
    if let Some(v) = key(section, "queues") {
        let Yaml::Array(items) = v else {
            return Err("queues must be a list".into());
        };
        let mut qs = Vec::new();
        for item in items {
            match item {
                Yaml::String(s) => qs.push(parse_queue_arg(s)?),
                Yaml::Array(pair) => match pair.as_slice() {
                    [Yaml::String(n), w] => {
                        let w = w
                            .as_i64()
                            .filter(|w| *w >= 0)
                            .ok_or_else(|| format!("queue {n:?}: weight must be a whole number"))?;
                        qs.push((n.clone(), w as u32));
                    }
                    [Yaml::String(n)] => qs.push((n.clone(), 0)),
                    _ => return Err("a queue entry must be a name or [name, weight]".into()),
                },
                _ => return Err("a queue entry must be a name or [name, weight]".into()),
            }
        }
        out.queues = Some(qs);
    }
    Ok(())
}

/// Read the sidekiq.yml subset, with the `env` section merged over the top level.
pub fn load_file(path: &Path, env: &str) -> Result<FileConfig, ConfigError> {
    let err = |message: String| ConfigError {
        file: path.display().to_string(),
        message,
    };
    let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
    parse_text(&text, env, &std::env::vars().collect()).map_err(err)
}

/// The file's text to its settings: Sidekiq runs it through ERB before YAML, so its ERB
/// (the ENV subset of `erb.rs`, with `vars` standing for `ENV`) is evaluated first.
pub fn parse_text(
    text: &str,
    env: &str,
    vars: &std::collections::HashMap<String, String>,
) -> Result<FileConfig, String> {
    let text = super::erb::render_with(text, vars).map_err(|e| e.to_string())?;
    let docs = YamlLoader::load_from_str(&text).map_err(|e| e.to_string())?;
    let mut out = FileConfig::default();
    let Some(doc) = docs.first() else {
        return Ok(out);
    };
    let Yaml::Hash(top) = doc else {
        return Err("the top level must be a mapping".into());
    };
    apply(top, &mut out)?;
    if let Some(Yaml::Hash(section)) = key(top, env) {
        apply(section, &mut out).map_err(|m| format!("section {env}: {m}"))?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_section_wins_and_colon_keys_work() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("sidekiq.yml");
        std::fs::write(
            &p,
            ":concurrency: 3\ntimeout: 8\nqueues:\n  - [critical, 3]\n  - default\nproduction:\n  :concurrency: 12\n",
        )
        .unwrap();
        let dev = load_file(&p, "development").unwrap();
        assert_eq!(dev.concurrency, Some(3));
        assert_eq!(dev.timeout, Some(8.0));
        assert_eq!(
            dev.queues.unwrap(),
            vec![("critical".to_string(), 3), ("default".to_string(), 0)]
        );
        assert_eq!(load_file(&p, "production").unwrap().concurrency, Some(12));
    }

    #[test]
    fn sidekiq_cron_keys() {
        let vars = Default::default();
        let text = "sidekiq_cron: true\n:cron_poll_interval: 5\ncron_history_size: 3\n";
        let f = parse_text(text, "development", &vars).unwrap();
        let mut c = Config::default();
        f.apply_cron(&mut c);
        assert_eq!(
            (c.sidekiq_cron, c.cron_poll_interval, c.cron_history_size),
            (true, 5.0, 3)
        );
        assert!(parse_text("sidekiq_cron: yes please\n", "development", &vars).is_err());
        assert!(parse_text("cron_poll_interval: -1\n", "development", &vars).is_err());
    }

    #[test]
    fn queue_args() {
        assert_eq!(parse_queue_arg("low,2").unwrap(), ("low".to_string(), 2));
        assert!(parse_queue_arg("low,x").is_err());
    }
}

//! Job manifests: every `jobs/*.toml` file, parsed and checked before anything starts. An error
//! names the file, the entry and what is wrong. Touches no Redis keys.
//!
//! ```toml
//! [[job]]
//! class = "HardJob"
//! run = ["jobs/bin/hard-job"]      # argv, never a shell string
//! timeout_secs = 60                # optional
//! env = ["PATH", "HOME"]           # optional: the worker's variables it gets (default: all)
//! retry_in = [10, 60, 600]         # optional: or "count ** 4 + 15" (job/retry_policy.rs)
//! max_retries = 5                  # optional: replaces the payload's `retry` count
//! on_exhausted = ["jobs/bin/gave-up"]  # optional: run with the job when it dies
//!
//! [[job]]
//! class = "PlayguardJob"
//! lock = { key = "playguard:marquee:{args.0}", ttl_secs = 900, when_locked = "skip" }
//! on_lock_lost = "abort"
//! [[job.phase]]
//! name = "sync_git"
//! run = ["jobs/bin/sync-git"]
//!
//! [[periodic]]
//! name = "playguard-dispatch"
//! every_secs = 60                 # or: cron = "0 3 * * *" with tz = "Europe/Paris"
//! class = "PlayguardJob"
//! queue = "playguard"
//! for_each_member_of = "playguard:marquees:launchable"
//!
//! [[hook]]
//! on = "death"                     # failure | death | lock_lost | poison
//! run = ["jobs/bin/page-oncall"]   # the event as JSON on stdin (report/hooks.rs)
//! timeout_secs = 30                # optional
//! ```

pub mod cron;
pub mod jobs;
mod validate;

use serde::Deserialize;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use validate::{err, failure_policy, find_program, validate_hook, validate_job, validate_periodic};

#[derive(Debug, thiserror::Error)]
#[error("{file}: {entry}: {message}")]
pub struct ManifestError {
    pub file: String,
    pub entry: String,
    pub message: String,
}

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

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    job: Vec<JobSpec>,
    #[serde(default)]
    periodic: Vec<PeriodicSpec>,
    #[serde(default)]
    hook: Vec<HookSpec>,
}

/// Every job, periodic and hook entry of a manifest folder.
#[derive(Debug, Default, Clone)]
pub struct Manifest {
    pub jobs: Vec<JobSpec>,
    pub periodic: Vec<PeriodicSpec>,
    pub hooks: Vec<HookSpec>,
}

impl Manifest {
    /// Load `dir/*.toml` in name order. A missing folder is an empty manifest (a Rust-only
    /// embedding needs none); anything unreadable or invalid is an error.
    pub fn load(dir: &Path) -> Result<Manifest, ManifestError> {
        let mut m = Manifest::default();
        if !dir.exists() {
            return Ok(m);
        }
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| err(dir, "folder", e.to_string()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "toml"))
            .collect();
        files.sort();
        let mut seen: HashMap<String, String> = HashMap::new();
        for path in files {
            let text =
                std::fs::read_to_string(&path).map_err(|e| err(&path, "file", e.to_string()))?;
            let f: File = toml::from_str(&text)
                .map_err(|e| err(&path, "syntax", e.to_string().trim_end().to_string()))?;
            for (i, mut j) in f.job.into_iter().enumerate() {
                j.file = path.display().to_string();
                let entry = format!("[[job]] #{} (class {:?})", i + 1, j.class);
                validate_job(&j).map_err(|msg| err(&path, &entry, msg))?;
                j.policy = failure_policy(&j).map_err(|msg| err(&path, &entry, msg))?;
                if let Some(prev) = seen.insert(j.class.clone(), path.display().to_string()) {
                    return Err(err(
                        &path,
                        &entry,
                        format!("class {:?} is already defined in {prev}", j.class),
                    ));
                }
                m.jobs.push(j);
            }
            for (i, mut p) in f.periodic.into_iter().enumerate() {
                let entry = format!("[[periodic]] #{} (name {:?})", i + 1, p.name);
                validate_periodic(&mut p).map_err(|msg| err(&path, &entry, msg))?;
                m.periodic.push(p);
            }
            for (i, mut h) in f.hook.into_iter().enumerate() {
                h.file = path.display().to_string();
                let entry = format!("[[hook]] #{} (on {:?})", i + 1, h.on);
                validate_hook(&h).map_err(|msg| err(&path, &entry, msg))?;
                m.hooks.push(h);
            }
        }
        Ok(m)
    }
}

impl Manifest {
    /// Every command a job or phase names must be there to run: a path (relative to the
    /// working directory) to an executable file, or a program found on PATH.
    pub fn check_commands(&self) -> Result<(), ManifestError> {
        for j in &self.jobs {
            let argvs: Vec<(&[String], String)> = match &j.run {
                Some(argv) => vec![(argv.as_slice(), "run".to_string())],
                None => j
                    .phases
                    .iter()
                    .map(|p| (p.run.as_slice(), format!("phase {:?}", p.name)))
                    .collect(),
            };
            let mut argvs = argvs;
            if let Some(argv) = &j.on_exhausted {
                argvs.push((argv.as_slice(), "on_exhausted".to_string()));
            }
            Self::check_programs(&j.file, &format!("[[job]] (class {:?})", j.class), argvs)?;
        }
        for h in &self.hooks {
            let argvs = vec![(h.run.as_slice(), "run".to_string())];
            Self::check_programs(&h.file, &format!("[[hook]] (on {:?})", h.on), argvs)?;
        }
        Ok(())
    }

    fn check_programs(
        file: &str,
        entry: &str,
        argvs: Vec<(&[String], String)>,
    ) -> Result<(), ManifestError> {
        for (argv, what) in argvs {
            let prog = argv.first().map(String::as_str).unwrap_or("");
            if let Err(why) = find_program(prog) {
                return Err(ManifestError {
                    file: file.to_string(),
                    entry: entry.to_string(),
                    message: format!("{what}: {why}"),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str) -> Result<Manifest, ManifestError> {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("a.toml"), text).unwrap();
        Manifest::load(d.path())
    }

    #[test]
    fn parses_phased_and_plain_jobs() {
        let m = load(
            r#"
[[job]]
class = "HardJob"
run = ["bin/x", "--flag"]
[[job]]
class = "PlayguardJob"
lock = { key = "playguard:marquee:{args.0}", ttl_secs = 3 }
on_lock_lost = "abort"
[[job.phase]]
name = "a"
run = ["bin/a"]
[[periodic]]
name = "d"
every_secs = 60
class = "PlayguardJob"
for_each_member_of = "s"
"#,
        )
        .unwrap();
        assert_eq!(m.jobs.len(), 2);
        assert_eq!(m.jobs[1].phases[0].name, "a");
        assert_eq!(m.periodic[0].queue, "default");
    }

    #[test]
    fn errors_name_file_and_entry() {
        let e = load("[[job]]\nclass = \"A\"\nrun = []\n").unwrap_err();
        let s = e.to_string();
        assert!(
            s.contains("a.toml") && s.contains("class \"A\"") && s.contains("run"),
            "{s}"
        );
        let e = load("[[job]]\nclass = \"A\"\nrnu = [\"x\"]\n").unwrap_err();
        assert!(e.to_string().contains("rnu"), "{e}");
        let e = load("[[job]]\nclass = \"A\"\nrun=[\"x\"]\nlock = { key = \"k:{arg.0}\" }\n")
            .unwrap_err();
        assert!(e.to_string().contains("placeholder"), "{e}");
        let e = load("[[job]]\nclass = \"P\"\n[[job.phase]]\nname = \"a\"\nrun = [\"x\"]\n")
            .unwrap_err();
        assert!(e.to_string().contains("need a `lock`"), "{e}");
    }

    #[test]
    fn hooks_and_report_args_parse_and_bad_ones_are_named() {
        let m = load(
            "[[job]]\nclass = \"A\"\nrun = [\"x\"]\nreport_args = true\n\
             [[hook]]\non = \"death\"\nrun = [\"bin/page\", \"--team\", \"ops\"]\ntimeout_secs = 5\n",
        )
        .unwrap();
        assert!(m.jobs[0].report_args);
        assert_eq!(m.hooks[0].on, "death");
        assert_eq!(m.hooks[0].run, ["bin/page", "--team", "ops"]);
        let e = load("[[hook]]\non = \"dead\"\nrun = [\"x\"]\n").unwrap_err();
        assert!(
            e.to_string().contains("[[hook]] #1") && e.to_string().contains("lock_lost"),
            "{e}"
        );
        let e = load("[[hook]]\non = \"failure\"\nrun = []\n").unwrap_err();
        assert!(e.to_string().contains("run"), "{e}");
        let e = load("[[hook]]\non = \"poison\"\nrun = [\"x\"]\ntimeout_secs = 0\n").unwrap_err();
        assert!(e.to_string().contains("timeout_secs"), "{e}");
    }
}

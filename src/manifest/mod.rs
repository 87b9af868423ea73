//! Job manifests: every `jobs/*.toml` file, parsed and checked before anything starts
//! (`load.rs`; the entries' fields are `spec.rs`, their checks `validate.rs`). An error
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
//! on_cancel = "boundary"           # or "kill": what Sidekiq's cancel! does to a running phase
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
mod load;
mod spec;
mod validate;

pub use spec::{HookSpec, JobSpec, PeriodicSpec};

#[derive(Debug, thiserror::Error)]
#[error("{file}: {entry}: {message}")]
pub struct ManifestError {
    pub file: String,
    pub entry: String,
    pub message: String,
}

/// Every job, periodic and hook entry of a manifest folder.
#[derive(Debug, Default, Clone)]
pub struct Manifest {
    pub jobs: Vec<JobSpec>,
    pub periodic: Vec<PeriodicSpec>,
    pub hooks: Vec<HookSpec>,
}

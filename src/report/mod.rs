//! Failure reports leave the worker here: to Sentry (`to_sentry.rs`, behind the rate limit of
//! `limit.rs`) and to the manifest's hooks (`hooks.rs`). Every outcome path hands its report
//! to [`FailureReporter`] through `job::report::Reporter` (the processor for failed and dead
//! runs and bad payloads, the cycle engine for lost locks, the sweeper for poison pills, the
//! scheduled poller for its burials) after its Redis write; nothing here waits or can change
//! the outcome. Touches no Redis keys.

pub mod deploy;
pub mod hooks;
pub mod limit;
pub mod to_sentry;

mod failure_reporter;

pub use failure_reporter::{buried, failed_run, FailureReporter};

//! The `error_class` strings playguard writes into failed jobs (the retry and dead sets show
//! them in Sidekiq's Web UI as the exception class), in one place. Ruby-side names where Ruby
//! has one (`NameError`), `Playguard::*` for failures only playguard can have; each
//! constant is named after its string.
//! Touches no Redis keys.

/// error_class recorded when a command exits non-zero.
pub const COMMAND_FAILED: &str = "Playguard::CommandFailed";
/// error_class recorded when a command outlives its timeout.
pub const TIMEOUT: &str = "Playguard::Timeout";
/// error_class of a job whose `queue:<q>` key holds another type than a list.
pub const BAD_QUEUE_KEY: &str = "Playguard::BadQueueKey";
/// error_class of a payload that parses but is not a job (no class, args not an array).
pub const INVALID_PAYLOAD: &str = "Playguard::InvalidPayload";
/// error_class for a class nobody registered: what Ruby raises when constantize fails.
pub const NAME_ERROR: &str = "NameError";
/// error_class of a job whose arguments cannot form its lock key (see cycle/keys.rs, render_key).
pub const BAD_LOCK_KEY: &str = "Playguard::BadLockKey";
/// error_class of a job whose data cannot be handed to a command (a NUL byte, too big for exec).
pub const BAD_ARGUMENTS: &str = "Playguard::BadArguments";
/// error_class when the lock cannot even be attempted (Redis unreachable at acquire).
pub const LOCK_ERROR: &str = "Playguard::LockError";
/// error_class of a job recovered from dead workers too often (a poison pill).
pub const POISON_PILL: &str = "Playguard::PoisonPill";
/// error_class of a job interrupted by shutdown more often than allowed (job/interrupted.rs).
pub const INTERRUPTED: &str = "Playguard::Interrupted";
/// error_class of a job carrying a Pro or Enterprise option playguard cannot honour exactly
/// (job/options.rs).
pub const UNSUPPORTED: &str = "Playguard::Unsupported";
/// The error of a `lock_lost` report: a cycle ended because its lock was no longer provably ours.
pub const LOCK_LOST: &str = "Playguard::LockLost";
/// A Rust handler or a phase that panicked.
pub const PANIC: &str = "Playguard::Panic";
/// sidekiq-unique-jobs' runtime lock was held by another job (`job/unique_jobs.rs`); with
/// `on_conflict: reject` such a failure goes to dead whatever `retry` says (`retry.rs`).
pub const UNIQUE_CONFLICT: &str = "SidekiqUniqueJobs::Conflict";

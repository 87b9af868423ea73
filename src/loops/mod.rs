//! The side loops one worker runs beside its fetch: the heartbeat (Sidekiq's process keys and
//! our lease, with its read-only checks of the queues' keys and of the eviction policy), the
//! sweeper (dead processes' jobs and locks), the scheduled poller (`retry` and `schedule`), the
//! periodic fan-out, sidekiq-cron's poller (`sidekiq_cron.rs`, an entry of the gem's schedule
//! read in `cron_entry.rs`), and the systemd status and watchdog loop; `capsules.rs` builds the
//! heartbeat info's `capsules`. Keys: those of each loop.

pub mod capsules;
pub mod cron_entry;
pub mod eviction;
pub mod heartbeat;
pub mod periodic;
pub mod periodic_tick;
pub mod queue_heads;
pub mod scheduled;
pub mod sidekiq_cron;
pub mod sweeper;
pub mod watchdog;

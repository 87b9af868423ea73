//! The side loops one worker runs beside its fetch: the heartbeat (Sidekiq's process keys and
//! our lease), the sweeper (dead processes' jobs and locks), the scheduled poller (`retry` and
//! `schedule`), the periodic fan-out, and the systemd status and watchdog loop. Keys: those of
//! each loop.

pub mod heartbeat;
pub mod periodic;
pub mod scheduled;
pub mod sweeper;
pub mod watchdog;

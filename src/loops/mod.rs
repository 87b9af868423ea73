//! The side loops one worker runs beside its fetch: the heartbeat (Sidekiq's process keys and
//! our lease), the sweeper (dead processes' jobs and locks), the scheduled poller (`retry` and
//! `schedule`) and the periodic fan-out; `capsules.rs` builds the heartbeat info's `capsules`.
//! Keys: those of each loop.

pub mod capsules;
pub mod heartbeat;
pub mod periodic;
pub mod scheduled;
pub mod sweeper;

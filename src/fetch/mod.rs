//! The one owner of a fetched job's unit of work, as Sidekiq's fetch.rb is: how jobs are taken
//! (a batch, or an idle blocking pop), acknowledged, settled with their outcome, requeued, and
//! drained at a clean stop. The processor and the fetch loop call these and never ask which
//! mode is on. Keys: those of `reliable.rs` / `basic.rs`.
//!
//! To add a strategy: a module beside `reliable.rs`, a variant of `Mode` (`strategy.rs`), and one
//! arm in each method of `strategy.rs`, `settle.rs` and the blocking-pop methods of `blocking.rs`.

mod acks;
mod basic;
pub mod blocking;
pub mod recent;
mod reliable;
pub mod rescue;
mod settle;
mod strategy;
pub mod unit_of_work;
mod working_order;

pub use strategy::FetchStrategy;
pub use working_order::working_key;

use crate::fetch::unit_of_work::UnitOfWork;

/// Jobs taken in one round trip, in fetch order.
pub type Batch = redis::RedisResult<Vec<UnitOfWork>>;

/// `--fetch`: how jobs are taken from their queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum FetchMode {
    /// Each job sits in our working list until it finished: nothing is lost on SIGKILL.
    #[default]
    Reliable,
    /// Sidekiq OSS's BRPOP: a job popped by a process that dies is lost.
    Basic,
}

impl FetchMode {
    /// Whether its jobs wait in working lists in Redis until they finished, keys an evicting
    /// Redis may drop (`loops/eviction.rs`). Asked before the strategy exists; afterwards the
    /// layers above learn it only as the lease ([`FetchStrategy::liveness`]).
    pub fn keeps_working_lists(self) -> bool {
        self == FetchMode::Reliable
    }
}

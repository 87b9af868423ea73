//! The phased cycle: the engine that runs phases under a token lock renewed after each one,
//! the lock and its fences (Redis or PostgreSQL), the ledger of cycles, the key templates a
//! lock key is rendered from, the manifest's reconcile phases, and a cycle's progress and
//! cancel as Sidekiq 8.1's iterable jobs keep them. Keys: `playguard:lock:*`,
//! `playguard:locks:<identity>`, `it-<jid>`; tables: `playguard_fences`, `playguard_cycles`.

pub mod cancel;
pub mod engine;
pub mod fences;
pub mod keys;
pub mod ledger;
pub mod lock;
pub mod phase;
pub mod progress;
pub mod reconcile;
mod release_guard;

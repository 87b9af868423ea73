//! The phased cycle: the engine that runs phases under a token lock renewed after each one,
//! the lock and its fences (Redis or PostgreSQL), the ledger of cycles, the key templates a
//! lock key is rendered from, and the manifest's reconcile phases. Keys: `playguard:lock:*`,
//! `playguard:locks:<identity>`; tables: `playguard_fences`, `playguard_cycles`.

pub mod engine;
pub mod fences;
pub mod keys;
pub mod ledger;
pub mod lock;
pub mod phase;
pub mod reconcile;
mod release_guard;

//! This process's own state, shared by every layer above: its identity, the one-way quiet and
//! stop state, the slot table of what each slot runs, the liveness lease a job's commands
//! are stopped by, what it knows of the Redis it serves (`redis_state.rs`), and what it tells
//! systemd (`notify.rs`). Touches no Redis keys.

pub mod identity;
pub mod liveness;
pub mod notify;
pub mod redis_state;
pub mod shutdown;
pub mod slots;

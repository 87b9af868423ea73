//! Operator commands (`playguard locks`, `playguard cycles`): what is locked now and how the
//! last cycles ended, as an aligned table or, with `--json`, one JSON array for scripts.
//! The text formatting both share is `render.rs`; the Redis keys and tables each command
//! reads are named in `locks.rs` and `cycles.rs`. Touches no Redis keys itself.

pub mod cycles;
pub mod locks;
mod render;

pub use render::{cell, clip, clock, duration, now_ms, print, render_rows, rfc3339};

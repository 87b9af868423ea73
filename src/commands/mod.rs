//! Commands: running one program for a job (environment, stdin, output lines, stop) through
//! the guardian, the one process per worker that spawns and guards them, and the manifest's
//! plain command jobs. Touches no Redis keys.

pub mod child;
pub mod command_job;
pub mod guardian;

//! The `playguard` binary: parses the command line and hands over to the library.
/// mimalloc, not glibc's malloc: a job's few short-lived buffers are allocated on one tokio
/// thread and often freed on another, which glibc serves with arena locks and consolidation
/// (a quarter of the worker's instructions per job under callgrind).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    std::process::exit(playguard::cli::main());
}

//! The `playguard` binary: parses the command line and hands over to the library.
fn main() {
    std::process::exit(playguard::cli::main());
}

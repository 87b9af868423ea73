//! Shell completions (clap_complete) and the man page (clap_mangen), generated from the same
//! clap definition the binary parses, so they cannot drift from its flags. The Debian package
//! carries their output (`packaging/deb/build.sh` writes it before `cargo deb`). Touches no
//! Redis keys.

use std::io::Write;

/// Write `shell`'s completion script for `cmd` to stdout.
pub fn completions(mut cmd: clap::Command, shell: clap_complete::Shell) -> i32 {
    let name = cmd.get_name().to_string();
    // Into memory first: clap_complete panics on a failed write (a closed pipe).
    let mut out = Vec::new();
    clap_complete::generate(shell, &mut cmd, name, &mut out);
    emit(&out, "completion script")
}

/// Write the man page (roff) of `cmd` to stdout.
pub fn man(cmd: clap::Command) -> i32 {
    let mut out = Vec::new();
    if let Err(e) = clap_mangen::Man::new(cmd).render(&mut out) {
        eprintln!("playguard: cannot render the man page: {e}");
        return 1;
    }
    emit(&out, "man page")
}

fn emit(out: &[u8], what: &str) -> i32 {
    match std::io::stdout().write_all(out) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("playguard: cannot write the {what}: {e}");
            1
        }
    }
}

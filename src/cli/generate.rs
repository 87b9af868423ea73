//! Shell completions (clap_complete) and the man page (clap_mangen), generated from the same
//! clap definition the binary parses, so they cannot drift from its flags. The Debian package
//! carries their output (`packaging/deb/build.sh` writes it before `cargo deb`). Touches no
//! Redis keys.

use std::io::Write;

/// Write `shell`'s completion script for `cmd` to stdout.
pub fn completions(cmd: clap::Command, shell: clap_complete::Shell) -> i32 {
    emit(&completion_script(cmd, shell), "completion script")
}

/// Write the man page (roff) of `cmd` to stdout or, given `dir`, write there one page per
/// command: `playguard.1` and `playguard-<subcommand>.1`, which it names.
pub fn man(cmd: clap::Command, dir: Option<&std::path::Path>) -> i32 {
    let page = match dir {
        Some(dir) => clap_mangen::generate_to(cmd, dir).map(|()| Vec::new()),
        None => man_page(cmd),
    };
    match page {
        Ok(page) => emit(&page, "man page"),
        Err(e) => {
            eprintln!("playguard: cannot render the man pages: {e}");
            1
        }
    }
}

/// In memory first: clap_complete panics on a failed write (a closed pipe).
fn completion_script(mut cmd: clap::Command, shell: clap_complete::Shell) -> Vec<u8> {
    let name = cmd.get_name().to_string();
    let mut out = Vec::new();
    clap_complete::generate(shell, &mut cmd, name, &mut out);
    out
}

fn man_page(cmd: clap::Command) -> std::io::Result<Vec<u8>> {
    let mut out = Vec::new();
    clap_mangen::Man::new(cmd).render(&mut out)?;
    Ok(out)
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn completions_and_man_page_name_the_subcommands_and_flags() {
        let cli = || crate::cli::Cli::command();
        cli().debug_assert();
        for shell in [
            clap_complete::Shell::Bash,
            clap_complete::Shell::Zsh,
            clap_complete::Shell::Fish,
        ] {
            let script = String::from_utf8(completion_script(cli(), shell)).unwrap();
            for word in ["enqueue", "cycles", "metrics-addr", "database-url"] {
                assert!(script.contains(word), "{shell:?} completion lacks {word}");
            }
        }
        let page = String::from_utf8(man_page(cli()).unwrap()).unwrap();
        assert!(page.contains(".TH playguard 1"), "{page}");
        assert!(page.contains("playguard\\-locks(1)"), "{page}");
        assert!(page.contains("\\-\\-metrics\\-addr"), "{page}");
        // Every page the main one names is written beside it; hidden commands get none.
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(man(cli(), Some(dir.path())), 0);
        let mut pages: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        pages.sort();
        assert!(pages.contains(&"playguard.1".to_string()), "{pages:?}");
        for sub in ["run", "enqueue", "check", "db", "locks", "cycles"] {
            assert!(page.contains(&format!("playguard\\-{sub}(1)")), "{sub}");
            assert!(
                pages.contains(&format!("playguard-{sub}.1")),
                "{sub}: {pages:?}"
            );
        }
        assert!(
            !pages.iter().any(|p| p.contains("completions")),
            "{pages:?}"
        );
    }
}

//! What sentry-ruby reads of the deploy, read the same way: the release when
//! `SENTRY_RELEASE` is not set, found in its order from the working directory (the app's root
//! under foreman or systemd): the git commit (`git rev-parse --short HEAD` when `.git` is
//! here), Capistrano's `REVISION` file or the last `as release <N>` of `../revisions.log`,
//! Heroku's `HEROKU_SLUG_COMMIT` (on Heroku only); and the server's name (`DYNO` on Heroku,
//! else the host's). So a Ruby Sidekiq process and playguard started from the same deploy
//! tag their events alike. Touches no Redis keys.

use std::path::Path;
use std::process::{Command, Stdio};

/// `SENTRY_RELEASE`, else the first release found from `root`; None when there is none.
pub fn detect(root: &Path) -> Option<String> {
    std::env::var("SENTRY_RELEASE")
        .ok()
        .filter(|r| !r.is_empty())
        .or_else(|| from_git(root))
        .or_else(|| from_capistrano(root))
        .or_else(from_heroku)
}

/// The short commit of a checkout whose `.git` is in `root` (none without git, or when git
/// fails): git's own abbreviation, so the same length as the Ruby side's.
fn from_git(root: &Path) -> Option<String> {
    if !root.join(".git").is_dir() {
        return None;
    }
    let out = Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(root)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    let sha = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (out.status.success() && !sha.is_empty()).then_some(sha)
}

/// Capistrano's `REVISION` (the deployed commit), else the last line of `../revisions.log`.
fn from_capistrano(root: &Path) -> Option<String> {
    if let Ok(rev) = std::fs::read_to_string(root.join("REVISION")) {
        return Some(rev.trim().to_string());
    }
    let log = std::fs::read_to_string(root.join("..").join("revisions.log")).ok()?;
    log.lines().last().map(release_of_log_line)
}

/// A revisions.log line's release number (`... as release 20261203101500 by deploy`): the
/// digits after the last `as release ` that has some; a line without them is kept whole, as
/// sentry-ruby does.
fn release_of_log_line(line: &str) -> String {
    const MARK: &str = "as release ";
    let line = line.trim();
    line.rmatch_indices(MARK)
        .map(|(at, _)| {
            let rest = &line[at + MARK.len()..];
            &rest[..rest
                .find(|c: char| !c.is_ascii_digit())
                .unwrap_or(rest.len())]
        })
        .find(|digits| !digits.is_empty())
        .unwrap_or(line)
        .to_string()
}

/// Whether this runs on Heroku as sentry-ruby decides it: `/etc/heroku` is there, and not in CI.
pub fn on_heroku() -> bool {
    Path::new("/etc/heroku").is_dir() && std::env::var_os("CI").is_none()
}

/// `HEROKU_SLUG_COMMIT`, on Heroku only.
fn from_heroku() -> Option<String> {
    on_heroku()
        .then(|| std::env::var("HEROKU_SLUG_COMMIT").ok())
        .flatten()
        .filter(|c| !c.is_empty())
}

/// The event's `server_name` as sentry-ruby gives it: `DYNO` on Heroku, else the host's name
/// (a `DYNO` set elsewhere still names this process's identity, as Sidekiq's launcher does).
pub fn server_name() -> String {
    std::env::var("DYNO")
        .ok()
        .filter(|d| on_heroku() && !d.is_empty())
        .or_else(|| hostname::get().ok().and_then(|h| h.into_string().ok()))
        .unwrap_or_else(|| "localhost".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_revisions_log_line_gives_its_release_number() {
        let line = "Branch main (at 1a2b3c4) deployed as release 20261203101500 by deploy\n";
        assert_eq!(release_of_log_line(line), "20261203101500");
        assert_eq!(
            release_of_log_line("as release 1 then as release 22x"),
            "22"
        );
        assert_eq!(release_of_log_line("as release 1 then as release x"), "1");
        assert_eq!(
            release_of_log_line("rolled back to release 7"),
            "rolled back to release 7"
        );
    }

    #[test]
    fn capistranos_revision_file_comes_before_its_log() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("current");
        std::fs::create_dir(&root).unwrap();
        assert_eq!(from_capistrano(&root), None);
        std::fs::write(
            dir.path().join("revisions.log"),
            "Branch main (at a) deployed as release 1 by x\nBranch main (at b) deployed as release 2 by x\n",
        )
        .unwrap();
        assert_eq!(from_capistrano(&root).as_deref(), Some("2"));
        std::fs::write(root.join("REVISION"), "0f1e2d3c\n").unwrap();
        assert_eq!(from_capistrano(&root).as_deref(), Some("0f1e2d3c"));
        assert_eq!(from_git(&root), None, "no .git here");
    }
}

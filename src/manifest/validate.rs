//! The checks a manifest passes before anything starts: every entry's fields, its argv (and
//! that its program exists and may run), a failure policy, a hook, a periodic schedule.
//! Touches no Redis keys.

use super::*;
use std::path::Path;

pub(super) fn find_program(prog: &str) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    let runnable = |p: &Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if prog.contains('/') {
        let p = Path::new(prog);
        if !p.exists() {
            let cwd = std::env::current_dir()
                .map(|d| d.display().to_string())
                .unwrap_or_default();
            return Err(format!(
                "{prog:?} does not exist (relative to the working directory {cwd})"
            ));
        }
        if !runnable(p) {
            return Err(format!("{prog:?} is not an executable file (chmod +x?)"));
        }
        return Ok(());
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    if std::env::split_paths(&path).any(|d| runnable(&d.join(prog))) {
        Ok(())
    } else {
        Err(format!("{prog:?} is not on PATH"))
    }
}

pub(super) fn err(file: &Path, entry: &str, message: String) -> ManifestError {
    ManifestError {
        file: file.display().to_string(),
        entry: entry.to_string(),
        message,
    }
}

pub(super) fn validate_argv(what: &str, argv: &[String]) -> Result<(), String> {
    match argv.first() {
        None => Err(format!("{what}: `run` must name a command (an argv list)")),
        Some(p) if p.trim().is_empty() => {
            Err(format!("{what}: `run` starts with an empty program"))
        }
        _ => Ok(()),
    }
}

pub(super) fn validate_job(j: &JobSpec) -> Result<(), String> {
    if j.class.trim().is_empty() {
        return Err("`class` must not be empty".into());
    }
    match (&j.run, j.phases.is_empty()) {
        (Some(_), false) => {
            return Err("give either `run` or [[job.phase]] entries, not both".into())
        }
        (None, true) => return Err("needs `run` (a command) or [[job.phase]] entries".into()),
        (Some(argv), true) => validate_argv("job", argv)?,
        (None, false) => {
            let mut names = std::collections::HashSet::new();
            for p in &j.phases {
                if p.name.trim().is_empty() {
                    return Err("a phase has an empty `name`".into());
                }
                if !names.insert(p.name.as_str()) {
                    return Err(format!("phase {:?} appears twice", p.name));
                }
                validate_argv(&format!("phase {:?}", p.name), &p.run)?;
                if matches!(p.timeout_secs, Some(t) if t <= 0.0 || !t.is_finite()) {
                    return Err(format!("phase {:?}: timeout_secs must be > 0", p.name));
                }
            }
        }
    }
    for name in j.env.iter().flatten() {
        if name.is_empty() || name.contains(['=', '\0']) {
            return Err(format!("env: {name:?} is not an environment variable name"));
        }
    }
    if j.timeout_secs == Some(0) {
        return Err("timeout_secs must be > 0".into());
    }
    if let Some(l) = &j.lock {
        if !(l.ttl_secs > 0.0 && l.ttl_secs.is_finite()) {
            return Err("lock.ttl_secs must be > 0".into());
        }
        if l.when_locked != "skip" {
            return Err(format!(
                "lock.when_locked = {:?} is not supported (only \"skip\")",
                l.when_locked
            ));
        }
        if let Some(f) = &l.fence {
            crate::cycle::fences::FenceSource::parse(f)?;
        }
        crate::cycle::keys::check_template(&l.key)?;
        if let Some(label) = &l.label {
            crate::cycle::keys::check_template(label)?;
        }
    }
    match j.on_lock_lost.as_deref() {
        None | Some("abort") => {}
        Some(other) => {
            return Err(format!(
                "on_lock_lost = {other:?} is not supported (only \"abort\")"
            ))
        }
    }
    if let Some(c) = &j.on_cancel {
        crate::cycle::cancel::OnCancel::parse(c)?;
        if j.phases.is_empty() {
            return Err("on_cancel applies to [[job.phase]] jobs (a plain command is always stopped by a cancel)".into());
        }
    }
    if j.on_lock_lost.is_some() && j.lock.is_none() {
        return Err("on_lock_lost needs a `lock`".into());
    }
    // The cycle renews a lease after every phase, so phases need one. (A per-jid default lock
    // would make a recovered copy of a crashed run skip itself as "already locked".)
    if !j.phases.is_empty() && j.lock.is_none() {
        return Err("[[job.phase]] entries need a `lock` (key, ttl_secs) to run under".into());
    }
    Ok(())
}

/// A job's `retry_in`, `max_retries` and `on_exhausted`, checked; None when it sets neither
/// of the first two.
pub(super) fn failure_policy(
    j: &JobSpec,
) -> Result<Option<crate::job::retry_policy::Policy>, String> {
    if let Some(argv) = &j.on_exhausted {
        validate_argv("on_exhausted", argv)?;
    }
    if matches!(j.max_retries, Some(n) if n < 0) {
        return Err("max_retries must be >= 0".into());
    }
    if j.retry_in.is_none() && j.max_retries.is_none() {
        return Ok(None);
    }
    Ok(Some(crate::job::retry_policy::Policy {
        retry_in: j
            .retry_in
            .as_ref()
            .map(crate::job::retry_policy::RetryIn::parse)
            .transpose()?,
        max_retries: j.max_retries,
    }))
}

pub(super) fn validate_hook(h: &HookSpec) -> Result<(), String> {
    crate::report::hooks::On::parse(&h.on)?;
    validate_argv("hook", &h.run)?;
    if matches!(h.timeout_secs, Some(t) if t <= 0.0 || !t.is_finite()) {
        return Err("timeout_secs must be > 0".into());
    }
    Ok(())
}

pub(super) fn validate_periodic(p: &mut PeriodicSpec) -> Result<(), String> {
    if p.name.trim().is_empty() || p.class.trim().is_empty() || p.queue.trim().is_empty() {
        return Err("`name`, `class` and `queue` must not be empty".into());
    }
    match (&p.every_secs, &p.cron) {
        (Some(0), _) => return Err("every_secs must be > 0".into()),
        (Some(_), None) if p.tz.is_some() => {
            return Err("`tz` goes with `cron`, not with `every_secs`".into())
        }
        (Some(_), None) => {}
        (None, Some(line)) => {
            p.schedule = Some(cron::CronSchedule::parse(line, p.tz.as_deref())?);
        }
        _ => return Err("give either `every_secs` or `cron`, one of them".into()),
    }
    if p.for_each_member_of.is_some() && !p.args.is_empty() {
        return Err("give either `for_each_member_of` or `args`, not both".into());
    }
    Ok(())
}

//! `playguard check`: load the configuration and the manifest, reach Redis (and PostgreSQL
//! when configured or needed) and print what would run, without running it. Keys: none
//! written (INFO read).

use super::*;
use std::time::Duration;

pub(super) fn check(a: CheckArgs, registry: &Registry) -> i32 {
    let m = match manifest_jobs::load_manifest(&a.jobs, registry) {
        Ok(m) => m,
        Err(e) => {
            return report(&StartError::Config(format!("bad manifest: {e}")));
        }
    };
    let database = match check_database(&a, &m, registry) {
        Ok(d) => d,
        Err(e) => return report(&e),
    };
    let url = crate::connections::redact::url(&a.redis.url);
    let res = runtime().block_on(async {
        let (_, mut conn) = open_redis(&a.redis.url, Duration::ZERO).await?;
        let version = redis_version(&mut conn, &url).await?;
        let replicated = crate::worker::fence_advice::replication(&mut conn).await;
        let version = match conn.primary() {
            Some(p) => format!("{version} (primary {p})"),
            None => version,
        };
        Ok::<_, StartError>((version, replicated))
    });
    match res {
        Err(e) => report(&e),
        Ok((version, replicated)) => {
            println!(
                "ok: {} job class(es) in {} ({} periodic), {} Rust handler(s), Redis {version} at {url} answers",
                m.jobs.len(),
                a.jobs.display(),
                m.periodic.len(),
                registry.classes().len(),
            );
            if let Some(line) = database {
                println!("ok: {line}");
            }
            print_schedules(&m.periodic);
            let classes = crate::worker::fence_advice::on_redis_fences(&m);
            if let Some(w) = crate::worker::fence_advice::advice(&classes, replicated.as_deref()) {
                println!("warning: {w}");
            }
            0
        }
    }
}

/// Each `[[periodic]]` entry's next three run times, in its own zone.
fn print_schedules(periodic: &[crate::manifest::PeriodicSpec]) {
    let now = chrono::Utc::now().timestamp();
    for p in periodic {
        let (what, times): (String, Vec<String>) = match (&p.schedule, p.every_secs) {
            (Some(c), _) => (
                format!("cron {:?} in {}", c.line(), c.tz()),
                c.upcoming(now, 3).iter().map(|t| t.to_rfc3339()).collect(),
            ),
            (None, Some(every)) => (
                format!("every {every} s"),
                (1..=3)
                    .filter_map(|i| {
                        let at = (now as u64 / every + i) * every;
                        chrono::DateTime::from_timestamp(at as i64, 0)
                    })
                    .map(|t| t.to_rfc3339())
                    .collect(),
            ),
            (None, None) => continue,
        };
        println!("periodic {:?}: {what}; next {}", p.name, times.join(", "));
    }
}

/// The database half of `check`: a `fence = "database"` job without a URL is a configuration
/// error (2); a URL that does not answer is 1. The password is never printed.
fn check_database(
    a: &CheckArgs,
    m: &crate::manifest::Manifest,
    registry: &Registry,
) -> Result<Option<String>, StartError> {
    let url = a.database.database_url.as_deref().filter(|u| !u.is_empty());
    let needing = manifest_jobs::needing_database(m, registry);
    if url.is_none() && !needing.is_empty() {
        return Err(StartError::Config(manifest_jobs::missing_database(
            &needing,
        )));
    }
    let Some(url) = url else {
        return Ok(None);
    };
    let db = parse_database(url, "playguard-check")?;
    let version = runtime()
        .block_on(db.server_version())
        .map_err(|e| database_error(&db, e))?;
    Ok(Some(format!(
        "PostgreSQL {version} at {} answers",
        db.shown_url()
    )))
}

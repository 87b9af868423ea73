//! The warning a locked job on the Redis fence store earns when that Redis is replicated
//! (Sentinel, or a primary with replicas): `playguard check` prints it and `run` logs it at
//! start. Why: a Redis fence is `max(<key>:fence + 1, the primary's clock in µs)`. Replication
//! is asynchronous, so a failover can lose the last fence the old primary handed out, and the
//! next one then comes from the new primary's clock; a cut-off primary also keeps renewing its
//! holders' leases while the new one hands the lock to someone else. The database store does
//! not depend on either (docs/fencing.md, "Which fence store survives what", measured with
//! tests/jepsen). Reads `INFO replication`; touches no keys.

use crate::connections::redis_conn::Conn;
use crate::manifest::Manifest;

/// The manifest's locked classes whose fences come from Redis (`fence` unset or `"redis"`).
pub fn on_redis_fences(m: &Manifest) -> Vec<String> {
    let mut v: Vec<String> = m
        .jobs
        .iter()
        .filter(|j| {
            j.lock
                .as_ref()
                .is_some_and(|l| l.fence_source() == crate::cycle::fences::FenceSource::Redis)
        })
        .map(|j| j.class.clone())
        .collect();
    v.sort();
    v.dedup();
    v
}

/// How the server we reached is replicated: behind Sentinel, or a primary with replicas
/// attached; `None` for a lone server (or when INFO is refused: nothing to say then).
pub async fn replication(conn: &mut Conn) -> Option<String> {
    if let Some(p) = conn.primary() {
        return Some(format!("behind Sentinel (primary {p})"));
    }
    let info: String = redis::cmd("INFO")
        .arg("replication")
        .query_async(conn)
        .await
        .ok()?;
    let replicas: u32 = field(&info, "connected_slaves")?.parse().ok()?;
    (replicas > 0).then(|| format!("a primary with {replicas} replica(s)"))
}

fn field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .map(str::trim)
}

/// The one-line warning, or `None` when no class uses Redis fences or Redis is not replicated.
pub fn advice(classes: &[String], replicated: Option<&str>) -> Option<String> {
    let how = replicated?;
    if classes.is_empty() {
        return None;
    }
    Some(format!(
        "{} locked class(es) ({}) take their fences from Redis, which is {how}: a failover can \
         lose the last fence (replication is asynchronous) and a cut-off primary keeps renewing \
         its holders' leases, so a stale holder's write can land; set fence = \"database\" on \
         them (docs/fencing.md, \"Which fence store survives what\"); min-replicas-to-write on \
         the primary only shortens how long a cut-off primary accepts renewals",
        classes.len(),
        classes.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warns_only_for_redis_fences_on_a_replicated_server() {
        let classes = vec!["MarqueeCycle".to_string()];
        assert!(advice(&classes, None).is_none());
        assert!(advice(&[], Some("behind Sentinel (primary a:1)")).is_none());
        let line = advice(&classes, Some("a primary with 2 replica(s)")).unwrap();
        assert!(line.contains("MarqueeCycle") && line.contains("fence = \"database\""));
    }

    #[test]
    fn reads_connected_replicas() {
        let info = "# Replication\r\nrole:master\r\nconnected_slaves:2\r\n";
        assert_eq!(field(info, "connected_slaves"), Some("2"));
        assert_eq!(field(info, "role"), Some("master"));
        assert_eq!(field(info, "nothing"), None);
    }
}

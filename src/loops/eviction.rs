//! The eviction check: Redis's `maxmemory-policy`, read from `INFO memory` (managed servers
//! answer INFO where they refuse CONFIG GET) at start and at every beat. Under any policy but
//! `noeviction` Redis may evict our `playguard:alive:<identity>` (volatile-ttl takes the
//! shortest TTL first), a working list or a lock key: with reliable fetch that can run a job
//! twice, so a start refuses such a policy unless `--allow-eviction` is given; otherwise a WARN
//! at start and whenever the policy changes, and the gauge and `/health` show it
//! (`metrics/redis_gauges.rs`). An empty value (a server that hides it) is not an error.
//! Reads no keys.

use crate::connections::redis_conn::Conn;
use crate::process::redis_state::{evicts, RedisState};

/// The `maxmemory_policy` field of an INFO reply; empty when absent.
pub fn parse_policy(info: &str) -> String {
    info.lines()
        .find_map(|l| l.strip_prefix("maxmemory_policy:"))
        .map(|v| v.trim().to_string())
        .unwrap_or_default()
}

async fn read_policy(conn: &mut Conn) -> redis::RedisResult<String> {
    let info: String = redis::cmd("INFO").arg("memory").query_async(conn).await?;
    Ok(parse_policy(&info))
}

/// At start: read the policy; a start with reliable fetch under an evicting policy fails
/// with the one line naming the policy and the fix, unless eviction is allowed.
pub async fn check_at_start(
    conn: &mut Conn,
    state: &RedisState,
    reliable: bool,
    allow: bool,
) -> Result<(), String> {
    let policy = match read_policy(conn).await {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!(error = %e, "could not read Redis's maxmemory-policy (INFO memory)");
            return Ok(());
        }
    };
    if reliable && evicts(&policy) && !allow {
        return Err(format!(
            "Redis maxmemory-policy is {policy}: it may evict the keys reliable fetch and locks rely on \
             (a job could run twice); set maxmemory-policy noeviction (CONFIG SET maxmemory-policy noeviction, \
             or your provider's parameter group), or pass --allow-eviction to run anyway"
        ));
    }
    note(state, &policy);
    Ok(())
}

/// At every beat: read the policy again and warn when it changed to one that evicts.
pub async fn check(worker: &crate::worker::Worker, conn: &mut Conn) {
    match read_policy(conn).await {
        Ok(p) => note(&worker.metrics.redis, &p),
        Err(e) => tracing::debug!(error = %e, "could not read Redis's maxmemory-policy"),
    }
}

/// Record the policy; WARN when it is read first or changes and evicts, INFO when it no
/// longer does.
fn note(state: &RedisState, policy: &str) {
    let Some(before) = state.set_policy(policy) else {
        return;
    };
    if evicts(policy) {
        tracing::warn!(policy,
            "Redis maxmemory-policy is {policy}: keys may be evicted, and an evicted liveness key stops this process's running jobs; set it to noeviction");
    } else if before.is_some_and(|b| evicts(&b)) {
        tracing::info!(
            policy = if policy.is_empty() {
                "(hidden)"
            } else {
                policy
            },
            "Redis maxmemory-policy no longer evicts"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_is_read_from_info_memory() {
        let info = "# Memory\r\nused_memory:1\r\nmaxmemory_policy:allkeys-lru\r\nmem_fragmentation_ratio:1\r\n";
        assert_eq!(parse_policy(info), "allkeys-lru");
        assert_eq!(parse_policy("# Memory\r\nused_memory:1\r\n"), "");
        assert_eq!(parse_policy("maxmemory_policy:\r\n"), "");
    }
}

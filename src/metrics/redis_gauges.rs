//! The Redis-state series on `/metrics` and the detail lines of `/health`: the server's
//! `maxmemory-policy`, whether it refuses writes for want of memory, and the served queues
//! whose key holds another type than a list (`process/redis_state.rs` keeps them). Touches no
//! Redis keys.

use crate::process::redis_state::RedisState;
use std::fmt::Write;

/// Append the gauges to a Prometheus text exposition.
pub fn write(out: &mut String, state: &RedisState) {
    let name = "playguard_redis_maxmemory_policy";
    let _ = writeln!(
        out,
        "# HELP {name} Redis maxmemory-policy as last read (1 on the current value; empty when the server hides it)."
    );
    let _ = writeln!(out, "# TYPE {name} gauge");
    if let Some(p) = state.policy() {
        let _ = writeln!(out, "{name}{{policy=\"{}\"}} 1", escape(&p));
    }
    let gauges = [
        (
            "playguard_redis_evicting",
            "1 when Redis may evict keys (maxmemory-policy is not noeviction).",
            state.evicting() as usize,
        ),
        (
            "playguard_redis_oom",
            "1 while Redis refuses writes for want of memory (maxmemory reached).",
            state.is_oom() as usize,
        ),
        (
            "playguard_wrong_type_queues",
            "Served queues skipped because their key holds another type than a list.",
            state.broken().len(),
        ),
    ];
    for (name, help, v) in gauges {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} gauge");
        let _ = writeln!(out, "{name} {v}");
    }
}

/// What `/health` adds below its status line: one line per thing wrong with Redis's state
/// (none when all is well). None of them makes the process unhealthy: restarting it would not
/// help, and its running jobs are still safe.
pub fn health_detail(state: &RedisState) -> String {
    let mut out = String::new();
    if let Some(p) = state
        .policy()
        .filter(|p| crate::process::redis_state::evicts(p))
    {
        let _ = writeln!(
            out,
            "redis maxmemory-policy is {p}: keys may be evicted (set it to noeviction)"
        );
    }
    if state.is_oom() {
        let _ = writeln!(
            out,
            "redis out of memory (maxmemory reached): fetching paused, running jobs go on, outcomes retried until they land"
        );
    }
    for (q, why) in state.broken() {
        let _ = writeln!(out, "queue {q} skipped: {why}");
    }
    out
}

/// A label value in Prometheus's text format: backslash, quote and newline escaped.
pub fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

//! What this process knows of the state of the Redis it serves, beyond "it answers": its
//! `maxmemory-policy` (read by `loops/eviction.rs` at start and at every beat), whether it
//! refuses writes for want of memory (OOM, seen by the heartbeat), and which served queues are
//! unusable because `queue:<q>` (or our working list of it) holds another type than a list
//! (seen by the heartbeat and by `lua/fetch.lua`). Fetch skips such queues and pauses under
//! OOM; `/metrics` and `/health` show it all (`metrics/redis_gauges.rs`). Touches no Redis keys.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

#[derive(Default)]
pub struct RedisState {
    /// None before the first read; `Some("")` when the server hides it (managed servers).
    policy: Mutex<Option<String>>,
    oom: AtomicBool,
    /// Queue name -> what is wrong with it ("queue:x holds a string").
    broken: Mutex<BTreeMap<String, String>>,
    /// Fast path for fetch: whether `broken` has anything.
    any_broken: AtomicBool,
}

impl RedisState {
    /// Record the policy just read. Returns the previous value when it changed (None inside
    /// for the first read).
    pub fn set_policy(&self, policy: &str) -> Option<Option<String>> {
        let mut p = self.policy.lock().unwrap();
        if p.as_deref() == Some(policy) {
            return None;
        }
        Some(p.replace(policy.to_string()))
    }

    pub fn policy(&self) -> Option<String> {
        self.policy.lock().unwrap().clone()
    }

    /// Whether the policy read lets Redis evict keys (an unread or hidden one does not count).
    pub fn evicting(&self) -> bool {
        self.policy().is_some_and(|p| evicts(&p))
    }

    /// Record whether Redis refused our writes for want of memory. Returns whether it changed.
    pub fn set_oom(&self, oom: bool) -> bool {
        self.oom.swap(oom, Ordering::SeqCst) != oom
    }

    pub fn is_oom(&self) -> bool {
        self.oom.load(Ordering::SeqCst)
    }

    /// Mark `queue` unusable, with the reason. Returns true the first time (log it then).
    pub fn mark_broken(&self, queue: &str, why: String) -> bool {
        let mut b = self.broken.lock().unwrap();
        let new = !b.contains_key(queue);
        b.insert(queue.to_string(), why);
        self.any_broken.store(true, Ordering::SeqCst);
        new
    }

    /// `queue` is usable (again). Returns true when it was marked broken (log the fix then).
    pub fn mark_fine(&self, queue: &str) -> bool {
        if !self.any_broken.load(Ordering::SeqCst) {
            return false;
        }
        let mut b = self.broken.lock().unwrap();
        let was = b.remove(queue).is_some();
        self.any_broken.store(!b.is_empty(), Ordering::SeqCst);
        was
    }

    pub fn is_broken(&self, queue: &str) -> bool {
        self.any_broken.load(Ordering::SeqCst) && self.broken.lock().unwrap().contains_key(queue)
    }

    /// The broken queues and why, by name.
    pub fn broken(&self) -> Vec<(String, String)> {
        let b = self.broken.lock().unwrap();
        b.iter().map(|(q, w)| (q.clone(), w.clone())).collect()
    }
}

/// Whether a `maxmemory-policy` value lets Redis evict keys: anything but `noeviction` (and an
/// empty value, which a managed server shows when it hides the setting, is not judged).
pub fn evicts(policy: &str) -> bool {
    !policy.is_empty() && policy != "noeviction"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_changes_are_reported_once() {
        let s = RedisState::default();
        assert!(!s.evicting(), "unread is not evicting");
        assert_eq!(s.set_policy("noeviction"), Some(None));
        assert_eq!(s.set_policy("noeviction"), None);
        assert!(!s.evicting());
        assert_eq!(s.set_policy("allkeys-lru"), Some(Some("noeviction".into())));
        assert!(s.evicting());
        assert_eq!(s.set_policy(""), Some(Some("allkeys-lru".into())));
        assert!(!s.evicting(), "a hidden policy is not an error");
    }

    #[test]
    fn broken_queues_are_new_once_and_fixed_once() {
        let s = RedisState::default();
        assert!(!s.is_broken("a"));
        assert!(s.mark_broken("a", "queue:a holds a string".into()));
        assert!(!s.mark_broken("a", "queue:a holds a string".into()));
        assert!(s.is_broken("a") && !s.is_broken("b"));
        assert!(!s.mark_fine("b"));
        assert!(s.mark_fine("a"));
        assert!(!s.mark_fine("a"));
        assert!(!s.is_broken("a"));
        assert!(s.set_oom(true) && !s.set_oom(true) && s.is_oom());
    }
}

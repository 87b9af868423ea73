//! The queues a process fetches from and Sidekiq's rule for ordering them before each fetch
//! (strict, or weighted and shuffled), and the name of a queue's list, `queue:<q>`.
//! Touches no Redis keys itself.

use rand::seq::SliceRandom;

/// The list a queue's jobs wait in, as Sidekiq names it.
pub fn queue_key(queue: &str) -> String {
    format!("queue:{queue}")
}

/// The configured queues and weights, and Sidekiq's rule for ordering them before each fetch.
#[derive(Debug, Clone)]
pub struct QueueOrder {
    /// (name, weight) as configured; weight 0 = none given.
    pub queues: Vec<(String, u32)>,
}

impl QueueOrder {
    /// Unique queue names in configured order.
    pub fn names(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for (q, _) in &self.queues {
            if !out.contains(q) {
                out.push(q.clone());
            }
        }
        out
    }

    /// Strict unless some weight is > 0 (6.4.1's rule).
    pub fn weighted(&self) -> bool {
        self.queues.iter().any(|(_, w)| *w > 0)
    }

    /// The order for one fetch: strict = configured; weighted = each queue repeated by its weight
    /// (0 counts as 1), shuffled, then first occurrences kept.
    pub fn order(&self) -> Vec<String> {
        if !self.weighted() {
            return self.names();
        }
        let mut expanded: Vec<&String> = Vec::new();
        for (q, w) in &self.queues {
            for _ in 0..(*w).max(1) {
                expanded.push(q);
            }
        }
        expanded.shuffle(&mut rand::rng());
        let mut out: Vec<String> = Vec::new();
        for q in expanded {
            if !out.contains(q) {
                out.push(q.clone());
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strict_order_is_configured_order_deduplicated() {
        let q = QueueOrder {
            queues: vec![("a".into(), 0), ("b".into(), 0), ("a".into(), 0)],
        };
        assert!(!q.weighted());
        assert_eq!(q.order(), vec!["a", "b"]);
    }

    #[test]
    fn weighted_order_follows_weights() {
        let q = QueueOrder {
            queues: vec![("hi".into(), 3), ("lo".into(), 1)],
        };
        let firsts = (0..4000).filter(|_| q.order()[0] == "hi").count();
        // Expect about 3/4 first; a wide band keeps this from flaking.
        assert!((2700..3300).contains(&firsts), "{firsts}");
        assert_eq!(q.order().len(), 2);
    }
}

//! The queues a process fetches from and Sidekiq's rule for ordering them before each fetch
//! (strict, or weighted and shuffled), and the name of a queue's list, `queue:<q>`.
//! Touches no Redis keys itself.

use rand::seq::SliceRandom;

/// The list a queue's jobs wait in, as Sidekiq names it.
pub fn queue_key(queue: &str) -> String {
    format!("queue:{queue}")
}

/// The configured queues and weights, and Sidekiq's rule for ordering them before each fetch.
/// Built once (`new`): the unique names and the weighted draw list are kept, so ordering for a
/// fetch allocates one small vector and never compares names.
#[derive(Debug, Clone)]
pub struct QueueOrder {
    /// (name, weight) as configured; weight 0 = none given.
    queues: Vec<(String, u32)>,
    /// Unique names in configured order.
    unique: Vec<String>,
    /// Weighted: each queue's index in `unique`, repeated by its weight (0 counts as 1).
    /// Empty when no weight is > 0 (strict, 6.4.1's rule).
    draws: Vec<usize>,
}

impl QueueOrder {
    pub fn new(queues: Vec<(String, u32)>) -> QueueOrder {
        let mut unique: Vec<String> = Vec::new();
        for (q, _) in &queues {
            if !unique.contains(q) {
                unique.push(q.clone());
            }
        }
        let weighted = queues.iter().any(|(_, w)| *w > 0);
        let mut draws = Vec::new();
        if weighted {
            for (q, w) in &queues {
                let i = unique.iter().position(|u| u == q).expect("listed above");
                draws.extend(std::iter::repeat_n(i, (*w).max(1) as usize));
            }
        }
        QueueOrder {
            queues,
            unique,
            draws,
        }
    }

    /// (name, weight) as configured.
    pub fn configured(&self) -> &[(String, u32)] {
        &self.queues
    }

    /// Unique queue names in configured order.
    pub fn names(&self) -> Vec<String> {
        self.unique.clone()
    }

    /// Strict unless some weight is > 0 (6.4.1's rule).
    pub fn weighted(&self) -> bool {
        !self.draws.is_empty()
    }

    /// The order for one fetch: strict = configured; weighted = each queue repeated by its weight
    /// (0 counts as 1), shuffled, then first occurrences kept.
    pub fn order(&self) -> Vec<&str> {
        if !self.weighted() {
            return self.unique.iter().map(String::as_str).collect();
        }
        let mut draws = self.draws.clone();
        draws.shuffle(&mut rand::rng());
        let mut seen = vec![false; self.unique.len()];
        let mut out = Vec::with_capacity(self.unique.len());
        for i in draws {
            if !std::mem::replace(&mut seen[i], true) {
                out.push(self.unique[i].as_str());
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
        let q = QueueOrder::new(vec![("a".into(), 0), ("b".into(), 0), ("a".into(), 0)]);
        assert!(!q.weighted());
        assert_eq!(q.order(), vec!["a", "b"]);
    }

    #[test]
    fn weighted_order_follows_weights() {
        let q = QueueOrder::new(vec![("hi".into(), 3), ("lo".into(), 1)]);
        let firsts = (0..4000).filter(|_| q.order()[0] == "hi").count();
        // Expect about 3/4 first; a wide band keeps this from flaking.
        assert!((2700..3300).contains(&firsts), "{firsts}");
        assert_eq!(q.order().len(), 2);
    }
}

//! The `capsules` element of the heartbeat's `info` JSON, as Sidekiq 8.1's launcher.rb writes
//! it (`capsule.rb` `to_h`): one capsule, `default`, with its concurrency, its fetch mode and
//! its queue weights. 8.1's Busy page lists a process's queues from it; without it the page
//! takes the branch its source marks as deprecated. Touches no Redis keys.

use crate::worker::config::Config;
use serde_json::{json, Map, Value};

/// `{"default": {"concurrency": N, "mode": M, "weights": {queue: weight, ...}}}`, the mode
/// as capsule.rb names it: `strict` when every weight is 0, `random` when every one is 1,
/// else `weighted`.
pub fn capsules(cfg: &Config) -> Value {
    let mut weights = Map::new();
    for (queue, weight) in cfg.queues.configured() {
        // capsule.rb fills a hash: a queue given twice keeps its last weight, in first place.
        weights.insert(queue.clone(), json!(weight));
    }
    let all = |w: u64| weights.values().all(|v| v.as_u64() == Some(w));
    let mode = if all(0) {
        "strict"
    } else if all(1) {
        "random"
    } else {
        "weighted"
    };
    json!({
        "default": {"concurrency": cfg.concurrency, "mode": mode, "weights": weights}
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::queues::QueueOrder;

    fn cfg(queues: &[(&str, u32)], concurrency: usize) -> Config {
        Config {
            queues: QueueOrder::new(queues.iter().map(|(q, w)| (q.to_string(), *w)).collect()),
            concurrency,
            ..Config::default()
        }
    }

    /// The example in Sidekiq 8.1's api.rb (`Sidekiq::Process`), key for key.
    #[test]
    fn as_sidekiq_8_1_writes_them() {
        let got = capsules(&cfg(&[("default", 2), ("low", 1)], 5));
        let want: Value = serde_json::from_str(
            r#"{"default" : {"mode" : "weighted", "concurrency" : 5, "weights" : {"default" : 2, "low" : 1}}}"#,
        )
        .unwrap();
        assert_eq!(got, want);
        let strict = capsules(&cfg(&[("critical", 0), ("default", 0)], 3));
        assert_eq!(strict["default"]["mode"], "strict");
        assert_eq!(
            serde_json::to_string(&strict["default"]["weights"]).unwrap(),
            r#"{"critical":0,"default":0}"#
        );
        assert_eq!(
            capsules(&cfg(&[("a", 1), ("b", 1)], 3))["default"]["mode"],
            "random"
        );
    }
}

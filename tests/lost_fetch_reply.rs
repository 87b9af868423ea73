//! A fetch whose reply is lost (Redis ran the script after the client's response timeout; the
//! test makes Redis sleep with DEBUG SLEEP while the worker fetches) leaves the jobs it moved
//! in the worker's working list, unknown to it. They must go back to their queue and run while
//! the worker stays busy, not only once it is completely idle: a feeder keeps the queue from
//! ever emptying, and every job pushed before the sleep must still run, exactly once.
//! Real binary, real redis-server; waits are conditions with deadlines.
mod support;

use serde_json::json;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use support::*;

fn job(jid: &str) -> String {
    json!({"retry": true, "queue": "default", "class": "RecJob", "args": [],
        "jid": jid, "created_at": 1.0, "enqueued_at": 1.0})
    .to_string()
}

/// Pushes jobs whenever `queue:default` holds fewer than 20, until `stop`; the jids pushed.
fn feeder(client: redis::Client, stop: Arc<AtomicBool>, pushed: Arc<Mutex<Vec<String>>>) {
    let mut c = client.get_connection().unwrap();
    let n = AtomicUsize::new(0);
    while !stop.load(Ordering::Relaxed) {
        let len: usize = redis::cmd("LLEN")
            .arg("queue:default")
            .query(&mut c)
            .unwrap();
        if len < 20 {
            let jids: Vec<String> = (0..30)
                .map(|_| format!("feed{:08}", n.fetch_add(1, Ordering::Relaxed)))
                .collect();
            let payloads: Vec<String> = jids.iter().map(|j| job(j)).collect();
            let _: () = redis::cmd("LPUSH")
                .arg("queue:default")
                .arg(&payloads)
                .query(&mut c)
                .unwrap();
            pushed.lock().unwrap().extend(jids);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn jobs_a_lost_fetch_reply_moved_run_while_the_worker_stays_busy() {
    let redis = RedisServer::start_with(&["--enable-debug-command", "yes"]);
    let p = Project::new();
    p.script(
        "jobs/bin/rec",
        "#!/bin/sh\nsleep 0.02\necho \"$PLAYGUARD_JID\" >> ledger.txt\n",
    );
    p.write(
        "jobs/app.toml",
        "[[job]]\nclass = \"RecJob\"\nrun = [\"jobs/bin/rec\"]\n",
    );
    let stop = Arc::new(AtomicBool::new(false));
    let pushed = Arc::new(Mutex::new(Vec::new()));
    let feed = {
        let (stop, pushed) = (stop.clone(), pushed.clone());
        let client = redis.client();
        std::thread::spawn(move || feeder(client, stop, pushed))
    };
    let w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-c", "4"])
        .start();
    wait_until("jobs run", Duration::from_secs(30), || {
        p.lines("ledger.txt").len() >= 50
    });
    // Longer than the worker's response timeout (5 s), shorter than its liveness budget.
    let _: () = redis::cmd("DEBUG")
        .arg("SLEEP")
        .arg(5.5)
        .query(&mut redis.conn())
        .unwrap();
    w.wait_for_line("fetch: Redis error", Duration::from_secs(20));
    let before: Vec<String> = pushed.lock().unwrap().clone();
    wait_until(
        "every job pushed before the lost reply ran, the queue never empty",
        Duration::from_secs(90),
        || {
            let ran: std::collections::HashSet<String> =
                p.lines("ledger.txt").into_iter().collect();
            before.iter().all(|j| ran.contains(j))
        },
    );
    // The scenario happened: the lost fetch had moved jobs, and they were pushed back.
    w.wait_for_line(
        "returned jobs a failed fetch had moved",
        Duration::from_secs(30),
    );
    stop.store(true, Ordering::Relaxed);
    feed.join().unwrap();
    let all: Vec<String> = pushed.lock().unwrap().clone();
    wait_until("every job ran", Duration::from_secs(90), || {
        p.lines("ledger.txt").len() >= all.len()
    });
    let mut runs: HashMap<String, usize> = HashMap::new();
    for j in p.lines("ledger.txt") {
        *runs.entry(j).or_default() += 1;
    }
    let twice: Vec<_> = runs.iter().filter(|(_, &n)| n > 1).collect();
    assert!(twice.is_empty(), "ran more than once: {twice:?}");
    assert_eq!(runs.len(), all.len());
}

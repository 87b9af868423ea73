//! Mutual exclusion under contention: 50 tokio tasks in two OS processes (25 each) hammer
//! one lock for about 8 s. Redis keys: `lock:contended`, `lock:contended:fence`, and the list
//! `ledger` where each holder records `<fence>` on entry and `end:<fence>` on exit.
//!
//! The second process is this test binary run again with `--exact contention_child` and
//! `PLAYGUARD_LOCK_CONTENTION_URL` set; without that variable `contention_child` does nothing.

mod support;

use playguard::lock::acquire;
use playguard::redis_conn::shared;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use support::RedisServer;
use tokio::task::JoinSet;

const KEY: &str = "lock:contended";
const LEDGER: &str = "ledger";
const TASKS_PER_PROCESS: usize = 25;
const HAMMER_FOR: Duration = Duration::from_secs(8);
/// Long next to the few milliseconds each holder keeps the lock, so a slow scheduler on a
/// 2-core machine does not turn into a lost lease; exclusion does not depend on the TTL.
const TTL: Duration = Duration::from_secs(2);
const CHILD_URL: &str = "PLAYGUARD_LOCK_CONTENTION_URL";
const CHILD_UNTIL: &str = "PLAYGUARD_LOCK_CONTENTION_UNTIL_MS";

#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    holds: u64,
    refused: u64,
    lost: u64,
}

fn now_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis()
}

/// One worker task: try the lock until `until_ms`; while holding, renew, record entry,
/// pause briefly, record exit, renew, release.
async fn worker(conn: playguard::redis_conn::Conn, until_ms: u128) -> Tally {
    let mut t = Tally::default();
    while now_ms() < until_ms {
        let Some(mut lease) = acquire(&conn, KEY, TTL).await.expect("acquire") else {
            t.refused += 1;
            let ms = rand::random_range(1..=4u64);
            tokio::time::sleep(Duration::from_millis(ms)).await;
            continue;
        };
        if lease.renew().await.is_err() {
            // Protocol: a holder that cannot confirm ownership does no work.
            t.lost += 1;
            let _ = lease.release().await;
            continue;
        }
        let fence = lease.fence();
        redis::cmd("RPUSH")
            .arg(LEDGER)
            .arg(fence.to_string())
            .query_async::<()>(&mut conn.clone())
            .await
            .expect("rpush start");
        let ms = rand::random_range(1..=3u64);
        tokio::time::sleep(Duration::from_millis(ms)).await;
        redis::cmd("RPUSH")
            .arg(LEDGER)
            .arg(format!("end:{fence}"))
            .query_async::<()>(&mut conn.clone())
            .await
            .expect("rpush end");
        if lease.renew().await.is_err() {
            t.lost += 1;
        }
        assert!(
            lease.release().await.expect("release"),
            "holder {fence} found its lock gone at release"
        );
        t.holds += 1;
    }
    t
}

async fn hammer(url: &str, until_ms: u128) -> Tally {
    let client = redis::Client::open(url).unwrap();
    let conn = shared(&client).await.expect("connect");
    let mut set = JoinSet::new();
    for _ in 0..TASKS_PER_PROCESS {
        set.spawn(worker(conn.clone(), until_ms));
    }
    let mut total = Tally::default();
    while let Some(t) = set.join_next().await {
        let t = t.expect("worker task panicked");
        total.holds += t.holds;
        total.refused += t.refused;
        total.lost += t.lost;
    }
    total
}

/// The second process's half of the contention test; a no-op unless the parent set the URL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contention_child() {
    let Ok(url) = std::env::var(CHILD_URL) else {
        return;
    };
    let until_ms: u128 = std::env::var(CHILD_UNTIL).unwrap().parse().unwrap();
    let t = hammer(&url, until_ms).await;
    println!("CHILD_TALLY holds={} lost={}", t.holds, t.lost);
}

/// 50 tasks in two processes fight over one lock; the ledger must show strictly alternating
/// `<fence>` / `end:<fence>` pairs with strictly increasing fences: no two holders overlapped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_two_holders_overlap_across_two_processes() {
    let redis = RedisServer::start();
    let until_ms = now_ms() + HAMMER_FOR.as_millis();
    let child = tokio::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "contention_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_URL, redis.url())
        .env(CHILD_UNTIL, until_ms.to_string())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn the second process");

    let mine = hammer(&redis.url(), until_ms).await;
    let out = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
        .await
        .expect("second process finishes")
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "second process failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout
        .lines()
        .find_map(|l| l.split_once("CHILD_TALLY").map(|(_, rest)| rest))
        .unwrap_or_else(|| panic!("no tally from the second process:\n{stdout}"));
    let field = |name: &str| -> u64 {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{name}=")).map(str::to_owned))
            .unwrap()
            .parse()
            .unwrap()
    };
    let (child_holds, child_lost) = (field("holds"), field("lost"));
    eprintln!("this process: {mine:?}; second process: holds={child_holds} lost={child_lost}");
    assert!(mine.holds > 0 && child_holds > 0, "both processes held it");
    assert_eq!(mine.lost + child_lost, 0, "no lease lost under this load");

    let ledger: Vec<String> = redis::cmd("LRANGE")
        .arg(LEDGER)
        .arg(0)
        .arg(-1)
        .query(&mut redis.conn())
        .unwrap();
    assert_eq!(ledger.len() % 2, 0, "every entry has its exit");
    let mut last = i64::MIN;
    for pair in ledger.chunks(2) {
        let fence: i64 = pair[0]
            .parse()
            .unwrap_or_else(|_| panic!("expected an entry, found {:?}", pair[0]));
        assert_eq!(
            pair[1],
            format!("end:{fence}"),
            "holder {fence} overlapped with another"
        );
        assert!(fence > last, "fence {fence} after {last}");
        last = fence;
    }
    assert_eq!(ledger.len() as u64 / 2, mine.holds + child_holds);
}

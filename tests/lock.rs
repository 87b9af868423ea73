//! Token lock scenarios against a private redis-server. Redis keys: `lock:*` and
//! `lock:*:fence` (the locks under test), `channel:7`, `seatmap:12`, `export:7` (fenced rows),
//! `export:7:sent` (a send counter), `once:*` (dispatch fingerprints).
//!
//! Seed 004's timelines are scaled from 30 s leases to 300 ms: a "freeze" is a sleep past the
//! lease, the only kind of bare sleep used here.

mod support;

use playguard::lock::{acquire, fenced_set, first_in_window as once, LockLost};
use playguard::redis_conn::Conn as MultiplexedConnection;
use playguard::redis_conn::{shared, shared_with_timeout};
use std::future::Future;
use std::time::Duration;
use support::RedisServer;

// Long enough that a loaded CI machine never stalls a holder past its lease by accident, short
// enough that the timelines which freeze a holder past it stay quick.
const TTL: Duration = Duration::from_millis(1000);
/// How long a test waits for a condition before failing.
const PATIENCE: Duration = Duration::from_secs(5);

async fn connect(redis: &RedisServer) -> MultiplexedConnection {
    shared(&redis.client())
        .await
        .expect("connect to test redis")
}

async fn wait_for<F, Fut>(what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !cond().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn get(conn: &MultiplexedConnection, key: &str) -> Option<String> {
    redis::cmd("GET")
        .arg(key)
        .query_async(&mut conn.clone())
        .await
        .unwrap()
}

async fn exists(conn: &MultiplexedConnection, key: &str) -> bool {
    redis::cmd("EXISTS")
        .arg(key)
        .query_async::<i64>(&mut conn.clone())
        .await
        .unwrap()
        == 1
}

async fn hget(conn: &MultiplexedConnection, key: &str, field: &str) -> Option<String> {
    redis::cmd("HGET")
        .arg(key)
        .arg(field)
        .query_async(&mut conn.clone())
        .await
        .unwrap()
}

/// Sleep past a lease so Redis expires it (the simulated freeze), then make sure it is gone.
/// Seed 004's starting point: the lock's fence counter and the guarded row both at 32.
async fn seed_at_fence_32(conn: &MultiplexedConnection, lock_key: &str, row: &str, value: &str) {
    redis::cmd("SET")
        .arg(format!("{lock_key}:fence"))
        .arg(32)
        .query_async::<()>(&mut conn.clone())
        .await
        .unwrap();
    redis::cmd("HSET")
        .arg(row)
        .arg("fence")
        .arg(32)
        .arg("value")
        .arg(value)
        .query_async::<()>(&mut conn.clone())
        .await
        .unwrap();
}

async fn freeze_past_lease(conn: &MultiplexedConnection, key: &str) {
    tokio::time::sleep(TTL + Duration::from_millis(50)).await;
    wait_for("the frozen holder's key to expire", || {
        exists_not(conn, key)
    })
    .await;
}

async fn exists_not(conn: &MultiplexedConnection, key: &str) -> bool {
    !exists(conn, key).await
}

/// Seed 004, hourly digest: W1 freezes past its lease, W2 takes the lock, W1 wakes and runs
/// its cleanup. Its release must not free W2's lock, so W3 is refused while W2 works.
#[tokio::test]
async fn stalled_holder_cannot_release_the_next_owners_lock() {
    let redis = RedisServer::start();
    let (c1, c2, c3) = (
        connect(&redis).await,
        connect(&redis).await,
        connect(&redis).await,
    );
    let key = "lock:digest";

    let w1 = acquire(&c1, key, TTL).await.unwrap().expect("W1 takes it");
    freeze_past_lease(&c1, key).await;
    assert_eq!(w1.remaining(), Duration::ZERO);

    let w2 = acquire(&c2, key, TTL).await.unwrap().expect("W2 takes it");
    assert!(w2.fence() > w1.fence());
    assert_ne!(w2.token(), w1.token());

    assert!(
        !w1.release().await.unwrap(),
        "W1's late release deletes nothing"
    );
    assert_eq!(get(&c3, key).await.as_deref(), Some(w2.token()));

    assert!(
        acquire(&c3, key, TTL).await.unwrap().is_none(),
        "W3 is refused while W2 holds the lock"
    );
    assert!(w2.release().await.unwrap());
    assert!(!exists(&c3, key).await);
}

/// Seed 004, retention setting: counter and row at fence 32; W1 gets a higher fence (33 in the
/// seed; the Redis clock in microseconds here, see lua/lock_acquire.lua), freezes, W2 a higher one.
/// W1's first late write still lands (nobody newer has written), W2 writes, and W1's second
/// write is refused, so the row ends with W2's value.
#[tokio::test]
async fn fenced_writes_reject_the_stale_holders_second_write() {
    let redis = RedisServer::start();
    let (c1, c2) = (connect(&redis).await, connect(&redis).await);
    let key = "lock:retention";
    let row = "channel:7";
    seed_at_fence_32(&c1, "lock:retention", row, "7").await;

    let mut w1 = acquire(&c1, key, TTL).await.unwrap().expect("W1 takes it");
    assert!(
        w1.fence() > 32,
        "W1's fence {} is above the row's",
        w1.fence()
    );
    freeze_past_lease(&c1, key).await;
    let w2 = acquire(&c2, key, TTL).await.unwrap().expect("W2 takes it");
    assert!(w2.fence() > w1.fence());

    assert!(fenced_set(&c1, row, w1.fence(), "30").await.unwrap());
    assert!(fenced_set(&c2, row, w2.fence(), "90").await.unwrap());
    assert!(
        !fenced_set(&c1, row, w1.fence(), "30").await.unwrap(),
        "W1's stale write is refused"
    );
    assert_eq!(hget(&c2, row, "value").await.as_deref(), Some("90"));
    assert_eq!(hget(&c2, row, "fence").await, Some(w2.fence().to_string()));

    assert_eq!(w1.renew().await, Err(LockLost::NotOwner));
    assert!(w2.release().await.unwrap());
}

/// Seed 004, seat map (33 and 34 in the seed stand for any two rising fences): W1 reads 'building' and freezes before its write; W2 (34) writes;
/// an admin resets the status to 'building'. W1's write then passes a status check but must
/// still lose to the fence.
#[tokio::test]
async fn fence_rejects_stale_write_after_admin_reset() {
    let redis = RedisServer::start();
    let (c1, c2, admin) = (
        connect(&redis).await,
        connect(&redis).await,
        connect(&redis).await,
    );
    let key = "lock:seatmap";
    let row = "seatmap:12";
    seed_at_fence_32(&admin, "lock:seatmap", row, "building").await;

    let w1 = acquire(&c1, key, TTL).await.unwrap().expect("W1 takes it");
    assert!(w1.fence() > 32);
    assert_eq!(hget(&c1, row, "value").await.as_deref(), Some("building"));
    freeze_past_lease(&c1, key).await;

    let w2 = acquire(&c2, key, TTL).await.unwrap().expect("W2 takes it");
    assert!(w2.fence() > w1.fence());
    assert_eq!(hget(&c2, row, "value").await.as_deref(), Some("building"));
    assert!(fenced_set(&c2, row, w2.fence(), "ready:snapshot-34")
        .await
        .unwrap());

    // The admin's manual rebuild resets the status without holding the lock.
    redis::cmd("HSET")
        .arg(row)
        .arg("value")
        .arg("building")
        .query_async::<()>(&mut admin.clone())
        .await
        .unwrap();

    // A status guard ("write only if still building") would accept W1 now...
    assert_eq!(hget(&c1, row, "value").await.as_deref(), Some("building"));
    // ...the fence does not.
    assert!(!fenced_set(&c1, row, w1.fence(), "ready:snapshot-33")
        .await
        .unwrap());
    assert_eq!(
        hget(&admin, row, "value").await.as_deref(),
        Some("building")
    );
    assert_eq!(
        hget(&admin, row, "fence").await,
        Some(w2.fence().to_string())
    );
    assert!(!w1.release().await.unwrap());
    assert!(w2.release().await.unwrap());
}

/// A renew after someone else took the key is `NotOwner`, leaves their key alone, and
/// zeroes `remaining()`; the late release with the old token deletes nothing.
#[tokio::test]
async fn renew_after_ownership_changed_is_not_owner() {
    let redis = RedisServer::start();
    let c = connect(&redis).await;
    let key = "lock:owner";

    let mut w1 = acquire(&c, key, TTL).await.unwrap().unwrap();
    freeze_past_lease(&c, key).await;
    let w2 = acquire(&c, key, TTL).await.unwrap().unwrap();

    let lost = w1.renew().await.unwrap_err();
    assert_eq!(lost, LockLost::NotOwner);
    assert!(lost.to_string().contains("another owner"), "{lost}");
    assert_eq!(w1.remaining(), Duration::ZERO);
    assert_eq!(get(&c, key).await.as_deref(), Some(w2.token()));

    assert!(!w1.release().await.unwrap());
    assert_eq!(get(&c, key).await.as_deref(), Some(w2.token()));
    assert!(w2.release().await.unwrap());
}

/// Renewing an expired lock is `Missing`, and the key is not recreated.
#[tokio::test]
async fn renew_of_expired_key_is_missing_and_does_not_recreate_it() {
    let redis = RedisServer::start();
    let c = connect(&redis).await;
    let key = "lock:expired";

    let mut lease = acquire(&c, key, TTL).await.unwrap().unwrap();
    freeze_past_lease(&c, key).await;

    assert_eq!(lease.renew().await, Err(LockLost::Missing));
    assert!(!exists(&c, key).await, "renew must not recreate the key");
    assert!(!lease.release().await.unwrap());
}

/// A successful renew resets the server TTL to the full lease and moves the local deadline.
#[tokio::test]
async fn renew_extends_the_lease() {
    let redis = RedisServer::start();
    let c = connect(&redis).await;
    let key = "lock:renew";
    let ttl = Duration::from_secs(10);

    let mut lease = acquire(&c, key, ttl).await.unwrap().unwrap();
    assert!(lease.remaining() <= ttl && lease.remaining() > Duration::ZERO);
    let before = lease.deadline();
    // Stand in for elapsed time: shorten the server TTL directly.
    redis::cmd("PEXPIRE")
        .arg(key)
        .arg(1000)
        .query_async::<()>(&mut c.clone())
        .await
        .unwrap();

    lease.renew().await.unwrap();
    let pttl: i64 = redis::cmd("PTTL")
        .arg(key)
        .query_async(&mut c.clone())
        .await
        .unwrap();
    assert!(pttl > 5000, "PTTL after renew = {pttl}");
    assert!(lease.deadline() >= before);
    assert_eq!(get(&c, key).await.as_deref(), Some(lease.token()));
    assert!(lease.release().await.unwrap());
}

/// A key overwritten with another type makes the renew script error: that is `LockLost`
/// too, never success.
#[tokio::test]
async fn renew_script_error_is_lock_lost() {
    let redis = RedisServer::start();
    let c = connect(&redis).await;
    let key = "lock:wrongtype";

    let mut lease = acquire(&c, key, TTL).await.unwrap().unwrap();
    redis::cmd("DEL")
        .arg(key)
        .query_async::<()>(&mut c.clone())
        .await
        .unwrap();
    redis::cmd("RPUSH")
        .arg(key)
        .arg("x")
        .query_async::<()>(&mut c.clone())
        .await
        .unwrap();
    assert!(matches!(lease.renew().await, Err(LockLost::Redis(_))));
}

/// Redis frozen (SIGSTOP) during a renew: the renew comes back as `LockLost::Redis` once the
/// client's response timeout fires instead of hanging; after SIGCONT the lease can be released.
#[tokio::test]
async fn renew_against_a_frozen_redis_is_lock_lost_not_a_hang() {
    let redis = RedisServer::start();
    let conn = shared_with_timeout(&redis.client(), Duration::from_millis(300))
        .await
        .unwrap();
    let key = "lock:paused";
    let mut lease = acquire(&conn, key, Duration::from_secs(5))
        .await
        .unwrap()
        .unwrap();

    redis.pause();
    let outcome = tokio::time::timeout(Duration::from_secs(3), lease.renew()).await;
    redis.resume();
    let lost = outcome
        .expect("renew returned within the client timeout")
        .unwrap_err();
    assert!(matches!(lost, LockLost::Redis(_)), "{lost:?}");
    assert_eq!(lease.remaining(), Duration::ZERO);

    let released = tokio::time::timeout(Duration::from_secs(3), lease.release())
        .await
        .expect("release returns after resume");
    assert!(
        released.unwrap(),
        "the key was still ours; release deletes it"
    );
}

/// Redis killed: renew is `LockLost::Redis`, promptly.
#[tokio::test]
async fn renew_against_a_dead_redis_is_lock_lost() {
    let mut redis = RedisServer::start();
    let conn = shared_with_timeout(&redis.client(), Duration::from_millis(300))
        .await
        .unwrap();
    let mut lease = acquire(&conn, "lock:killed", Duration::from_secs(5))
        .await
        .unwrap()
        .unwrap();

    redis.stop();
    let outcome = tokio::time::timeout(Duration::from_secs(3), lease.renew()).await;
    let lost = outcome
        .expect("renew returned within the client timeout")
        .unwrap_err();
    assert!(matches!(lost, LockLost::Redis(_)), "{lost:?}");
    assert!(lease.release().await.is_err());
}

/// Redis restarted without persistence (data gone): a lease from before reports `LockLost`,
/// the key is not recreated, and the next fence is still above every fence handed out
/// before the restart (the lost counter does not start again at 1).
#[tokio::test]
async fn lease_from_before_a_restart_is_lost_and_fences_still_increase() {
    let mut redis = RedisServer::start();
    let conn = shared_with_timeout(&redis.client(), Duration::from_millis(300))
        .await
        .unwrap();
    let key = "lock:restart";
    let first = acquire(&conn, key, TTL).await.unwrap().unwrap();
    assert!(first.release().await.unwrap());
    let mut lease = acquire(&conn, key, Duration::from_secs(5))
        .await
        .unwrap()
        .unwrap();
    assert!(lease.fence() > first.fence());

    redis.restart();
    let outcome = tokio::time::timeout(Duration::from_secs(3), lease.renew()).await;
    let lost = outcome
        .expect("renew returned within the client timeout")
        .unwrap_err();
    // The old connection is either dropped (Redis error) or, if it reconnected, finds no key.
    eprintln!("renew after restart: {lost}");
    assert!(
        matches!(lost, LockLost::Redis(_) | LockLost::Missing),
        "{lost:?}"
    );

    let fresh = connect(&redis).await;
    assert!(
        !exists(&fresh, key).await,
        "renew must not recreate the key"
    );
    assert!(
        !exists(&fresh, &format!("{key}:fence")).await,
        "the counter is gone"
    );
    let next = acquire(&fresh, key, TTL).await.unwrap().unwrap();
    assert!(
        next.fence() > lease.fence(),
        "after the restart fence {} must exceed {} from before",
        next.fence(),
        lease.fence()
    );
    assert!(next.release().await.unwrap());
}

/// The fence counter lost between acquisitions (as a Redis that restarts empty loses it):
/// fences keep increasing, and a counter set above the clock (as an operator may seed it) is
/// still counted up from, never ignored.
#[tokio::test]
async fn fences_increase_across_a_lost_counter_and_follow_a_high_counter() {
    let redis = RedisServer::start();
    let c = connect(&redis).await;
    let key = "lock:flushed";
    let mut last = 0;
    for _ in 0..3 {
        let l = acquire(&c, key, TTL).await.unwrap().unwrap();
        assert!(l.fence() > last, "{} after {last}", l.fence());
        last = l.fence();
        assert!(l.release().await.unwrap());
        redis::cmd("DEL")
            .arg(key)
            .arg(format!("{key}:fence"))
            .query_async::<()>(&mut c.clone())
            .await
            .unwrap();
    }
    let high = 8_000_000_000_000_000i64;
    redis::cmd("SET")
        .arg(format!("{key}:fence"))
        .arg(high)
        .query_async::<()>(&mut c.clone())
        .await
        .unwrap();
    let l = acquire(&c, key, TTL).await.unwrap().unwrap();
    assert_eq!(l.fence(), high + 1);
    assert_eq!(
        get(&c, &format!("{key}:fence")).await,
        Some((high + 1).to_string())
    );
    assert!(l.release().await.unwrap());
}

/// once(): the first caller in a window wins, the rest are refused until the TTL passes.
#[tokio::test]
async fn once_fires_once_per_window() {
    let redis = RedisServer::start();
    let c = connect(&redis).await;
    let key = "once:marquee-7:tick-42";

    assert!(once(&c, key, TTL).await.unwrap());
    assert!(!once(&c, key, TTL).await.unwrap());
    assert!(!once(&c, key, TTL).await.unwrap());
    let pttl: i64 = redis::cmd("PTTL")
        .arg(key)
        .query_async(&mut c.clone())
        .await
        .unwrap();
    assert!(pttl > 0 && pttl <= TTL.as_millis() as i64, "PTTL {pttl}");

    wait_for("the once key to expire and fire again", || async {
        once(&c, key, TTL).await.unwrap()
    })
    .await;
}

/// Refused and invalid requests: a zero TTL is an error, not a lock that never expires.
#[tokio::test]
async fn zero_ttl_is_an_error() {
    let redis = RedisServer::start();
    let c = connect(&redis).await;
    assert!(acquire(&c, "lock:zero", Duration::ZERO).await.is_err());
    assert!(once(&c, "once:zero", Duration::ZERO).await.is_err());
    assert!(!exists(&c, "lock:zero").await);
}

/// Seed 004, channel export: W1 takes the lock (33) and freezes just before sending; W2 is
/// refused, retries, and gets the lock (34) once W1's lease ends. W2 claims the row with its
/// fence and sends. When W1 wakes, its local deadline has passed and a renew fails, so it
/// does not send; its fenced "done" write would be refused anyway. One export, not two.
#[tokio::test]
async fn frozen_exporter_checks_its_lease_before_the_side_effect() {
    let redis = RedisServer::start();
    let (c1, c2) = (connect(&redis).await, connect(&redis).await);
    let key = "lock:export-7";
    let row = "export:7";
    seed_at_fence_32(&c1, "lock:export-7", row, "pending").await;

    // Sending is the side effect to guard: it checks the lease, renews, then counts a send.
    async fn send_if_still_owner(
        c: &MultiplexedConnection,
        lease: &mut playguard::lock::Lease,
    ) -> bool {
        if lease.remaining().is_zero() || lease.renew().await.is_err() {
            return false;
        }
        redis::cmd("INCR")
            .arg("export:7:sent")
            .query_async::<()>(&mut c.clone())
            .await
            .unwrap();
        true
    }

    let mut w1 = acquire(&c1, key, TTL).await.unwrap().expect("W1 takes it");
    assert!(w1.fence() > 32);
    assert_eq!(hget(&c1, row, "value").await.as_deref(), Some("pending"));

    // W2 starts while W1 holds the lock: refused, so it retries until W1's lease runs out.
    assert!(acquire(&c2, key, TTL).await.unwrap().is_none());
    let give_up = tokio::time::Instant::now() + PATIENCE;
    let mut w2 = loop {
        if let Some(lease) = acquire(&c2, key, TTL).await.unwrap() {
            break lease;
        }
        assert!(
            tokio::time::Instant::now() < give_up,
            "W2 never got the lock after W1's lease ended"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(w2.fence() > w1.fence());
    assert!(fenced_set(&c2, row, w2.fence(), "sending").await.unwrap());
    assert!(send_if_still_owner(&c2, &mut w2).await);
    assert!(fenced_set(&c2, row, w2.fence(), "done").await.unwrap());

    // W1 wakes from its freeze.
    assert!(!send_if_still_owner(&c1, &mut w1).await, "W1 must not send");
    assert!(!fenced_set(&c1, row, w1.fence(), "done").await.unwrap());
    let sent: i64 = redis::cmd("GET")
        .arg("export:7:sent")
        .query_async(&mut c1.clone())
        .await
        .unwrap();
    assert_eq!(sent, 1);
    assert!(!w1.release().await.unwrap());
    assert!(w2.release().await.unwrap());
}

//! The scheduled poller, as Sidekiq's scheduled.rb: due members of `retry`, then `schedule`,
//! are pushed onto `queue:<q>` (with `SADD queues` and a fresh `enqueued_at`) by one Lua script
//! that removes and pushes in the same step, so no crash can lose a job in between.
//! A job whose queue key holds another type goes to `dead` with the reason (Playguard::BadQueueKey);
//! each burial is reported as a death by the process that made it (`report/`).
//! Interval: Sidekiq's random_poll_interval around `poll_interval_average` times the number
//! of processes, so a fleet polls on average once per `poll_interval_average`.

use crate::job::error_class;
use crate::job::payload::{dump, now_f64, now_value, uses_millis};
use crate::job::report::Reporter;
use crate::worker::Worker;
use serde_json::Value;
use std::time::Duration;

static PUSH: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("../../lua/schedule_push.lua")));

/// How many due members one script call moves.
const BATCH: isize = 100;

/// Rewrite a due member as the job to push: new `enqueued_at` in the job's own unit.
/// None = not a JSON object (it goes to `dead` as is).
pub fn prepare(member: &[u8]) -> Option<(String, String)> {
    let Ok(Value::Object(mut msg)) = serde_json::from_slice::<Value>(member) else {
        return None;
    };
    let queue = msg
        .get("queue")
        .and_then(Value::as_str)
        .unwrap_or("default")
        .to_string();
    msg.insert("enqueued_at".into(), now_value(uses_millis(&msg)));
    Some((dump(&msg), queue))
}

/// Move every due member of `set`; returns how many moved.
pub async fn enqueue_due(worker: &Worker, set: &str) -> redis::RedisResult<usize> {
    let mut conn = worker.conn.clone();
    let mut total = 0;
    loop {
        let now = now_f64();
        // Bytes: a member that is not UTF-8 must not stall the poller; it goes to dead as is.
        let due: Vec<Vec<u8>> = redis::cmd("ZRANGE")
            .arg(set)
            .arg("-inf")
            .arg(now.to_string())
            .arg("BYSCORE")
            .arg("LIMIT")
            .arg(0)
            .arg(BATCH)
            .query_async(&mut conn)
            .await?;
        if due.is_empty() {
            return Ok(total);
        }
        let mut push = Push::default();
        let mut unreadable = Vec::new();
        for member in &due {
            match prepare(member) {
                Some((payload, queue)) => push.push_to(member, payload.into_bytes(), &queue),
                None => {
                    tracing::error!(set, payload = %String::from_utf8_lossy(member),
                        "unreadable job in {set}: moved to dead as is");
                    let why = format!("unreadable job in {set}");
                    unreadable.push(Burial::new(member, member.clone(), "unknown", why));
                }
            };
        }
        total += bury_each(worker, &mut conn, set, now, unreadable).await?;
        let (moved, refused) = push.run(&mut conn, set, now).await?;
        total += moved;
        // Refused members are still in the set: each is buried with the reason.
        let mut burials = Vec::new();
        for (member, kind) in &refused {
            let queue = prepare(member).map(|(_, q)| q).unwrap_or_default();
            let why = format!(
                "queue:{queue} holds a {kind}, not a list: the job cannot be enqueued there"
            );
            let class = error_class::BAD_QUEUE_KEY;
            tracing::error!(set, error_class = class, payload = %String::from_utf8_lossy(member),
                "{why}; moved to dead");
            let entry = crate::job::retry::dead_entry(member, class, &why);
            let mut b = Burial::new(member, entry, &queue, why);
            b.class = class;
            burials.push(b);
        }
        total += bury_each(worker, &mut conn, set, now, burials).await?;
        if (due.len() as isize) < BATCH {
            return Ok(total);
        }
    }
}

/// A due member going to `dead`: its entry there, and what its death report says.
struct Burial {
    member: Vec<u8>,
    entry: Vec<u8>,
    queue: String,
    class: &'static str,
    why: String,
}

impl Burial {
    fn new(member: &[u8], entry: Vec<u8>, queue: &str, why: String) -> Burial {
        Burial {
            member: member.to_vec(),
            entry,
            queue: queue.to_string(),
            class: error_class::INVALID_PAYLOAD,
            why,
        }
    }
}

/// Bury each member by a script call of its own: its count says whether this process's ZREM
/// took the member, so only that process reports the death (Sentry, `death` hooks). Burials
/// are rare; one round trip each costs nothing that matters. Returns how many were buried.
async fn bury_each(
    worker: &Worker,
    conn: &mut crate::connections::redis_conn::Conn,
    set: &str,
    now: f64,
    burials: Vec<Burial>,
) -> redis::RedisResult<usize> {
    let mut buried = 0;
    for b in burials {
        let mut push = Push::default();
        push.bury(&b.member, b.entry.clone());
        if push.run(conn, set, now).await?.0 == 1 {
            buried += 1;
            let queue: std::sync::Arc<str> = b.queue.into();
            let r = crate::report::buried(&queue, &b.entry, b.class, &b.why);
            worker.reporter.report(r);
        }
    }
    Ok(buried)
}

/// One call of `lua/schedule_push.lua`: which members go to which queue, which are buried.
#[derive(Default)]
struct Push {
    /// The distinct queues of this batch (their keys follow the script's first three).
    queues: Vec<String>,
    /// (member, payload, index in KEYS of its queue key or 0 = bury).
    moves: Vec<(Vec<u8>, Vec<u8>, usize)>,
}

impl Push {
    fn push_to(&mut self, member: &[u8], payload: Vec<u8>, queue: &str) {
        let i = match self.queues.iter().position(|q| q == queue) {
            Some(i) => i,
            None => {
                self.queues.push(queue.to_string());
                self.queues.len() - 1
            }
        };
        // KEYS is 1-based and the queue keys start at KEYS[4].
        self.moves.push((member.to_vec(), payload, i + 4));
    }

    fn bury(&mut self, member: &[u8], entry: Vec<u8>) {
        self.moves.push((member.to_vec(), entry, 0));
    }

    async fn run(
        &self,
        conn: &mut crate::connections::redis_conn::Conn,
        set: &str,
        now: f64,
    ) -> redis::RedisResult<(usize, Refused)> {
        let mut inv = PUSH.key(set);
        inv.key("dead").key("queues");
        for q in &self.queues {
            inv.key(crate::job::queues::queue_key(q));
        }
        let (oldest, rank) = crate::job::retry::dead_trim_bounds(now);
        inv.arg(now.to_string()).arg(oldest).arg(rank);
        for (member, payload, k) in &self.moves {
            inv.arg(member).arg(payload).arg(*k);
        }
        push_reply(inv.invoke_async(conn).await?)
    }
}

/// Members the push script refused, each with the type its queue key holds.
type Refused = Vec<(Vec<u8>, String)>;

/// The push script's reply: how many moved, and the members it refused.
fn push_reply(v: Vec<redis::Value>) -> redis::RedisResult<(usize, Refused)> {
    let mut it = v.iter();
    let moved: usize = match it.next() {
        Some(n) => redis::from_redis_value_ref(n)?,
        None => 0,
    };
    let rest: Vec<&redis::Value> = it.collect();
    let mut refused = Vec::new();
    for pair in rest.chunks(2) {
        if let [m, t] = pair {
            refused.push((
                redis::from_redis_value_ref(m)?,
                redis::from_redis_value_ref(t)?,
            ));
        }
    }
    Ok((moved, refused))
}

/// Sidekiq's random_poll_interval: `avg * rand + avg / 2` with avg = processes x average.
async fn interval(worker: &Worker) -> Duration {
    let mut conn = worker.conn.clone();
    let count: i64 = redis::cmd("SCARD")
        .arg("processes")
        .query_async(&mut conn)
        .await
        .unwrap_or(1);
    let avg = worker.config.poll_interval_average * count.max(1) as f64;
    Duration::from_secs_f64(avg * rand::random::<f64>() + avg / 2.0)
}

/// Poll until quiet (Sidekiq stops its poller at quiet too).
pub async fn run(worker: std::sync::Arc<Worker>) {
    loop {
        for set in ["retry", "schedule"] {
            match enqueue_due(&worker, set).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(set, count = n, "enqueued due jobs"),
                Err(e) => tracing::warn!(set, error = %e, "scheduled poller: Redis error"),
            }
        }
        let wait = interval(&worker).await;
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = worker.shutdown.quieted() => return,
        }
    }
}

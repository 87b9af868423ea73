//! The scheduled poller, as Sidekiq's scheduled.rb: due members of `retry`, then `schedule`,
//! are pushed onto `queue:<q>` (with `SADD queues` and a fresh `enqueued_at`) by one Lua script
//! that removes and pushes in the same step, so no crash can lose a job in between.
//! A job whose queue key holds another type goes to `dead` with the reason (Playguard::BadQueueKey);
//! each burial is reported as a death by the process that made it (`report/`).
//! Interval: Sidekiq's random_poll_interval around `poll_interval_average` times the number
//! of processes, so a fleet polls on average once per `poll_interval_average`. Between polls
//! the poller sleeps only until the earliest score it saw in either set (`ZRANGE 0 0`, sent
//! instead of the due-range query when nothing is due), or until this process writes a
//! nearer retry (`job/next_due.rs`). Every process wakes at the same due time; the script
//! moves each member once.

use crate::job::error_class;
use crate::job::payload::{dump, now_f64, now_value, uses_millis};
use crate::job::report::Reporter;
use crate::worker::Worker;
use serde_json::Value;
use std::time::Duration;
use tokio::time::Instant;

static PUSH: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("../../lua/schedule_push.lua")));

/// How many due members one script call moves.
const BATCH: isize = 100;

/// The shortest pause between two polls: under a stream of due times one process polls at
/// most this often, and a job starts at most this much later on that account.
const MIN_GAP: Duration = Duration::from_millis(20);

/// How long after its score a due wake fires (timers may fire a hair early against the wall
/// clock the scores are read in).
const AFTER_DUE: Duration = Duration::from_millis(1);

/// The longest sleep a due score can ask for (the random poll comes sooner anyway).
const MAX_SLEEP: Duration = Duration::from_secs(365 * 24 * 3600);

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

/// Move every due member of `set`; returns how many moved and the score of the earliest
/// member left (None: the set is empty).
pub async fn enqueue_due(worker: &Worker, set: &str) -> redis::RedisResult<(usize, Option<f64>)> {
    let mut conn = worker.conn.clone();
    let mut total = 0;
    loop {
        let now = now_f64();
        // One command when nothing is due: an idle poll costs what the due-range query it
        // replaces did, and tells the poller when to wake.
        match head_score(&mut conn, set).await? {
            None => return Ok((total, None)),
            Some(score) if score > now => return Ok((total, Some(score))),
            Some(_) => match move_batch(worker, &mut conn, set, now).await? {
                // A due head that would not leave (nothing moved): the next random poll looks
                // again, rather than this loop asking at once.
                0 => return Ok((total, None)),
                n => total += n,
            },
        }
    }
}

/// The lowest score in `set`; None when it is empty.
async fn head_score(
    conn: &mut crate::connections::redis_conn::Conn,
    set: &str,
) -> redis::RedisResult<Option<f64>> {
    let head: Vec<(Vec<u8>, f64)> = redis::cmd("ZRANGE")
        .arg(set)
        .arg(0)
        .arg(0)
        .arg("WITHSCORES")
        .query_async(conn)
        .await?;
    Ok(head.first().map(|(_, score)| *score))
}

/// Move one batch of the members of `set` due at `now`; returns how many left the set.
async fn move_batch(
    worker: &Worker,
    conn: &mut crate::connections::redis_conn::Conn,
    set: &str,
    now: f64,
) -> redis::RedisResult<usize> {
    // Bytes: a member that is not UTF-8 must not stall the poller; it goes to dead as is.
    let due: Vec<Vec<u8>> = redis::cmd("ZRANGE")
        .arg(set)
        .arg("-inf")
        .arg(now.to_string())
        .arg("BYSCORE")
        .arg("LIMIT")
        .arg(0)
        .arg(BATCH)
        .query_async(conn)
        .await?;
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
    let mut total = bury_each(worker, conn, set, now, unreadable).await?;
    let (moved, refused) = push.run(conn, set, now).await?;
    total += moved;
    // Refused members are still in the set: each is buried with the reason.
    let mut burials = Vec::new();
    for (member, kind) in &refused {
        let queue = prepare(member).map(|(_, q)| q).unwrap_or_default();
        let why =
            format!("queue:{queue} holds a {kind}, not a list: the job cannot be enqueued there");
        let class = error_class::BAD_QUEUE_KEY;
        tracing::error!(set, error_class = class, payload = %String::from_utf8_lossy(member),
            "{why}; moved to dead");
        let entry = crate::job::retry::dead_entry(member, class, &why);
        let mut b = Burial::new(member, entry, &queue, why);
        b.class = class;
        burials.push(b);
    }
    Ok(total + bury_each(worker, conn, set, now, burials).await?)
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

/// How many Sidekiq processes are alive (`processes`), which the pollers' waits scale with;
/// 1 when Redis cannot say.
pub(super) async fn process_count(worker: &Worker) -> i64 {
    let mut conn = worker.conn.clone();
    redis::cmd("SCARD")
        .arg("processes")
        .query_async(&mut conn)
        .await
        .unwrap_or(1)
}

/// Sidekiq's random_poll_interval: `avg * rand + avg / 2` with avg = processes x average.
async fn interval(worker: &Worker) -> Duration {
    let count = process_count(worker).await;
    let avg = worker.config.poll_interval_average * count.max(1) as f64;
    Duration::from_secs_f64(avg * rand::random::<f64>() + avg / 2.0)
}

/// One poll of `retry`, then `schedule`: the earliest score left in either (infinity when
/// both are empty, or a set could not be read: the next random poll looks again).
async fn poll(worker: &Worker) -> f64 {
    let mut earliest = f64::INFINITY;
    for set in ["retry", "schedule"] {
        match enqueue_due(worker, set).await {
            Ok((n, next)) => {
                if n > 0 {
                    tracing::info!(set, count = n, "enqueued due jobs");
                }
                earliest = earliest.min(next.unwrap_or(f64::INFINITY));
            }
            Err(e) => tracing::warn!(set, error = %e, "scheduled poller: Redis error"),
        }
    }
    earliest
}

/// The instant of an epoch time, just after it so that a timer firing on the dot reads the
/// score as due. Converted at each plan: the random poll's deadline stays monotonic.
fn instant_of(epoch: f64) -> Instant {
    let ahead = (epoch - now_f64()).min(MAX_SLEEP.as_secs_f64());
    // NaN and the past both mean now.
    let ahead = if ahead > 0.0 { ahead } else { 0.0 };
    Instant::now() + Duration::from_secs_f64(ahead) + AFTER_DUE
}

/// Poll until quiet (Sidekiq stops its poller at quiet too). Between polls, sleep until the
/// next random poll or the earliest due score seen, whichever comes first, and earlier when
/// this process writes a nearer retry (`job/next_due.rs`).
pub async fn run(worker: std::sync::Arc<Worker>) {
    let due = &worker.next_due;
    let mut next_poll = Instant::now();
    loop {
        due.begin_poll();
        let earliest = poll(&worker).await;
        let polled = Instant::now();
        if polled >= next_poll {
            next_poll = polled + interval(&worker).await;
        }
        // MIN_GAP spaces due wakes only: the random poll keeps its own interval.
        let soonest = polled + MIN_GAP;
        let to_poll = next_poll.saturating_duration_since(Instant::now());
        let planned = due.plan(earliest.min(now_f64() + to_poll.as_secs_f64()));
        let mut wake = next_poll.min(instant_of(planned).max(soonest));
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(wake) => break,
                _ = due.lowered() => {
                    wake = wake.min(instant_of(due.planned()).max(soonest));
                }
                _ = worker.shutdown.quieted() => return,
            }
        }
    }
}

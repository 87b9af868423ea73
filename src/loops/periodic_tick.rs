//! One periodic tick's fan-out in bounded steps, so no Redis call grows with the member set:
//! the set is read with SSCAN (COUNT 1,000), and the jobs are pushed a batch (at most 1,000) per
//! `lua/periodic_batch.lua` call. The first batch claims the tick (`SET NX EX` on its
//! fingerprint) together with its pushes; every later one checks that this process still owns
//! the tick and continues from the recorded step, and records the new SSCAN position with its
//! pushes. A peer that found the tick taken watches its progress and takes over from the
//! recorded position once the owner's lease (renewed by every batch) lapsed.
//!
//! Exactly one job per member per tick: the scanning process drops repeats SSCAN returns (it
//! may, when the set's table is resized during the scan). A takeover starts a fresh record of
//! what was seen, so only a repeat that straddles the takeover can get a second job
//! (docs/operations.md, "Periodic fan-out"). Every member present for the whole tick gets one.
//!
//! Keys: `playguard:periodic:<name>:<tick>` (fingerprint), `playguard:periodic-progress:<name>:<tick>`
//! (progress hash), the member set (SSCAN, read), `queues`, `queue:<q>`.

use crate::job::client::NewJob;
use crate::job::payload::{new_jid, now_f64};
use crate::manifest::PeriodicSpec;
use crate::worker::Worker;
use serde_json::Value;
use std::collections::HashSet;
use std::hash::{BuildHasher, RandomState};
use std::time::{Duration, Instant};

/// A member becomes the single argument: JSON when it parses (`42` stays a number), else a string.
pub fn member_arg(member: &str) -> Value {
    serde_json::from_str(member).unwrap_or_else(|_| Value::from(member))
}

/// Fixed manifest args as JSON. TOML datetimes have no JSON form and become their RFC 3339 text.
pub(super) fn toml_to_json(v: &toml::Value) -> Value {
    match v {
        toml::Value::Datetime(d) => Value::from(d.to_string()),
        toml::Value::Array(a) => Value::Array(a.iter().map(toml_to_json).collect()),
        toml::Value::Table(t) => Value::Object(
            t.iter()
                .map(|(k, v)| (k.clone(), toml_to_json(v)))
                .collect(),
        ),
        other => serde_json::to_value(other).unwrap_or(Value::Null),
    }
}

pub fn fingerprint_key(name: &str, tick: u64) -> String {
    format!("playguard:periodic:{name}:{tick}")
}

/// Beside the fingerprint, not under its prefix: `playguard:periodic:<name>:*` names only
/// fingerprints, whose value is the claimer (tests/periodic.rs reads them so).
pub fn progress_key(name: &str, tick: u64) -> String {
    format!("playguard:periodic-progress:{name}:{tick}")
}

/// One tick: its number (the fingerprint's suffix) and how long its fingerprint lives.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tick {
    pub n: u64,
    pub ttl: u64,
}

/// The owner's lease on a tick it has not finished: renewed by each batch; a peer takes over
/// once it lapsed.
const LEASE: Duration = Duration::from_secs(5);
/// How often a peer looks at a tick another process is still pushing.
const WATCH_EVERY: Duration = Duration::from_secs(1);
/// After a failed call, try it again this soon.
const RETRY_DELAY: Duration = Duration::from_secs(1);
/// SSCAN's COUNT: about this many members per read.
const SCAN_COUNT: usize = 1000;
/// Payloads per batch (`lua/periodic_batch.lua` pushes them with one LPUSH per 1,000).
const BATCH: usize = 1000;

static SCRIPT: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("../../lua/periodic_batch.lua")));

/// The batch size: `BATCH`, or smaller through the hidden `PLAYGUARD_PERIODIC_BATCH` (tests use
/// it to make a tick long enough to interrupt).
fn batch_size() -> usize {
    std::env::var("PLAYGUARD_PERIODIC_BATCH")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .map_or(BATCH, |n| n.clamp(1, BATCH))
}

/// How one process's part of a tick ended.
#[derive(Debug, PartialEq)]
pub enum Outcome {
    /// This process pushed the tick's last batch: `total` jobs in the tick, `ours` by us.
    Finished {
        total: u64,
        ours: u64,
        took_over: bool,
    },
    /// A peer claimed the tick and finished it (or its record is gone).
    Peer,
    /// We stopped before its end: taken over by a peer, or left to one at quiet.
    Left { ours: u64, why: &'static str },
}

/// What one batch call answered (`lua/periodic_batch.lua`'s codes).
enum Reply {
    /// Pushed now or by an earlier attempt of the same step: the tick's total so far.
    Landed(u64),
    /// -1: a peer claimed the tick.
    Claimed,
    /// -2: not (or no longer) ours.
    NotOurs,
    /// -3: the owner's lease still holds.
    LeaseHolds,
}

/// Where the next batch starts: the step it continues from, the SSCAN cursor, how many members
/// of that cursor's reply were pushed already, and the owner whose lapsed lease it takes over.
struct Position {
    step: u64,
    cursor: String,
    skip: usize,
    from: String,
}

/// A tick's record as a watching peer reads it, with Redis's clock.
struct Progress {
    owner: String,
    lease_ms: u64,
    step: u64,
    cursor: String,
    skip: usize,
    done: bool,
    now_ms: u64,
}

/// Members this process has pushed this tick, by a 128-bit keyed hash (16 bytes each, never
/// the members themselves): SSCAN may return a member twice.
struct Seen {
    hashers: (RandomState, RandomState),
    set: HashSet<u128>,
}

impl Seen {
    fn new() -> Seen {
        Seen {
            hashers: (RandomState::new(), RandomState::new()),
            set: HashSet::new(),
        }
    }

    /// True the first time `member` is offered.
    fn first(&mut self, member: &[u8]) -> bool {
        let h = (u128::from(self.hashers.0.hash_one(member)) << 64)
            | u128::from(self.hashers.1.hash_one(member));
        self.set.insert(h)
    }
}

/// One tick of one periodic entry, as this process works it.
pub struct Fanout<'a> {
    pub worker: &'a Worker,
    pub spec: &'a PeriodicSpec,
    pub tick: Tick,
    /// The instant the tick was computed from: every job's created_at/enqueued_at.
    pub now: f64,
    /// When the next tick starts: a claim still failing then is given up.
    pub tick_end: f64,
}

impl Fanout<'_> {
    /// Claim and push the tick, or watch a peer push it and take over if it stops.
    pub async fn fire(&self) -> redis::RedisResult<Outcome> {
        let Some(set) = &self.spec.for_each_member_of else {
            let args = self.spec.args.iter().map(toml_to_json);
            let payloads = vec![self.payload(args.collect())];
            let end = ("0".to_string(), 0);
            return Ok(
                match self
                    .call(&Position::start(), &end, &payloads, LEASE)
                    .await?
                {
                    Reply::Landed(total) => Outcome::Finished {
                        total,
                        ours: total,
                        took_over: false,
                    },
                    _ => Outcome::Peer,
                },
            );
        };
        match self.scan_from(set, Position::start(), Seen::new()).await? {
            Some(outcome) => Ok(outcome),
            None => self.watch(set).await,
        }
    }

    /// Push the rest of the tick from `pos`. None: the tick is not ours (claimed by a peer, or
    /// a takeover refused before anything was pushed).
    async fn scan_from(
        &self,
        set: &str,
        mut pos: Position,
        mut seen: Seen,
    ) -> redis::RedisResult<Option<Outcome>> {
        let batch = batch_size();
        let took_over = !pos.from.is_empty();
        let mut ours = 0u64;
        // Set by every batch that lands, and the tick ends only after one did.
        let mut total: u64;
        loop {
            let (next, members) = self.sscan(set, &pos).await?;
            // A takeover resumes inside this reply: what the last owner pushed of it is seen.
            let skip = pos.skip.min(members.len());
            for m in &members[..skip] {
                seen.first(m);
            }
            let mut start = skip;
            loop {
                let end = (start + batch).min(members.len());
                let after = if end == members.len() {
                    (next.clone(), 0)
                } else {
                    (pos.cursor.clone(), end)
                };
                if pos.step > 0 && self.worker.shutdown.is_quiet() {
                    if !pos.from.is_empty() {
                        return Ok(None); // not taken over yet: nothing to hand on
                    }
                    return self.leave(&pos, ours).await.map(Some);
                }
                let payloads: Vec<String> = members[start..end]
                    .iter()
                    .filter(|m| seen.first(m))
                    .map(|m| self.member_payload(m))
                    .collect();
                let n = payloads.len() as u64;
                match self.call(&pos, &after, &payloads, LEASE).await? {
                    Reply::Landed(t) => total = t,
                    Reply::Claimed | Reply::LeaseHolds => return Ok(None),
                    Reply::NotOurs if ours == 0 => return Ok(None),
                    Reply::NotOurs => {
                        let why = "taken over by a peer (or its record is gone)";
                        return Ok(Some(Outcome::Left { ours, why }));
                    }
                }
                ours += n;
                pos = Position {
                    step: pos.step + 1,
                    cursor: after.0,
                    skip: after.1,
                    from: String::new(),
                };
                start = end;
                if start >= members.len() {
                    break;
                }
            }
            if pos.cursor == "0" {
                return Ok(Some(Outcome::Finished {
                    total,
                    ours,
                    took_over,
                }));
            }
        }
    }

    /// Quiet mid-tick: record where we are with a lapsed lease, so a peer continues at once.
    async fn leave(&self, pos: &Position, ours: u64) -> redis::RedisResult<Outcome> {
        let here = (pos.cursor.clone(), pos.skip);
        self.call(pos, &here, &[], Duration::ZERO).await?;
        Ok(Outcome::Left {
            ours,
            why: "left to a peer at quiet",
        })
    }

    /// A peer owns the tick: look at its progress until it is done or its record is gone, and
    /// take over from the recorded position once the owner's lease lapsed.
    async fn watch(&self, set: &str) -> redis::RedisResult<Outcome> {
        loop {
            match self.read_progress().await {
                Ok(Some(p)) if !p.done && p.lease_ms <= p.now_ms => {
                    tracing::info!(periodic = %self.spec.name, tick = self.tick.n, owner = %p.owner,
                        step = p.step, "periodic tick owner's lease lapsed; taking over");
                    let pos = Position {
                        step: p.step,
                        cursor: p.cursor,
                        skip: p.skip,
                        from: p.owner,
                    };
                    if let Some(outcome) = self.scan_from(set, pos, Seen::new()).await? {
                        return Ok(outcome);
                    }
                }
                Ok(Some(p)) if !p.done => {} // the owner is at it
                Ok(_) => return Ok(Outcome::Peer),
                Err(e) => {
                    tracing::warn!(periodic = %self.spec.name, tick = self.tick.n, error = %e,
                        "cannot read a peer's periodic tick progress; looking again");
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(WATCH_EVERY) => {}
                _ = self.worker.shutdown.quieted() => return Ok(Outcome::Peer),
            }
        }
    }

    async fn read_progress(&self) -> redis::RedisResult<Option<Progress>> {
        let mut conn = self.worker.conn.clone();
        let key = progress_key(&self.spec.name, self.tick.n);
        let (fields, (secs, micros)): (Vec<Option<String>>, (u64, u64)) = redis::pipe()
            .cmd("HMGET")
            .arg(&key)
            .arg(&["owner", "lease", "step", "cursor", "skip", "done"])
            .cmd("TIME")
            .query_async(&mut conn)
            .await?;
        let num = |i: usize| -> u64 {
            fields[i]
                .as_deref()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        Ok(fields[0].clone().map(|owner| Progress {
            owner,
            lease_ms: num(1),
            step: num(2),
            cursor: fields[3].clone().unwrap_or_else(|| "0".into()),
            skip: num(4) as usize,
            done: num(5) == 1,
            now_ms: secs * 1000 + micros / 1000,
        }))
    }

    /// SSCAN from `pos`, retried while the tick's work may go on.
    async fn sscan(&self, set: &str, pos: &Position) -> redis::RedisResult<(String, Vec<Vec<u8>>)> {
        let since = Instant::now();
        loop {
            let mut conn = self.worker.conn.clone();
            let r = redis::cmd("SSCAN")
                .arg(set)
                .arg(&pos.cursor)
                .arg("COUNT")
                .arg(SCAN_COUNT)
                .query_async(&mut conn)
                .await;
            match r {
                Ok(r) => return Ok(r),
                Err(e) => self.retry_or_give_up(pos, e, since).await?,
            }
        }
    }

    /// One batch, retried with the same payloads until it lands or the tick's work must stop.
    async fn call(
        &self,
        pos: &Position,
        after: &(String, usize),
        payloads: &[String],
        lease: Duration,
    ) -> redis::RedisResult<Reply> {
        let since = Instant::now();
        loop {
            let mut inv = SCRIPT.prepare_invoke();
            inv.key(fingerprint_key(&self.spec.name, self.tick.n))
                .key(progress_key(&self.spec.name, self.tick.n))
                .key("queues")
                .key(crate::job::queues::queue_key(&self.spec.queue))
                .arg(&self.worker.identity)
                .arg(self.tick.ttl)
                .arg(&self.spec.queue)
                .arg(pos.step)
                .arg(&pos.from)
                .arg(lease.as_millis() as u64)
                .arg(&after.0)
                .arg(after.1);
            for p in payloads {
                inv.arg(p);
            }
            let mut conn = self.worker.conn.clone();
            match inv.invoke_async::<(i64, u64)>(&mut conn).await {
                Ok((1 | 2, total)) => return Ok(Reply::Landed(total)),
                Ok((-1, _)) => return Ok(Reply::Claimed),
                Ok((-3, _)) => return Ok(Reply::LeaseHolds),
                Ok(_) => return Ok(Reply::NotOurs),
                Err(e) => self.retry_or_give_up(pos, e, since).await?,
            }
        }
    }

    /// After a failed call: Ok once it is time to try again, or the error when the tick's work
    /// must stop (quiet; a claim still failing when the tick is over; a later step failing for
    /// as long as the tick's keys live, after which its record is gone anyway).
    async fn retry_or_give_up(
        &self,
        pos: &Position,
        e: redis::RedisError,
        since: Instant,
    ) -> redis::RedisResult<()> {
        let over = if pos.step == 0 {
            now_f64() >= self.tick_end
        } else {
            since.elapsed() >= Duration::from_secs(self.tick.ttl)
        };
        if over || self.worker.shutdown.is_quiet() {
            return Err(e);
        }
        tracing::warn!(periodic = %self.spec.name, tick = self.tick.n, step = pos.step, error = %e,
            "periodic tick failed; retrying while the tick lasts");
        tokio::select! {
            _ = tokio::time::sleep(RETRY_DELAY) => Ok(()),
            _ = self.worker.shutdown.quieted() => Err(e),
        }
    }

    fn member_payload(&self, member: &[u8]) -> String {
        // Bytes, then lossy text: one odd member must not cost every Marquee its tick.
        let member = String::from_utf8_lossy(member);
        self.payload(vec![member_arg(&member)])
    }

    fn payload(&self, args: Vec<Value>) -> String {
        let retry = self.spec.retry.as_ref();
        let job = NewJob {
            class: self.spec.class.clone(),
            args,
            queue: self.spec.queue.clone(),
            retry: retry.map_or(Value::Bool(true), toml_to_json),
            at: None,
        };
        job.payload(&new_jid(), self.now)
    }
}

impl Position {
    fn start() -> Position {
        Position {
            step: 0,
            cursor: "0".into(),
            skip: 0,
            from: String::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seen_drops_repeats_only() {
        let mut s = Seen::new();
        assert!(s.first(b"7"));
        assert!(s.first(b"marquee-7"));
        assert!(!s.first(b"7"));
        assert!(s.first(b""));
        assert!(!s.first(b""));
    }

    #[test]
    fn progress_lives_beside_the_fingerprint() {
        assert_eq!(
            fingerprint_key("dispatch", 42),
            "playguard:periodic:dispatch:42"
        );
        assert_eq!(
            progress_key("dispatch", 42),
            "playguard:periodic-progress:dispatch:42"
        );
    }
}

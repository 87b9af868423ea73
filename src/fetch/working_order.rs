//! Reliable fetch's picture of its own working lists (`playguard:working:<identity>:<q>`):
//! the jobs it moved there that are still in them, in list order (oldest first, at the list's
//! right end), and whether each still runs or finished and waits for its acknowledgement.
//! Touches no Redis keys itself: `acks.rs` turns what this says into commands.
//!
//! Why: an LREM per finished job makes Redis compare the payload with the list's elements and
//! shift the rest, and was most of Redis's CPU per job. Jobs mostly finish in the order they
//! were fetched, so the finished ones at the old end leave in one guarded trim
//! (`lua/ack_oldest.lua`) per batch. A finished job held behind one that keeps running goes
//! by its own LREM once that job ran past `BLOCKED_GRACE`, so a long job never keeps finished
//! ones in the list (where a crash would make them run again), nor in this picture: a job that
//! left the list leaves the picture too, so its size is the jobs in flight, not every job
//! fetched since the oldest running one.
//!
//! Only this process changes these lists while it is alive, and each change is counted here
//! once Redis confirmed it (the acks connection sends its trims in order). Where the picture
//! can be wrong (a fetch whose reply was lost, a sweep that returned our jobs while we were
//! frozen, a failover to a replica that missed writes), the trim's guard sees that the list's
//! ends are not the payloads expected and the acks fall back to one LREM each, which is
//! always right.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// The working list holding a process's fetched, unfinished jobs of one queue.
pub fn working_key(identity: &str, queue: &str) -> String {
    format!("playguard:working:{identity}:{queue}")
}

/// How long the oldest running job may hold finished ones behind it before they are
/// acknowledged one by one.
pub(super) const BLOCKED_GRACE: Duration = Duration::from_millis(20);

enum State {
    Running,
    /// Finished; the payload is kept for the trim's guard (or the LREM).
    Done(Vec<u8>),
    /// No longer in the list (settled, requeued, or acknowledged by its own LREM): a tombstone
    /// until the front passes it or the lane is compacted.
    Gone,
}

struct Slot {
    seq: u64,
    state: State,
}

/// One working list, oldest job first: only jobs still in it, plus at most as many
/// tombstones as those (`compact`), so it is O(jobs in flight) however long the oldest runs.
/// A VecDeque rather than a BTreeMap by sequence number: fetching appends with no allocation
/// once the deque has grown to the jobs in flight, and a lookup is one index (a binary
/// search only after a compaction moved entries).
#[derive(Default)]
struct Lane {
    /// The sequence number the next fetched job gets.
    next: u64,
    /// By sequence number, ascending.
    entries: VecDeque<Slot>,
    /// Tombstones in `entries`.
    gone: usize,
    /// Finished entries not yet handed to the acks task.
    done: usize,
    /// The sequence numbers of those, in the order they finished, so a flush of the jobs held
    /// behind a running one touches only them; may also name ones the front trim sent since.
    finished: Vec<u64>,
    /// The running entry found holding finished ones behind it, and since when.
    blocked: Option<(u64, Instant)>,
}

impl Lane {
    /// Where `seq` is in `entries`, if it still is.
    fn find(&self, seq: u64) -> Option<usize> {
        let guess = seq.checked_sub(self.entries.front()?.seq)? as usize;
        match self.entries.get(guess) {
            Some(e) if e.seq == seq => Some(guess),
            _ => self.entries.binary_search_by_key(&seq, |e| e.seq).ok(),
        }
    }

    /// Drop the tombstones at the front, and all of them once they are over half the entries
    /// (each compaction removes at least as many as it keeps: O(1) per job, amortized).
    fn compact(&mut self) {
        while let Some(Slot {
            state: State::Gone, ..
        }) = self.entries.front()
        {
            self.entries.pop_front();
            self.gone -= 1;
        }
        if self.gone * 2 > self.entries.len() {
            self.entries.retain(|e| !matches!(e.state, State::Gone));
            self.gone = 0;
            // A deque once grown large (a burst of fetches) need not keep its size.
            if self.entries.capacity() > 1024 && self.entries.capacity() > 4 * self.entries.len() {
                self.entries.shrink_to(2 * self.entries.len());
            }
        }
    }

    /// Pop the finished (and gone) entries at the old end, up to the oldest running one.
    fn take_oldest(&mut self) -> Vec<Vec<u8>> {
        let mut oldest = Vec::new();
        while let Some(front) = self.entries.front() {
            if matches!(front.state, State::Running) {
                break;
            }
            match self.entries.pop_front().map(|e| e.state) {
                Some(State::Done(raw)) => oldest.push(raw),
                _ => self.gone -= 1,
            }
        }
        self.done -= oldest.len();
        oldest
    }

    /// Every finished entry behind the running front, as tombstones now, their payloads out.
    fn take_blocked(&mut self) -> Vec<Vec<u8>> {
        let mut out = Vec::with_capacity(self.done);
        for seq in std::mem::take(&mut self.finished) {
            // Skipped: one the front trim sent (no longer held), or one settled since.
            let Some(e) = self.find(seq).map(|i| &mut self.entries[i]) else {
                continue;
            };
            if matches!(e.state, State::Done(_)) {
                if let State::Done(raw) = std::mem::replace(&mut e.state, State::Gone) {
                    out.push(raw);
                    self.gone += 1;
                }
            }
        }
        self.done = 0;
        self.compact();
        out
    }
}

/// What one flush sends for one working list.
pub(super) enum Ack {
    /// The `n` oldest elements are these payloads (oldest first): trim them, if the guard agrees.
    Oldest(Vec<Vec<u8>>),
    /// Remove this one payload wherever it is.
    One(Vec<u8>),
}

#[derive(Default)]
pub(super) struct WorkingOrder {
    lanes: crate::FastMap<String, Lane>,
    /// Finished jobs this picture does not hold (fetched before a reset): acknowledged by LREM.
    loose: Vec<(String, Vec<u8>)>,
}

/// What `take_acks` found: per queue the acks to send, and when to look again for jobs held
/// behind a running one.
pub(super) struct Flush {
    pub acks: Vec<(String, Ack)>,
    pub recheck_at: Option<Instant>,
}

impl WorkingOrder {
    /// Record `n` jobs just moved into `queue`'s working list, oldest first; returns the
    /// sequence number of the first (the rest follow).
    pub fn register(&mut self, queue: &str, n: usize) -> u64 {
        let lane = match self.lanes.get_mut(queue) {
            Some(l) => l,
            None => self.lanes.entry(queue.to_string()).or_default(),
        };
        let seq = lane.next;
        lane.next += n as u64;
        lane.entries.extend((seq..lane.next).map(|seq| Slot {
            seq,
            state: State::Running,
        }));
        seq
    }

    /// A job finished: its acknowledgement waits for the next flush. One the picture does not
    /// hold as running is acknowledged by its own LREM, which is always right.
    pub fn finished(&mut self, queue: &str, seq: u64, raw: Vec<u8>) {
        if let Some(lane) = self.lanes.get_mut(queue) {
            if let Some(i) = lane.find(seq) {
                let e = &mut lane.entries[i];
                if matches!(e.state, State::Running) {
                    e.state = State::Done(raw);
                    lane.done += 1;
                    lane.finished.push(seq);
                    return;
                }
            }
        }
        self.loose.push((queue.to_string(), raw));
    }

    /// A job left the list by another way, confirmed by Redis (settled with its outcome, or
    /// pushed back to its queue).
    pub fn gone(&mut self, queue: &str, seq: u64) {
        let Some(lane) = self.lanes.get_mut(queue) else {
            return;
        };
        let Some(i) = lane.find(seq) else { return };
        match std::mem::replace(&mut lane.entries[i].state, State::Gone) {
            State::Running => lane.gone += 1,
            State::Done(_) => {
                lane.done -= 1;
                lane.gone += 1;
            }
            State::Gone => {}
        }
        // No ack may come to flush this lane (every job failing, say): compact here.
        lane.compact();
    }

    /// Everything left the lists (a drain pushed it all back to the queues).
    pub fn reset(&mut self) {
        for lane in self.lanes.values_mut() {
            *lane = Lane {
                next: lane.next,
                ..Lane::default()
            };
        }
    }

    /// How many of `queue`'s jobs may still be in its working list: running, or finished and
    /// not yet handed to the acks task (those handed over are the acks' pending count).
    pub fn in_list(&self, queue: &str) -> usize {
        let lane = self
            .lanes
            .get(queue)
            .map_or(0, |l| l.entries.len() - l.gone);
        lane + self.loose.iter().filter(|(q, _)| q == queue).count()
    }

    /// Finished jobs not yet handed to the acks task.
    #[cfg(test)]
    pub fn waiting(&self) -> usize {
        self.lanes.values().map(|l| l.done).sum::<usize>() + self.loose.len()
    }

    /// Entries the picture holds, in every lane: what its memory grows with.
    #[cfg(test)]
    fn held(&self) -> usize {
        self.lanes.values().map(|l| l.entries.len()).sum()
    }

    /// Hand over every acknowledgement due now: each list's finished prefix as one `Oldest`,
    /// and the finished jobs behind a job running past the grace (or all of them, `all`, at
    /// shutdown) one by one.
    pub fn take_acks(&mut self, now: Instant, all: bool) -> Flush {
        let mut flush = Flush {
            acks: std::mem::take(&mut self.loose)
                .into_iter()
                .map(|(q, raw)| (q, Ack::One(raw)))
                .collect(),
            recheck_at: None,
        };
        for (queue, lane) in &mut self.lanes {
            if lane.done == 0 {
                continue;
            }
            let mut oldest = lane.take_oldest();
            match oldest.len() {
                0 => {}
                1 => flush
                    .acks
                    .push((queue.clone(), Ack::One(oldest.pop().unwrap()))),
                _ => flush.acks.push((queue.clone(), Ack::Oldest(oldest))),
            }
            if lane.done == 0 {
                lane.blocked = None;
                lane.finished.clear();
                continue;
            }
            // The front runs and finished jobs wait behind it.
            let front = lane.entries.front().map_or(0, |e| e.seq);
            let since = match lane.blocked {
                Some((seq, t)) if seq == front => t,
                _ => {
                    lane.blocked = Some((front, now));
                    now
                }
            };
            if all || now.duration_since(since) >= BLOCKED_GRACE {
                let held = lane.take_blocked();
                flush
                    .acks
                    .extend(held.into_iter().map(|raw| (queue.clone(), Ack::One(raw))));
            } else {
                // Forget the ones the front trim sent, before they outnumber those waiting.
                if lane.finished.len() > 2 * lane.done {
                    lane.finished.retain(|s| *s > front);
                }
                let at = since + BLOCKED_GRACE;
                flush.recheck_at = Some(flush.recheck_at.map_or(at, |t| t.min(at)));
            }
        }
        flush
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(f: &Flush) -> Vec<String> {
        f.acks
            .iter()
            .map(|(q, a)| match a {
                Ack::Oldest(v) => format!(
                    "{q}:oldest[{}]",
                    v.iter()
                        .map(|r| String::from_utf8_lossy(r).into_owned())
                        .collect::<Vec<_>>()
                        .join(",")
                ),
                Ack::One(r) => format!("{q}:one[{}]", String::from_utf8_lossy(r)),
            })
            .collect()
    }

    #[test]
    fn finished_prefix_leaves_in_one_trim_skipping_jobs_gone_already() {
        let mut w = WorkingOrder::default();
        let s = w.register("q", 4);
        w.finished("q", s, b"a".to_vec());
        w.gone("q", s + 1);
        w.finished("q", s + 2, b"c".to_vec());
        let t = Instant::now();
        assert_eq!(shape(&w.take_acks(t, false)), ["q:oldest[a,c]"]);
        assert_eq!(w.waiting(), 0);
        // The fourth still runs: nothing more to send.
        assert!(w.take_acks(t, false).acks.is_empty());
        w.finished("q", s + 3, b"d".to_vec());
        assert_eq!(shape(&w.take_acks(t, false)), ["q:one[d]"]);
    }

    #[test]
    fn jobs_held_behind_a_long_one_go_one_by_one_after_the_grace() {
        let mut w = WorkingOrder::default();
        let s = w.register("q", 3);
        w.finished("q", s + 1, b"b".to_vec());
        w.finished("q", s + 2, b"c".to_vec());
        let t = Instant::now();
        let f = w.take_acks(t, false);
        assert!(f.acks.is_empty());
        assert_eq!(f.recheck_at, Some(t + BLOCKED_GRACE));
        assert_eq!(w.waiting(), 2);
        let f = w.take_acks(t + BLOCKED_GRACE, false);
        assert_eq!(shape(&f), ["q:one[b]", "q:one[c]"]);
        // The long one ends: it alone is left.
        w.finished("q", s, b"a".to_vec());
        assert_eq!(shape(&w.take_acks(t, false)), ["q:one[a]"]);
    }

    #[test]
    fn jobs_in_the_list_are_the_running_and_finished_ones_not_handed_over() {
        let mut w = WorkingOrder::default();
        let s = w.register("q", 4);
        w.finished("q", s + 1, b"b".to_vec());
        w.gone("q", s + 2);
        assert_eq!(w.in_list("q"), 3);
        assert_eq!(w.in_list("other"), 0);
        w.finished("q", s, b"a".to_vec());
        // a and b leave the picture for the acks task (its pending count has them).
        assert_eq!(
            shape(&w.take_acks(Instant::now(), false)),
            ["q:oldest[a,b]"]
        );
        assert_eq!(w.in_list("q"), 1);
    }

    #[test]
    fn shutdown_sends_everything_and_a_reset_forgets_the_lists() {
        let mut w = WorkingOrder::default();
        let s = w.register("q", 2);
        w.finished("q", s + 1, b"b".to_vec());
        assert_eq!(shape(&w.take_acks(Instant::now(), true)), ["q:one[b]"]);
        w.reset();
        // Finished after the reset: not in the picture, acknowledged by LREM all the same.
        w.finished("q", s, b"a".to_vec());
        assert_eq!(w.waiting(), 1);
        assert_eq!(shape(&w.take_acks(Instant::now(), false)), ["q:one[a]"]);
        assert_eq!(w.register("q", 1), s + 2);
    }
    /// Jobs fetched and finished one by one while the first one keeps running (a long
    /// reconcile cycle beside short jobs), flushed as the acks task would.
    #[test]
    fn the_picture_holds_only_jobs_in_flight_behind_a_long_running_one() {
        let mut w = WorkingOrder::default();
        let long = w.register("q", 1);
        let t = Instant::now();
        let (mut sent, mut most) = (0, 0);
        for i in 0..100_000u32 {
            let s = w.register("q", 1);
            w.finished("q", s, i.to_string().into_bytes());
            if i % 64 == 63 {
                let now = if i < 64 { t } else { t + BLOCKED_GRACE };
                sent += w.take_acks(now, false).acks.len();
            }
            most = most.max(w.held());
        }
        sent += w.take_acks(t + BLOCKED_GRACE, false).acks.len();
        assert_eq!(sent, 100_000);
        assert_eq!(w.in_list("q"), 1);
        // The long job and at most one batch of finished ones (and their tombstones).
        assert!(most <= 2 * 64 + 1, "held {most} entries at most");
        assert!(w.held() <= 1, "held {} entries at the end", w.held());
        w.finished("q", long, b"long".to_vec());
        assert_eq!(shape(&w.take_acks(t, false)), ["q:one[long]"]);
        assert_eq!(w.held(), 0);
    }

    /// Failed jobs leave by their settle (no ack, so no flush looks at the lane): their
    /// entries must not pile up either, with or without an older job still running.
    #[test]
    fn jobs_that_leave_by_their_settle_do_not_pile_up() {
        let mut w = WorkingOrder::default();
        for i in 0..100_000 {
            let s = w.register("q", 1);
            w.gone("q", s);
            if i == 50_000 {
                w.register("q", 1);
            }
        }
        assert_eq!(w.in_list("q"), 1);
        assert!(w.held() <= 2, "held {} entries", w.held());
    }

    /// A small deterministic generator, so the model test needs no dependency.
    fn xorshift(x: &mut u64) -> u64 {
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        *x
    }

    /// Random finishes, settles, fetches and flushes against a model of the Redis list: every
    /// trim names exactly the list's oldest elements (so its guard would agree), every
    /// finished job is acknowledged once, and the picture holds what the list holds.
    #[test]
    fn acks_match_a_model_of_the_list_under_random_order() {
        let mut w = WorkingOrder::default();
        // The list, oldest first, and the jobs still running (by seq).
        let mut list: VecDeque<u64> = VecDeque::new();
        let mut running: Vec<u64> = Vec::new();
        let (mut x, mut acked, mut finished) = (0x9e37_79b9_7f4a_7c15u64, 0, 0);
        let t = Instant::now();
        for step in 0..100_000u64 {
            match xorshift(&mut x) % 10 {
                0..=2 if running.len() < 64 => {
                    let n = 1 + (xorshift(&mut x) % 5) as usize;
                    let s = w.register("q", n);
                    list.extend(s..s + n as u64);
                    running.extend(s..s + n as u64);
                }
                0..=6 if !running.is_empty() => {
                    // Mostly the oldest running job, sometimes any.
                    let i = if xorshift(&mut x).is_multiple_of(4) {
                        (xorshift(&mut x) % running.len() as u64) as usize
                    } else {
                        0
                    };
                    let s = running.remove(i);
                    w.finished("q", s, s.to_string().into_bytes());
                    finished += 1;
                }
                7 if !running.is_empty() => {
                    let i = (xorshift(&mut x) % running.len() as u64) as usize;
                    let s = running.remove(i);
                    w.gone("q", s);
                    list.retain(|e| *e != s);
                }
                _ => {
                    let now = t + Duration::from_millis(step / 100);
                    for (_, ack) in w.take_acks(now, step.is_multiple_of(5000)).acks {
                        match ack {
                            Ack::Oldest(v) => {
                                for raw in v {
                                    let s: u64 = String::from_utf8(raw).unwrap().parse().unwrap();
                                    assert_eq!(
                                        list.pop_front(),
                                        Some(s),
                                        "trim of a job not oldest"
                                    );
                                    acked += 1;
                                }
                            }
                            Ack::One(raw) => {
                                let s: u64 = String::from_utf8(raw).unwrap().parse().unwrap();
                                let i = list.iter().position(|e| *e == s).expect("acked twice");
                                list.remove(i);
                                acked += 1;
                            }
                        }
                    }
                }
            }
            assert_eq!(w.in_list("q"), list.len(), "step {step}");
            assert!(
                w.held() <= 2 * list.len() + 1,
                "step {step}: held {}",
                w.held()
            );
        }
        for (_, ack) in w.take_acks(t, true).acks {
            acked += match ack {
                Ack::Oldest(v) => v.len(),
                Ack::One(_) => 1,
            };
        }
        assert_eq!(acked, finished);
        assert_eq!(w.in_list("q"), running.len());
    }
}

//! Reliable fetch's picture of its own working lists (`playguard:working:<identity>:<q>`):
//! every job it moved there, in list order (oldest first, at the list's right end), and whether
//! it still runs, finished and waits for its acknowledgement, or left the list already. Touches
//! no Redis keys itself: `acks.rs` turns what this says into commands.
//!
//! Why: an LREM per finished job makes Redis compare the payload with the list's elements and
//! shift the rest, and was most of Redis's CPU per job. Jobs mostly finish in the order they
//! were fetched, so the finished ones at the old end leave in one guarded trim
//! (`lua/ack_oldest.lua`) per batch. A finished job held behind one that keeps running goes
//! by its own LREM once that job ran past `BLOCKED_GRACE`, so a long job never keeps finished
//! ones in the list (where a crash would make them run again).
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
    /// No longer in the list (settled, requeued, or acknowledged by its own LREM).
    Gone,
}

/// One working list, oldest job first.
#[derive(Default)]
struct Lane {
    /// The sequence number of `entries[0]`.
    first: u64,
    entries: VecDeque<State>,
    /// Finished entries not yet handed to the acks task.
    done: usize,
    /// The running entry found holding finished ones behind it, and since when.
    blocked: Option<(u64, Instant)>,
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
        let seq = lane.first + lane.entries.len() as u64;
        lane.entries.extend((0..n).map(|_| State::Running));
        seq
    }

    /// A job finished: its acknowledgement waits for the next flush.
    pub fn finished(&mut self, queue: &str, seq: u64, raw: Vec<u8>) {
        match self.entry(queue, seq) {
            Some((lane, i)) => {
                lane.entries[i] = State::Done(raw);
                lane.done += 1;
            }
            None => self.loose.push((queue.to_string(), raw)),
        }
    }

    /// A job left the list by another way, confirmed by Redis (settled with its outcome, or
    /// pushed back to its queue).
    pub fn gone(&mut self, queue: &str, seq: u64) {
        if let Some((lane, i)) = self.entry(queue, seq) {
            lane.entries[i] = State::Gone;
        }
    }

    /// Everything left the lists (a drain pushed it all back to the queues).
    pub fn reset(&mut self) {
        for lane in self.lanes.values_mut() {
            lane.first += lane.entries.len() as u64;
            lane.entries.clear();
            lane.done = 0;
            lane.blocked = None;
        }
    }

    /// How many of `queue`'s jobs may still be in its working list: running, or finished and
    /// not yet handed to the acks task (those handed over are the acks' pending count).
    pub fn in_list(&self, queue: &str) -> usize {
        let lane = self.lanes.get(queue).map_or(0, |l| {
            l.entries
                .iter()
                .filter(|e| !matches!(e, State::Gone))
                .count()
        });
        lane + self.loose.iter().filter(|(q, _)| q == queue).count()
    }

    /// Finished jobs not yet handed to the acks task.
    #[cfg(test)]
    pub fn waiting(&self) -> usize {
        self.lanes.values().map(|l| l.done).sum::<usize>() + self.loose.len()
    }

    fn entry(&mut self, queue: &str, seq: u64) -> Option<(&mut Lane, usize)> {
        let lane = self.lanes.get_mut(queue)?;
        let i = seq.checked_sub(lane.first)? as usize;
        (i < lane.entries.len()).then_some((lane, i))
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
            let mut oldest = Vec::new();
            while let Some(front) = lane.entries.front() {
                if matches!(front, State::Running) {
                    break;
                }
                if let Some(State::Done(raw)) = lane.entries.pop_front() {
                    oldest.push(raw);
                }
                lane.first += 1;
            }
            lane.done -= oldest.len();
            match oldest.len() {
                0 => {}
                1 => flush
                    .acks
                    .push((queue.clone(), Ack::One(oldest.pop().unwrap()))),
                _ => flush.acks.push((queue.clone(), Ack::Oldest(oldest))),
            }
            if lane.done == 0 {
                lane.blocked = None;
                continue;
            }
            // The front runs and finished jobs wait behind it.
            let since = match lane.blocked {
                Some((seq, t)) if seq == lane.first => t,
                _ => {
                    lane.blocked = Some((lane.first, now));
                    now
                }
            };
            if all || now.duration_since(since) >= BLOCKED_GRACE {
                for e in lane.entries.iter_mut() {
                    if matches!(e, State::Done(_)) {
                        if let State::Done(raw) = std::mem::replace(e, State::Gone) {
                            flush.acks.push((queue.clone(), Ack::One(raw)));
                        }
                    }
                }
                lane.done = 0;
            } else {
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
}

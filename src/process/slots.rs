//! What every slot is doing right now, and the processed/failed counters not yet flushed.
//! The heartbeat publishes both (to `<identity>:work`, `<identity>:workers`, `busy` and the
//! `stat:*` keys) from one snapshot so `busy` always agrees with the work hash.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

#[derive(Debug, Clone)]
pub struct SlotEntry {
    pub queue: Arc<str>,
    /// The original payload string, published verbatim as Sidekiq does.
    pub payload: Arc<str>,
    /// Epoch seconds (integer), as Sidekiq's `run_at`.
    pub run_at: i64,
    pub jid: Arc<str>,
    pub class: Arc<str>,
    /// The running phase of a phased job (shown on the Busy page, never put into the payload).
    pub phase: Option<String>,
    pub started: Instant,
}

/// The running jobs, each in a place reused once it ends (no map to search or rebalance per
/// job), with its number; the tid is formatted from the number only when the table is read.
#[derive(Default)]
struct Places {
    places: Vec<Option<(u64, SlotEntry)>>,
    free: Vec<usize>,
    busy: usize,
}

#[derive(Default)]
pub struct SlotTable {
    slots: Mutex<Places>,
    next: AtomicU64,
    processed: AtomicU64,
    failed: AtomicU64,
}

/// Removes the slot's entry when the job's processing ends, however it ends.
pub struct SlotGuard {
    state: Arc<SlotTable>,
    place: usize,
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        let gone = {
            let mut s = self.state.slots.lock().unwrap();
            s.free.push(self.place);
            s.busy -= 1;
            s.places[self.place].take()
        };
        drop(gone);
    }
}

impl SlotGuard {
    pub fn set_phase(&self, phase: Option<&str>) {
        if let Some((_, e)) = &mut self.state.slots.lock().unwrap().places[self.place] {
            e.phase = phase.map(str::to_string);
        }
    }
}

/// Sidekiq names work entries by a short base-36 thread id; we number slots the same way.
fn tid(n: u64) -> String {
    const DIGITS: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut n = n + 36 * 36; // at least three characters, like Ruby's tids
    let mut out = Vec::new();
    while n > 0 {
        out.push(DIGITS[(n % 36) as usize]);
        n /= 36;
    }
    out.reverse();
    String::from_utf8(out).unwrap()
}

impl SlotTable {
    pub fn new() -> Arc<SlotTable> {
        Arc::new(SlotTable::default())
    }

    pub fn begin(self: &Arc<Self>, entry: SlotEntry) -> SlotGuard {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let mut s = self.slots.lock().unwrap();
        s.busy += 1;
        let place = match s.free.pop() {
            Some(p) => {
                s.places[p] = Some((n, entry));
                p
            }
            None => {
                s.places.push(Some((n, entry)));
                s.places.len() - 1
            }
        };
        SlotGuard {
            state: self.clone(),
            place,
        }
    }

    /// Every running job with its tid, oldest first.
    pub fn snapshot(&self) -> Vec<(String, SlotEntry)> {
        let mut running: Vec<(u64, SlotEntry)> = self
            .slots
            .lock()
            .unwrap()
            .places
            .iter()
            .flatten()
            .cloned()
            .collect();
        running.sort_by_key(|(n, _)| *n);
        running.into_iter().map(|(n, e)| (tid(n), e)).collect()
    }

    pub fn busy(&self) -> usize {
        self.slots.lock().unwrap().busy
    }

    /// Count a finished job the way processor.rb's `stats` does.
    pub fn count(&self, failed: bool) {
        self.processed.fetch_add(1, Ordering::Relaxed);
        if failed {
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Take the unflushed deltas (processed, failed).
    pub fn take_counts(&self) -> (u64, u64) {
        (
            self.processed.swap(0, Ordering::Relaxed),
            self.failed.swap(0, Ordering::Relaxed),
        )
    }

    /// Put deltas back after a failed flush, so nothing is lost.
    pub fn restore_counts(&self, processed: u64, failed: u64) {
        self.processed.fetch_add(processed, Ordering::Relaxed);
        self.failed.fetch_add(failed, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(jid: &str) -> SlotEntry {
        SlotEntry {
            queue: "q".into(),
            payload: "{}".into(),
            run_at: 0,
            jid: jid.into(),
            class: "C".into(),
            phase: None,
            started: Instant::now(),
        }
    }

    /// An ended job's place is reused; the table still lists jobs oldest first with tids
    /// that are never given twice, and counts them.
    #[test]
    fn places_are_reused_and_the_snapshot_stays_in_order() {
        let t = SlotTable::new();
        let a = t.begin(entry("a"));
        let b = t.begin(entry("b"));
        drop(a);
        let c = t.begin(entry("c"));
        c.set_phase(Some("sync"));
        let snap = t.snapshot();
        let jids: Vec<&str> = snap.iter().map(|(_, e)| &*e.jid).collect();
        assert_eq!(jids, ["b", "c"]);
        assert_eq!(snap[0].0, tid(1));
        assert_eq!(snap[1].0, tid(2));
        assert_eq!(snap[1].1.phase.as_deref(), Some("sync"));
        assert_eq!(t.busy(), 2);
        drop((b, c));
        assert_eq!(t.busy(), 0);
        assert!(t.snapshot().is_empty());
    }
}

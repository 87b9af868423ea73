//! What every slot is doing right now, and the processed/failed counters not yet flushed.
//! The heartbeat publishes both (to `<identity>:work`, `<identity>:workers`, `busy` and the
//! `stat:*` keys) from one snapshot so `busy` always agrees with the work hash.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

#[derive(Debug, Clone)]
pub struct SlotEntry {
    pub queue: String,
    /// The original payload string, published verbatim as Sidekiq does.
    pub payload: Arc<str>,
    /// Epoch seconds (integer), as Sidekiq's `run_at`.
    pub run_at: i64,
    pub jid: String,
    pub class: String,
    /// The running phase of a phased job (shown on the Busy page, never put into the payload).
    pub phase: Option<String>,
    pub started: Instant,
}

#[derive(Default)]
pub struct SlotTable {
    slots: Mutex<BTreeMap<String, SlotEntry>>,
    next: AtomicU64,
    processed: AtomicU64,
    failed: AtomicU64,
}

/// Removes the slot's entry when the job's processing ends, however it ends.
pub struct SlotGuard {
    state: Arc<SlotTable>,
    pub tid: String,
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.state.slots.lock().unwrap().remove(&self.tid);
    }
}

impl SlotGuard {
    pub fn set_phase(&self, phase: Option<&str>) {
        if let Some(e) = self.state.slots.lock().unwrap().get_mut(&self.tid) {
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
        let tid = tid(self.next.fetch_add(1, Ordering::Relaxed));
        self.slots.lock().unwrap().insert(tid.clone(), entry);
        SlotGuard {
            state: self.clone(),
            tid,
        }
    }

    pub fn snapshot(&self) -> Vec<(String, SlotEntry)> {
        self.slots
            .lock()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    pub fn busy(&self) -> usize {
        self.slots.lock().unwrap().len()
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

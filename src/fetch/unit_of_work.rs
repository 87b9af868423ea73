//! One fetched job, as the fetch strategy hands it to the processor and takes it back (to
//! acknowledge, settle or requeue it): where it came from and the exact bytes popped. Touches
//! no Redis keys itself.

/// Bytes, not a String: a payload that is not even UTF-8 must still reach the dead set (or go
/// back) unchanged.
#[derive(Debug, Clone)]
pub struct UnitOfWork {
    /// Shared by every job of one fetch from this queue (and the job's context and slot).
    pub queue: std::sync::Arc<str>,
    pub raw: Vec<u8>,
    /// The liveness lapse count when the fetch was sent: a job whose process lapsed since may
    /// already have been recovered by another process (see `process/liveness.rs`).
    pub epoch: u64,
    /// Reliable fetch: its place in the working list's order (see `working_order.rs`).
    pub seq: u64,
}

impl UnitOfWork {
    /// The payload for log lines (invalid UTF-8 shown with replacement characters).
    pub fn payload_lossy(&self) -> std::borrow::Cow<'_, str> {
        String::from_utf8_lossy(&self.raw)
    }

    /// `queue:<q>`, the list it was popped from and goes back to.
    pub fn queue_key(&self) -> String {
        crate::job::queues::queue_key(&self.queue)
    }
}

//! A fetched job's end as the strategy writes it: its outcome settled with its
//! acknowledgement (`lua/settle.lua` for reliable fetch, one MULTI for basic), or the job pushed
//! back to its queue, deferred while Redis cannot be reached. Keys: `queue:<name>`, our working
//! lists, and those an outcome writes (`retry`, `dead`, `schedule`, stats).

use super::strategy::{FetchStrategy, Mode};
use super::unit_of_work::UnitOfWork;
use crate::job::retry::Record;

/// Pause between attempts to write an outcome (as the acks are retried).
const SETTLE_RETRY_PAUSE: std::time::Duration = std::time::Duration::from_millis(500);

impl FetchStrategy {
    /// Record a job's outcome (a retry, dead, or nothing) together with its acknowledgement,
    /// retrying until it lands. Reliable fetch writes it only while the job is still in our
    /// working list (`lua/settle.lua`): a job the orphan sweep took back while our lease
    /// lapsed may run elsewhere now, and a retry written for our copy would run it once more.
    /// Basic fetch writes it in one MULTI. Past the shutdown deadline it gives up (logged);
    /// with reliable fetch a job whose ack did not land either stays in the working list and
    /// runs again rather than being lost.
    /// Whether the outcome was written (false: the job had left our working list, or the
    /// shutdown deadline passed first).
    pub async fn settle(&self, job: &UnitOfWork, record: Record<'_>) -> bool {
        let mut pipe = redis::pipe();
        pipe.atomic();
        record.add_to_pipeline(&mut pipe);
        if matches!(self.mode, Mode::Basic(_)) && pipe.cmd_iter().next().is_none() {
            return true;
        }
        let mut conn = self.conn.clone();
        let mut attempts = 0u32;
        loop {
            let landed = match &self.mode {
                Mode::Reliable(r) => r.settle(job, &record).await,
                Mode::Basic(_) => pipe.query_async::<()>(&mut conn).await.map(|()| true),
            };
            let e = match landed {
                Ok(ours) => {
                    if let Mode::Reliable(r) = &self.mode {
                        r.gone(job);
                    }
                    if ours {
                        if let Record::Retry { at, .. } | Record::Schedule { at, .. } = record {
                            self.next_due.note(at);
                        }
                        let writes = pipe.cmd_iter().next().is_some();
                        self.recent.finished(job, writes.then_some(pipe));
                    } else {
                        tracing::warn!(queue = %job.queue,
                            "outcome not recorded: the job had left our working list (the orphan sweep returned it to its queue while our liveness lease lapsed), so it runs again there, once");
                    }
                    return ours;
                }
                Err(e) => e,
            };
            if self.shutdown.past_deadline() {
                tracing::error!(error = %e, queue = %job.queue, payload = %job.payload_lossy(),
                    "could not record the job's outcome in Redis before the shutdown deadline{}",
                    if self.recovers_orphans() { "; if it is still in the working list it will run again" } else { "" });
                return false;
            }
            // Once, then every 10 s: Redis out of memory can refuse it for minutes.
            attempts += 1;
            if attempts % 20 == 1 {
                tracing::warn!(error = %e, queue = %job.queue, attempts,
                    "could not record the job's outcome in Redis; retrying");
            }
            tokio::time::sleep(SETTLE_RETRY_PAUSE).await;
        }
    }

    /// Push an unfinished job back to its queue, once, as `instead` when given (the job with
    /// its shutdown count raised, `job/interrupted.rs`). `Ok(false)`: it was no longer ours
    /// (the orphan sweep had already returned it), nothing pushed.
    pub(super) async fn requeue(
        &self,
        job: &UnitOfWork,
        instead: Option<&[u8]>,
    ) -> redis::RedisResult<bool> {
        match &self.mode {
            Mode::Reliable(r) => {
                let pushed = r.requeue(job, instead).await?;
                // Pushed back, or returned by the sweep already: out of our list either way.
                r.gone(job);
                Ok(pushed)
            }
            Mode::Basic(b) => b.requeue(job, instead).await,
        }
    }

    /// Requeue, logging instead of failing: with reliable fetch a job we could not push back
    /// stays in the working list and is retried after the next heartbeat that lands.
    pub async fn requeue_logged(&self, job: &UnitOfWork) {
        self.requeue_as_logged(job, None).await
    }

    /// `requeue_logged`, pushing `instead` back in the job's place when given.
    pub async fn requeue_as_logged(&self, job: &UnitOfWork, instead: Option<Vec<u8>>) {
        match self.requeue(job, instead.as_deref()).await {
            Ok(true) => tracing::info!(queue = %job.queue, "pushed 1 job back to Redis"),
            Ok(false) => tracing::info!(queue = %job.queue,
                "not pushed back: the orphan sweep had already returned it to its queue"),
            Err(e) if self.recovers_orphans() => {
                tracing::error!(queue = %job.queue, error = %e,
                    "could not push the job back now; it stays in the working list and is retried after the next heartbeat");
                self.deferred_requeues
                    .lock()
                    .unwrap()
                    .push((job.clone(), instead));
            }
            Err(e) => {
                tracing::error!(queue = %job.queue, error = %e, payload = %job.payload_lossy(),
                "could not push the job back (basic fetch): this job is lost")
            }
        }
    }

    /// Push back the jobs whose requeue failed earlier (after a heartbeat landed). Each stays
    /// deferred until Redis answers; LREM semantics keep a swept job from being pushed twice.
    pub async fn retry_deferred_requeues(&self) {
        let deferred = std::mem::take(&mut *self.deferred_requeues.lock().unwrap());
        for (job, instead) in deferred {
            self.requeue_as_logged(&job, instead).await;
        }
    }
}

//! The job: what a popped payload is (Sidekiq's JSON rules), which queue it lives in, the
//! handlers a class runs, how a failure is retried or sent to dead (Sidekiq's job_retry.rb),
//! the push that puts a new job on its queue (Sidekiq::Client), and when the scheduled poller
//! next wakes (`next_due.rs`), the server side of sidekiq-unique-jobs (`unique_jobs.rs`), and
//! Sidekiq's cancel flag watched for running jobs (`cancel.rs`).
//! Keys: `queue:<q>`, `queues`, `retry`, `schedule`, `dead`, `uniquejobs:*`, `it-<jid>`.

pub mod cancel;
pub mod client;
pub mod error_class;
pub mod handler;
pub mod interrupted;
pub mod next_due;
pub mod options;
pub mod payload;
pub mod queues;
pub mod report;
pub mod retry;
pub mod retry_policy;
pub mod unique_fields;
pub mod unique_jobs;

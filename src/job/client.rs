//! The client side: build a Sidekiq payload and push it as the Ruby client does
//! (`SADD queues` + `LPUSH queue:<q>` in one pipeline, or `ZADD schedule` for later).
//! Used by `playguard enqueue` and the periodic dispatcher.

use crate::job::payload::{dump, float_value, new_jid, now_f64};
use serde_json::{Map, Value};

/// A job to push.
#[derive(Debug, Clone)]
pub struct NewJob {
    pub class: String,
    pub args: Vec<Value>,
    pub queue: String,
    /// `true`, `false` or a number, as Sidekiq's `retry` option.
    pub retry: Value,
    /// Run at this epoch time (seconds) instead of now.
    pub at: Option<f64>,
}

impl NewJob {
    /// The payload in Sidekiq's key order: options, caller keys, jid, created_at, enqueued_at.
    pub fn payload(&self, jid: &str, now: f64) -> String {
        let mut m = Map::new();
        m.insert("retry".into(), self.retry.clone());
        m.insert("queue".into(), Value::from(self.queue.clone()));
        m.insert("class".into(), Value::from(self.class.clone()));
        m.insert("args".into(), Value::Array(self.args.clone()));
        m.insert("jid".into(), Value::from(jid));
        m.insert("created_at".into(), float_value(now));
        // The current span, where the Ruby client's tracing middleware puts it.
        crate::traces::inject(&mut m);
        if self.at.is_none() {
            m.insert("enqueued_at".into(), float_value(now));
        }
        dump(&m)
    }
}

/// Add the push of `job` to a pipeline; returns its jid.
pub fn add_push(pipe: &mut redis::Pipeline, job: &NewJob, now: f64) -> String {
    let jid = new_jid();
    let payload = job.payload(&jid, now);
    match job.at {
        Some(at) if at > now => {
            pipe.zadd("schedule", payload, float_value(at).to_string())
                .ignore();
        }
        _ => {
            pipe.sadd("queues", &job.queue)
                .ignore()
                .lpush(crate::job::queues::queue_key(&job.queue), payload)
                .ignore();
        }
    }
    jid
}

/// Push one job now (or at `job.at`); returns its jid.
pub async fn push<C: redis::aio::ConnectionLike>(
    conn: &mut C,
    job: &NewJob,
) -> redis::RedisResult<String> {
    let mut pipe = redis::pipe();
    let jid = add_push(&mut pipe, job, now_f64());
    pipe.query_async::<()>(conn).await?;
    Ok(jid)
}

//! `playguard enqueue`: push one job as Sidekiq::Client does (`job/client.rs`), its arguments
//! parsed from the command line. Keys: `queue:<q>`, `queues`, `schedule`.

use super::*;
use std::time::Duration;

pub(super) fn enqueue(a: EnqueueArgs) -> i32 {
    if a.queue.trim().is_empty() {
        return report(&StartError::Config("--queue must not be empty".into()));
    }
    let mut args = Vec::new();
    for (i, s) in a.args.iter().enumerate() {
        match parse_arg(s) {
            Ok(v) => args.push(v),
            Err(e) => {
                let why = format!("argument {} ({s:?}) is not valid JSON: {e}", i + 1);
                return report(&StartError::Config(why));
            }
        }
    }
    let retry = match a.retry.as_deref() {
        None | Some("true") => serde_json::Value::Bool(true),
        Some("false") => serde_json::Value::Bool(false),
        Some(n) => match n.parse::<i64>() {
            Ok(n) => serde_json::Value::from(n),
            Err(_) => {
                let why = format!("--retry takes a number, true or false, not {n:?}");
                return report(&StartError::Config(why));
            }
        },
    };
    let job = crate::job::client::NewJob {
        class: a.class,
        args,
        queue: a.queue,
        retry,
        at: a.in_secs.map(|s| crate::job::payload::now_f64() + s),
    };
    crate::traces::start("playguard");
    let res = runtime().block_on(async {
        let (_, mut conn) = open_redis(&a.redis.url, Duration::ZERO).await?;
        let push = crate::job::client::push(&mut conn, &job);
        Ok(crate::traces::publish(&job.queue, push).await)
    });
    crate::traces::stop(Duration::from_secs(2));
    match res {
        Err(e) => report(&e),
        Ok(Ok(jid)) => {
            println!("{jid}");
            0
        }
        Ok(Err(e)) => {
            eprintln!(
                "playguard: cannot enqueue at {}: {e}",
                crate::connections::redact::url(&a.redis.url)
            );
            1
        }
    }
}

/// A JSON value; a bare word (not starting like JSON) is taken as a string, so
/// `enqueue Job hello 42` sends ["hello", 42], while a broken `[1,` is an error, not "[1,".
fn parse_arg(s: &str) -> Result<serde_json::Value, serde_json::Error> {
    match serde_json::from_str(s) {
        Ok(v) => Ok(v),
        Err(e) => {
            let t = s.trim_start();
            let looks_json = t.starts_with(['[', '{', '"'])
                || t.starts_with(|c: char| c.is_ascii_digit())
                || (t.starts_with('-') && t[1..].starts_with(|c: char| c.is_ascii_digit()));
            if looks_json {
                Err(e)
            } else {
                Ok(serde_json::Value::from(s))
            }
        }
    }
}

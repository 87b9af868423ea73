//! rusty-sidekiq 0.15.2 running the benchmark's no-op job, configured like playguard's run:
//! one queue, `-c` workers (default 25), a bb8 pool of `-c` + 5 connections (each worker holds
//! one for its BRPOP, the rest serve the heartbeat and the work-set writes) with
//! ping-on-checkout off (its best setting: on, every checkout costs a PING round trip).
//! `LatencyJob` records pick-up delays for the idle measurement. Logs through tracing at
//! RUST_LOG (default info: its per-job start/done lines). SIGTERM or SIGINT cancels the
//! processor, which finishes its jobs and exits.
//!   rusty-bench REDIS_URL QUEUE [CONCURRENCY]
use async_trait::async_trait;
use sidekiq::{Processor, ProcessorConfig, RedisConnectionManager, Result, Worker};

#[derive(Clone)]
struct NoopJob;

#[async_trait]
impl Worker<Vec<u8>> for NoopJob {
    // The bench pushes `"args":[]`: an empty list, which `()` would refuse.
    async fn perform(&self, _args: Vec<u8>) -> Result<()> {
        Ok(())
    }
}

/// args = [enqueue time in epoch microseconds]; LPUSHes the pick-up delay to `bench:latency`.
#[derive(Clone)]
struct LatencyJob(sidekiq::RedisPool);

#[async_trait]
impl Worker<i64> for LatencyJob {
    async fn perform(&self, sent_us: i64) -> Result<()> {
        let now_us = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros() as i64;
        let mut conn = self.0.get().await?;
        conn.lpush("bench:latency".to_string(), now_us - sent_us)
            .await?;
        Ok(())
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_ansi(false)
        .init();
    let mut argv = std::env::args().skip(1);
    let url = argv
        .next()
        .expect("usage: rusty-bench REDIS_URL QUEUE [CONCURRENCY]");
    let queue = argv
        .next()
        .expect("usage: rusty-bench REDIS_URL QUEUE [CONCURRENCY]");
    let conc: usize = argv.next().map_or(25, |c| c.parse().expect("CONCURRENCY"));
    let manager = RedisConnectionManager::new(url)?;
    let redis = bb8::Pool::builder()
        .max_size(conc as u32 + 5)
        .test_on_check_out(false)
        .build(manager)
        .await?;
    let mut p = Processor::new(redis.clone(), vec![queue])
        .with_config(ProcessorConfig::default().num_workers(conc));
    p.register(NoopJob);
    p.register(LatencyJob(redis));
    let token = p.get_cancellation_token();
    tokio::spawn(async move {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).unwrap();
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        token.cancel();
    });
    p.run().await;
    Ok(())
}

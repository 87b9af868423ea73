//! Metrics: the Prometheus series and the HTTP server that serves them with /health, and the
//! counters behind the Sidekiq Web UI's Metrics tab. Keys: those of `sidekiq_tab.rs`.

pub mod prometheus;
pub mod redis_gauges;
pub mod server;
pub mod sidekiq_tab;

//! Prometheus counters kept in memory and served as text on `--metrics-addr` (`/metrics`),
//! plus `/health`, which fails once Redis has been unreachable for longer than a beat.
//! Reads no Redis keys itself: the heartbeat reports its own success here.

use crate::handler::Outcome;
use crate::retry::Decision;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;

/// Upper bounds (seconds) of the duration histograms.
const BUCKETS: [f64; 12] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0, 300.0,
];

#[derive(Default)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    sum: f64,
    total: u64,
}

impl Histogram {
    fn observe(&mut self, v: f64) {
        for (i, b) in BUCKETS.iter().enumerate() {
            if v <= *b {
                self.counts[i] += 1;
            }
        }
        self.sum += v;
        self.total += 1;
    }
}

type Labels = Vec<(&'static str, String)>;

#[derive(Default)]
pub struct Metrics {
    counters: Mutex<BTreeMap<(&'static str, Labels), u64>>,
    histograms: Mutex<BTreeMap<(&'static str, Labels), Histogram>>,
    pub busy: AtomicI64,
    pub concurrency: AtomicI64,
    /// Seconds of queue latency per queue, updated by the heartbeat.
    latency: Mutex<BTreeMap<String, f64>>,
    /// Unix ms of the last successful heartbeat write.
    pub last_redis_ok_ms: AtomicI64,
    fetched: AtomicU64,
    fetch_calls: AtomicU64,
}

impl Metrics {
    pub fn inc(&self, name: &'static str, labels: Labels) {
        self.add(name, labels, 1);
    }

    pub fn add(&self, name: &'static str, labels: Labels, n: u64) {
        *self
            .counters
            .lock()
            .unwrap()
            .entry((name, labels))
            .or_default() += n;
    }

    pub fn observe(&self, name: &'static str, labels: Labels, secs: f64) {
        self.histograms
            .lock()
            .unwrap()
            .entry((name, labels))
            .or_default()
            .observe(secs);
    }

    pub fn job_finished(&self, class: &str, queue: &str, outcome: &Outcome, secs: f64) {
        let l = vec![("class", class.to_string()), ("queue", queue.to_string())];
        self.inc("playguard_jobs_processed_total", l.clone());
        match outcome {
            Outcome::Failed(_) => self.inc("playguard_jobs_failed_total", l.clone()),
            Outcome::Requeue => self.inc("playguard_jobs_requeued_total", l.clone()),
            Outcome::Done => {}
        }
        self.observe("playguard_job_duration_seconds", l, secs);
    }

    pub fn job_fate(&self, class: &str, queue: &str, d: &Decision) {
        let l = vec![("class", class.to_string()), ("queue", queue.to_string())];
        match d {
            Decision::Retry { .. } => self.inc("playguard_jobs_retried_total", l),
            Decision::Dead { .. } => self.inc("playguard_jobs_dead_total", l),
            Decision::Discard => self.inc("playguard_jobs_discarded_total", l),
        }
    }

    pub fn garbage(&self, queue: &str) {
        self.inc(
            "playguard_jobs_dead_total",
            vec![("class", "".into()), ("queue", queue.into())],
        );
    }

    /// `event` is one of acquired, skipped, lost, released.
    pub fn lock_event(&self, class: &str, event: &'static str) {
        self.inc(
            "playguard_lock_events_total",
            vec![("class", class.to_string()), ("event", event.to_string())],
        );
    }

    pub fn phase_finished(&self, class: &str, phase: &str, secs: f64) {
        self.observe(
            "playguard_phase_duration_seconds",
            vec![("class", class.to_string()), ("phase", phase.to_string())],
            secs,
        );
    }

    pub fn fetch_batch(&self, n: usize) {
        self.fetched.fetch_add(n as u64, Ordering::Relaxed);
        self.fetch_calls.fetch_add(1, Ordering::Relaxed);
    }

    pub fn set_latency(&self, queue: &str, secs: f64) {
        self.latency.lock().unwrap().insert(queue.to_string(), secs);
    }

    /// Healthy when Redis answered within `max_age_ms`.
    pub fn healthy(&self, max_age_ms: i64) -> bool {
        let last = self.last_redis_ok_ms.load(Ordering::Relaxed);
        last > 0 && chrono::Utc::now().timestamp_millis() - last <= max_age_ms
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let mut typed = std::collections::HashSet::new();
        for ((name, labels), v) in self.counters.lock().unwrap().iter() {
            if typed.insert(*name) {
                let _ = writeln!(out, "# TYPE {name} counter");
            }
            let _ = writeln!(out, "{name}{} {v}", fmt_labels(labels, None));
        }
        for ((name, labels), h) in self.histograms.lock().unwrap().iter() {
            if typed.insert(*name) {
                let _ = writeln!(out, "# TYPE {name} histogram");
            }
            for (i, b) in BUCKETS.iter().enumerate() {
                let _ = writeln!(
                    out,
                    "{name}_bucket{} {}",
                    fmt_labels(labels, Some(&b.to_string())),
                    h.counts[i]
                );
            }
            let _ = writeln!(
                out,
                "{name}_bucket{} {}",
                fmt_labels(labels, Some("+Inf")),
                h.total
            );
            let _ = writeln!(out, "{name}_sum{} {}", fmt_labels(labels, None), h.sum);
            let _ = writeln!(out, "{name}_count{} {}", fmt_labels(labels, None), h.total);
        }
        let _ = writeln!(out, "# TYPE playguard_busy_slots gauge");
        let _ = writeln!(
            out,
            "playguard_busy_slots {}",
            self.busy.load(Ordering::Relaxed)
        );
        let _ = writeln!(out, "# TYPE playguard_concurrency gauge");
        let _ = writeln!(
            out,
            "playguard_concurrency {}",
            self.concurrency.load(Ordering::Relaxed)
        );
        let _ = writeln!(out, "# TYPE playguard_queue_latency_seconds gauge");
        for (q, s) in self.latency.lock().unwrap().iter() {
            let _ = writeln!(
                out,
                "playguard_queue_latency_seconds{{queue=\"{}\"}} {s}",
                escape(q)
            );
        }
        let _ = writeln!(out, "# TYPE playguard_fetched_jobs_total counter");
        let _ = writeln!(
            out,
            "playguard_fetched_jobs_total {}",
            self.fetched.load(Ordering::Relaxed)
        );
        let _ = writeln!(out, "# TYPE playguard_fetch_calls_total counter");
        let _ = writeln!(
            out,
            "playguard_fetch_calls_total {}",
            self.fetch_calls.load(Ordering::Relaxed)
        );
        out
    }
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn fmt_labels(labels: &Labels, le: Option<&str>) -> String {
    let mut parts: Vec<String> = labels
        .iter()
        .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
        .collect();
    if let Some(le) = le {
        parts.push(format!("le=\"{le}\""));
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!("{{{}}}", parts.join(","))
    }
}

/// Serve `/metrics` and `/health` on `addr` until the process ends.
pub async fn serve(
    addr: std::net::SocketAddr,
    metrics: std::sync::Arc<Metrics>,
    beat_ms: i64,
) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(%addr, "metrics endpoint listening");
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                continue;
            };
            let metrics = metrics.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let n = match tokio::time::timeout(
                    std::time::Duration::from_secs(5),
                    sock.read(&mut buf),
                )
                .await
                {
                    Ok(Ok(n)) => n,
                    _ => return,
                };
                let req = String::from_utf8_lossy(&buf[..n]);
                let path = req.split_whitespace().nth(1).unwrap_or("/");
                let (status, body, ctype) = match path {
                    "/metrics" => ("200 OK", metrics.render(), "text/plain; version=0.0.4"),
                    "/health" if metrics.healthy(beat_ms * 2) => {
                        ("200 OK", "ok\n".to_string(), "text/plain")
                    }
                    "/health" => (
                        "503 Service Unavailable",
                        "redis unreachable\n".to_string(),
                        "text/plain",
                    ),
                    _ => ("404 Not Found", "not found\n".to_string(), "text/plain"),
                };
                let resp = format!(
                    "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = sock.write_all(resp.as_bytes()).await;
            });
        }
    });
    Ok(())
}

//! The Prometheus endpoint on `--metrics-addr`: `/metrics` (the text of [`Metrics::render`]),
//! `/health`, which fails once Redis has been unreachable for longer than a beat or while the
//! command guardian does not answer (`commands/guardian/watchdog.rs`), and `/ready`, which
//! also fails while the worker is quiet, stopping, or its liveness lease lapsed. A tiny
//! HTTP/1.1 server of its own, bounded in connections and time so no client can grow our
//! memory or hold a task. Touches no Redis keys.

use crate::metrics::prometheus::Metrics;
use crate::process::liveness::Liveness;
use crate::process::shutdown::Shutdown;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Connections served at once; one more is closed at once (a scraper needs one or two).
const MAX_CONNECTIONS: usize = 64;
/// How long a client may take to send its request head, and to take our answer.
const IO_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest request head read; the path is all we look at.
const MAX_HEAD: usize = 16 * 1024;

/// Whether the command guardian answered its last ping in time (`commands/guardian/watchdog.rs`).
/// One per process, as the guardian is.
static GUARDIAN_SILENT: AtomicBool = AtomicBool::new(false);

/// Record whether the command guardian answers: `/health` fails while it does not.
pub fn guardian_answers(yes: bool) {
    GUARDIAN_SILENT.store(!yes, Ordering::Relaxed);
}

/// What the three paths answer from.
#[derive(Clone)]
pub struct Probes {
    pub metrics: Arc<Metrics>,
    /// The heartbeat interval: /health fails after two without an answer from Redis.
    pub beat_ms: i64,
    pub shutdown: Shutdown,
    pub liveness: Liveness,
}

/// Serve `/metrics`, `/health` and `/ready` on `addr` until the process ends.
pub async fn serve(addr: std::net::SocketAddr, probes: Probes) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(%addr, "metrics endpoint listening");
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    tokio::spawn(async move {
        loop {
            let Ok((sock, _)) = listener.accept().await else {
                continue;
            };
            // Every slot taken (a flood, or slow clients): close this one now rather than
            // queue it, so no number of connections can grow our memory.
            let Ok(permit) = slots.clone().try_acquire_owned() else {
                drop(sock);
                continue;
            };
            let probes = probes.clone();
            tokio::spawn(async move {
                let _permit = permit;
                answer(sock, &probes).await;
            });
        }
    });
    Ok(())
}

/// Read one request head, write one answer, close.
async fn answer(mut sock: TcpStream, probes: &Probes) {
    // Read until the end of the request head: a client may send it in pieces.
    let mut buf = Vec::with_capacity(1024);
    let head = async {
        let mut chunk = [0u8; 1024];
        while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < MAX_HEAD {
            match sock.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    };
    if tokio::time::timeout(IO_TIMEOUT, head).await.is_err() {
        return;
    }
    let req = String::from_utf8_lossy(&buf);
    let path = req.split_whitespace().nth(1).unwrap_or("/");
    let (status, body, ctype) = route(path, probes);
    let resp = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    // A client that does not read its answer is dropped too.
    let _ = tokio::time::timeout(IO_TIMEOUT, sock.write_all(resp.as_bytes())).await;
}

/// Status line, body and content type for `path`.
fn route(path: &str, probes: &Probes) -> (&'static str, String, &'static str) {
    const UNAVAILABLE: &str = "503 Service Unavailable";
    match path {
        "/metrics" => (
            "200 OK",
            probes.metrics.render(),
            "text/plain; version=0.0.4",
        ),
        "/health" if GUARDIAN_SILENT.load(Ordering::Relaxed) => (
            UNAVAILABLE,
            "command guardian not answering: replaced, its commands killed\n".to_string(),
            "text/plain",
        ),
        // Below the status line, one line per thing wrong with Redis's state (none fails it).
        "/health" => {
            let detail = super::redis_gauges::health_detail(&probes.metrics.redis);
            match redis_answers(probes) {
                true => ("200 OK", format!("ok\n{detail}"), "text/plain"),
                false => (
                    UNAVAILABLE,
                    format!("redis unreachable\n{detail}"),
                    "text/plain",
                ),
            }
        }
        "/ready" => match not_ready(probes) {
            None => ("200 OK", "ready\n".to_string(), "text/plain"),
            Some(why) => (UNAVAILABLE, format!("{why}\n"), "text/plain"),
        },
        _ => ("404 Not Found", "not found\n".to_string(), "text/plain"),
    }
}

/// The last good beat is at most one interval plus that beat's own round trip old while Redis
/// answers; two intervals means at least one whole beat went unanswered (a beat that hangs on
/// a silent Redis counts too).
fn redis_answers(probes: &Probes) -> bool {
    probes.metrics.healthy(probes.beat_ms * 2)
}

/// Why the worker should not count as ready (a rollout or a load balancer waits for it):
/// stopping (TERM), quiet (TSTP: it takes no new jobs), a lapsed liveness lease (its jobs are
/// being handed back), or Redis unanswered. None when ready.
fn not_ready(probes: &Probes) -> Option<&'static str> {
    let state = probes.shutdown.state();
    if state.stopping {
        Some("stopping")
    } else if state.quiet {
        Some("quiet")
    } else if !probes.liveness.is_live() {
        Some("liveness lease lapsed")
    } else if !redis_answers(probes) {
        Some("redis unreachable")
    } else {
        None
    }
}

//! The Prometheus endpoint on `--metrics-addr`: `/metrics` (the text of [`Metrics::render`])
//! and `/health`, which fails once Redis has been unreachable for longer than a beat, or while
//! the command guardian does not answer (`commands/guardian/watchdog.rs`). A tiny
//! HTTP/1.1 server of its own, bounded in connections and time so no client can grow our
//! memory or hold a task. Touches no Redis keys.

use crate::metrics::prometheus::Metrics;
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

/// Serve `/metrics` and `/health` on `addr` until the process ends.
pub async fn serve(
    addr: std::net::SocketAddr,
    metrics: Arc<Metrics>,
    beat_ms: i64,
) -> std::io::Result<()> {
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
            let metrics = metrics.clone();
            tokio::spawn(async move {
                let _permit = permit;
                answer(sock, &metrics, beat_ms).await;
            });
        }
    });
    Ok(())
}

/// Read one request head, write one answer, close.
async fn answer(mut sock: TcpStream, metrics: &Metrics, beat_ms: i64) {
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
    let (status, body, ctype) = route(path, metrics, beat_ms);
    let resp = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    // A client that does not read its answer is dropped too.
    let _ = tokio::time::timeout(IO_TIMEOUT, sock.write_all(resp.as_bytes())).await;
}

/// Status line, body and content type for `path`.
fn route(path: &str, metrics: &Metrics, beat_ms: i64) -> (&'static str, String, &'static str) {
    match path {
        "/metrics" => ("200 OK", metrics.render(), "text/plain; version=0.0.4"),
        "/health" if GUARDIAN_SILENT.load(Ordering::Relaxed) => (
            "503 Service Unavailable",
            "command guardian not answering: replaced, its commands killed\n".to_string(),
            "text/plain",
        ),
        // The last good beat is at most one interval plus that beat's own round trip old
        // while Redis answers; two intervals means at least one whole beat went unanswered
        // (a beat that hangs on a silent Redis counts too).
        "/health" if metrics.healthy(beat_ms * 2) => (
            "200 OK",
            format!("ok\n{}", super::redis_gauges::health_detail(&metrics.redis)),
            "text/plain",
        ),
        "/health" => (
            "503 Service Unavailable",
            format!(
                "redis unreachable\n{}",
                super::redis_gauges::health_detail(&metrics.redis)
            ),
            "text/plain",
        ),
        _ => ("404 Not Found", "not found\n".to_string(), "text/plain"),
    }
}

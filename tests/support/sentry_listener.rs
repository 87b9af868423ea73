//! A Sentry-compatible HTTP listener on loopback: it accepts what the real `sentry` crate
//! sends to `POST /api/<project>/envelope/`, answers 200, and keeps every envelope's items
//! decoded (the envelope header line, then each item's header and payload, by its `length`;
//! a gzip'd body, as sentry-ruby sends a large one, is unzipped first).
//! Point `SENTRY_DSN` at [`SentryListener::dsn`].

use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// (request path, X-Sentry-Auth header, item header, item payload) of every item received.
type Items = Mutex<Vec<(String, String, Value, Value)>>;

pub struct SentryListener {
    port: u16,
    items: Arc<Items>,
    gzipped: Arc<AtomicUsize>,
}

impl SentryListener {
    pub fn start() -> SentryListener {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the Sentry listener");
        let port = listener.local_addr().unwrap().port();
        let items = Arc::new(Mutex::new(Vec::new()));
        let gzipped = Arc::new(AtomicUsize::new(0));
        let (kept, zipped) = (items.clone(), gzipped.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let (kept, zipped) = (kept.clone(), zipped.clone());
                std::thread::spawn(move || serve(conn, &kept, &zipped));
            }
        });
        SentryListener {
            port,
            items,
            gzipped,
        }
    }

    /// How many requests came gzip'd (and were unzipped).
    pub fn gzipped(&self) -> usize {
        self.gzipped.load(Ordering::SeqCst)
    }

    /// A DSN for project 1 with public key `publickey`, plain HTTP to this listener.
    pub fn dsn(&self) -> String {
        format!("http://publickey@127.0.0.1:{}/1", self.port)
    }

    /// The payloads of every `event` item so far.
    pub fn events(&self) -> Vec<Value> {
        self.items
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, _, h, _)| h["type"] == "event")
            .map(|(_, _, _, p)| p.clone())
            .collect()
    }

    /// The event items whose tag `event` is `name`.
    pub fn events_tagged(&self, name: &str) -> Vec<Value> {
        self.events()
            .into_iter()
            .filter(|e| e["tags"]["event"] == name)
            .collect()
    }

    /// (path, X-Sentry-Auth) of every request that carried an item.
    pub fn requests(&self) -> Vec<(String, String)> {
        self.items
            .lock()
            .unwrap()
            .iter()
            .map(|(p, a, _, _)| (p.clone(), a.clone()))
            .collect()
    }
}

/// Requests on one connection (keep-alive) until it closes.
fn serve(conn: TcpStream, kept: &Items, zipped: &AtomicUsize) {
    let mut out = conn.try_clone().unwrap();
    let mut r = BufReader::new(conn);
    loop {
        let mut start = String::new();
        if r.read_line(&mut start).unwrap_or(0) == 0 {
            return;
        }
        let path = start.split_whitespace().nth(1).unwrap_or("").to_string();
        let (mut length, mut auth, mut gzip) = (0usize, String::new(), false);
        loop {
            let mut h = String::new();
            if r.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            let (k, v) = h.split_once(':').unwrap_or((h, ""));
            match k.to_ascii_lowercase().as_str() {
                "content-length" => length = v.trim().parse().unwrap_or(0),
                "x-sentry-auth" => auth = v.trim().to_string(),
                "content-encoding" => gzip = v.trim().eq_ignore_ascii_case("gzip"),
                _ => {}
            }
        }
        let mut body = vec![0u8; length];
        if r.read_exact(&mut body).is_err() {
            return;
        }
        if gzip {
            let mut plain = Vec::new();
            if flate2::read::GzDecoder::new(&body[..])
                .read_to_end(&mut plain)
                .is_err()
            {
                return;
            }
            body = plain;
            zipped.fetch_add(1, Ordering::SeqCst);
        }
        for (header, payload) in envelope_items(&body) {
            kept.lock()
                .unwrap()
                .push((path.clone(), auth.clone(), header, payload));
        }
        let reply =
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}";
        if out.write_all(reply.as_bytes()).is_err() {
            return;
        }
    }
}

/// An envelope's items: after the envelope header line, each item is a header line and a
/// payload of the header's `length` bytes (or up to the next newline without one).
pub fn envelope_items(body: &[u8]) -> Vec<(Value, Value)> {
    let mut items = Vec::new();
    let Some(nl) = body.iter().position(|b| *b == b'\n') else {
        return items;
    };
    let mut rest = &body[nl + 1..];
    while !rest.is_empty() {
        let end = rest.iter().position(|b| *b == b'\n').unwrap_or(rest.len());
        let Ok(header) = serde_json::from_slice::<Value>(&rest[..end]) else {
            break;
        };
        rest = &rest[(end + 1).min(rest.len())..];
        let len = match header["length"].as_u64() {
            Some(n) => n as usize,
            None => rest.iter().position(|b| *b == b'\n').unwrap_or(rest.len()),
        };
        let payload = serde_json::from_slice(&rest[..len.min(rest.len())]).unwrap_or(Value::Null);
        items.push((header, payload));
        rest = &rest[len.min(rest.len())..];
        if rest.first() == Some(&b'\n') {
            rest = &rest[1..];
        }
    }
    items
}

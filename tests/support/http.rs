//! Plain HTTP on loopback: a GET, and a Prometheus scrape of `/metrics` read into samples.

use std::time::Duration;

/// A plain HTTP GET on loopback: (status, body).
pub fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    let status = buf.split_whitespace().nth(1)?.parse().ok()?;
    let body = buf.split_once("\r\n\r\n")?.1.to_string();
    Some((status, body))
}

/// Samples of a Prometheus scrape, keyed by `name{labels}` exactly as written.
pub fn scrape(port: u16) -> std::collections::BTreeMap<String, f64> {
    let (status, body) = http_get(port, "/metrics").expect("scrape /metrics");
    assert_eq!(status, 200);
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (k, v) = l.rsplit_once(' ').unwrap();
            (k.to_string(), v.parse().unwrap())
        })
        .collect()
}

//! OpenTelemetry traces (`src/traces/`) end to end: a real worker exports over OTLP/HTTP to a
//! receiver here on a loopback port, which decodes the protobuf (opentelemetry-proto) and
//! keeps every span. A payload written as the Ruby client middleware writes it (a top-level
//! `traceparent`) gives a job span with that trace and parent; a cycle's phase spans nest
//! under the job's; each phase's command saw its phase's span in `TRACEPARENT`; a collector
//! that never answers delays no job, and spans past the export queue are counted as dropped.
mod support;

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{any_value, KeyValue};
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use support::*;

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT: &str = "00f067aa0ba902b7";

/// What the receiver got: every span, with its resource's `service.name`.
#[derive(Default)]
struct Got {
    spans: Vec<(String, Span)>,
    /// Requests read in full (answered or not).
    requests: usize,
}

/// An OTLP/HTTP receiver on a free loopback port: `answer` false holds every request
/// unanswered (a collector that accepts and hangs).
struct Receiver {
    port: u16,
    got: Arc<Mutex<Got>>,
}

impl Receiver {
    fn start(answer: bool) -> Receiver {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let got = Arc::new(Mutex::new(Got::default()));
        let g = got.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let g = g.clone();
                std::thread::spawn(move || serve(conn, &g, answer));
            }
        });
        Receiver { port, got }
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn spans(&self) -> Vec<(String, Span)> {
        self.got.lock().unwrap().spans.clone()
    }

    fn requests(&self) -> usize {
        self.got.lock().unwrap().requests
    }
}

/// One connection's requests (keep-alive), each decoded; answered 200 when `answer`.
fn serve(conn: TcpStream, got: &Mutex<Got>, answer: bool) {
    let mut out = conn.try_clone().unwrap();
    let mut r = BufReader::new(conn);
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        assert!(
            line.starts_with("POST /v1/traces "),
            "request line {line:?}"
        );
        let mut len = 0;
        loop {
            let mut h = String::new();
            r.read_line(&mut h).unwrap();
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            let (k, v) = h.split_once(':').unwrap();
            match k.to_ascii_lowercase().as_str() {
                "content-length" => len = v.trim().parse().unwrap(),
                "content-type" => assert_eq!(v.trim(), "application/x-protobuf"),
                "content-encoding" => panic!("compressed body: {v}"),
                _ => {}
            }
        }
        let mut body = vec![0; len];
        r.read_exact(&mut body).unwrap();
        let req = ExportTraceServiceRequest::decode(&body[..]).expect("OTLP protobuf");
        {
            let mut g = got.lock().unwrap();
            g.requests += 1;
            for rs in req.resource_spans {
                let attrs = rs.resource.map(|r| r.attributes).unwrap_or_default();
                let service = text(&attrs, "service.name").unwrap_or_default();
                for ss in rs.scope_spans {
                    g.spans
                        .extend(ss.spans.into_iter().map(|s| (service.clone(), s)));
                }
            }
        }
        if !answer {
            // Hold the connection, never answer: the exporter waits for its own timeout.
            std::thread::sleep(Duration::from_secs(600));
            return;
        }
        let reply =
            "HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n";
        if out.write_all(reply.as_bytes()).is_err() {
            return;
        }
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn value(attrs: &[KeyValue], key: &str) -> Option<any_value::Value> {
    attrs
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.clone()?.value)
}

fn text(attrs: &[KeyValue], key: &str) -> Option<String> {
    match value(attrs, key)? {
        any_value::Value::StringValue(s) => Some(s),
        _ => None,
    }
}

fn int(attrs: &[KeyValue], key: &str) -> Option<i64> {
    match value(attrs, key)? {
        any_value::Value::IntValue(n) => Some(n),
        _ => None,
    }
}

/// The span named `name` in trace `trace`, waited for.
fn span_named(rx: &Receiver, trace: &str, name: &str) -> Span {
    let mut found = None;
    wait_until(
        &format!("span {name:?} of trace {trace}"),
        Duration::from_secs(30),
        || {
            found = rx
                .spans()
                .into_iter()
                .map(|(_, s)| s)
                .find(|s| hex(&s.trace_id) == trace && s.name == name);
            found.is_some()
        },
    );
    found.unwrap()
}

/// The cycle `Traced` (two phases, each writing its PLAYGUARD_PHASE and TRACEPARENT to
/// `seen`), the command job `Fails` (exit 1, no retry) and `Quick` (exit 0).
fn project() -> Project {
    let p = Project::new();
    p.script(
        "jobs/bin/tp",
        "#!/bin/sh\necho \"$PLAYGUARD_PHASE $TRACEPARENT\" >> seen\n",
    );
    p.script("jobs/bin/fail", "#!/bin/sh\necho broken >&2\nexit 1\n");
    p.script("jobs/bin/quick", "#!/bin/sh\nexit 0\n");
    p.write(
        "jobs/app.toml",
        r#"
[[job]]
class = "Traced"
lock = { key = "traced:{args.0}", ttl_secs = 30 }
[[job.phase]]
name = "first"
run = ["jobs/bin/tp"]
[[job.phase]]
name = "second"
run = ["jobs/bin/tp"]

[[job]]
class = "Fails"
run = ["jobs/bin/fail"]

[[job]]
class = "Quick"
run = ["jobs/bin/quick"]
"#,
    );
    p
}

fn payload(class: &str, jid: &str, extra: &str) -> String {
    format!(
        r#"{{"retry":false,"queue":"default","class":"{class}","args":["m1"],"jid":"{jid}","created_at":1700000000.0,"enqueued_at":1700000000.0{extra}}}"#
    )
}

#[test]
fn a_payload_traceparent_parents_the_job_span_its_phases_and_their_commands() {
    let redis = RedisServer::start();
    let rx = Receiver::start(true);
    let p = project();
    let w = Worker::builder(&redis)
        .jobs(p.path())
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", rx.endpoint())
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .env("RUST_LOG", "info,playguard=debug")
        .start();
    w.wait_for_line("playguard starting", Duration::from_secs(10));
    let tp = format!(r#","traceparent":"00-{TRACE}-{PARENT}-01""#);
    push_to_default(&redis, payload("Traced", "aaaaaaaaaaaaaaaaaaaaaaaa", &tp));

    let job = span_named(&rx, TRACE, "default process");
    assert_eq!(
        hex(&job.parent_span_id),
        PARENT,
        "child of the payload's traceparent"
    );
    assert_eq!(job.kind, 5, "a consumer span");
    let a = &job.attributes;
    assert_eq!(text(a, "messaging.system").as_deref(), Some("sidekiq"));
    assert_eq!(
        text(a, "messaging.message_id").as_deref(),
        Some("aaaaaaaaaaaaaaaaaaaaaaaa")
    );
    assert_eq!(
        text(a, "messaging.destination.name").as_deref(),
        Some("default")
    );
    assert_eq!(
        text(a, "messaging.sidekiq.job_class").as_deref(),
        Some("Traced")
    );
    let events: Vec<&str> = job.events.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(
        events,
        ["lock acquired", "lock renewed", "lock released"],
        "{events:?}"
    );
    let fence = int(&job.events[0].attributes, "playguard.lock.fence").expect("a fence");
    assert!(fence > 0);
    for e in &job.events {
        assert_eq!(
            int(&e.attributes, "playguard.lock.fence"),
            Some(fence),
            "{}",
            e.name
        );
    }

    let mut seen_ids = Vec::new();
    for phase in ["first", "second"] {
        let s = span_named(&rx, TRACE, &format!("phase {phase}"));
        assert_eq!(
            s.parent_span_id, job.span_id,
            "phase {phase} under the job's span"
        );
        assert_eq!(int(&s.attributes, "playguard.lock.fence"), Some(fence));
        seen_ids.push(format!("{phase} 00-{TRACE}-{}-01", hex(&s.span_id)));
    }
    assert_eq!(
        p.lines("seen"),
        seen_ids,
        "each command saw its phase's span"
    );
    let service: Vec<String> = rx.spans().into_iter().map(|(s, _)| s).collect();
    assert!(service.iter().all(|s| s == "playguard"), "{service:?}");

    // A failure is the span's error; a malformed traceparent leaves a root span, and a debug line.
    push_to_default(
        &redis,
        payload(
            "Fails",
            "bbbbbbbbbbbbbbbbbbbbbbbb",
            r#","traceparent":"00-zz-01""#,
        ),
    );
    let mut failed = None;
    wait_until("the failed job's span", Duration::from_secs(30), || {
        failed = rx.spans().into_iter().map(|(_, s)| s).find(|s| {
            text(&s.attributes, "messaging.message_id").as_deref()
                == Some("bbbbbbbbbbbbbbbbbbbbbbbb")
        });
        failed.is_some()
    });
    let failed = failed.unwrap();
    assert!(failed.parent_span_id.is_empty(), "a root span");
    assert_ne!(hex(&failed.trace_id), TRACE);
    assert_eq!(
        failed.status.as_ref().map(|s| s.code),
        Some(2),
        "status error"
    );
    assert!(failed.events.iter().any(|e| e.name == "exception"));
    w.wait_for_line("malformed traceparent", Duration::from_secs(10));
}

#[test]
fn a_collector_that_never_answers_delays_no_job_and_drops_are_counted() {
    let redis = RedisServer::start();
    let rx = Receiver::start(false);
    let p = project();
    let metrics = free_port();
    let w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["--metrics-addr", &format!("127.0.0.1:{metrics}")])
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", rx.endpoint())
        .env("OTEL_BSP_SCHEDULE_DELAY", "50")
        .env("OTEL_BSP_MAX_QUEUE_SIZE", "2")
        .env("OTEL_EXPORTER_OTLP_TIMEOUT", "120000")
        .start();
    w.wait_for_line("playguard starting", Duration::from_secs(10));
    let batch = |from: usize| -> Vec<String> {
        (from..from + 10)
            .map(|i| payload("Quick", &format!("{i:024}"), ""))
            .collect()
    };
    push_to_default(&redis, batch(0));
    wait_until(
        "an export the collector holds",
        Duration::from_secs(30),
        || rx.requests() >= 1,
    );
    // The exporter now waits on a request that is never answered (120 s); jobs go on.
    push_to_default(&redis, batch(10));
    wait_until("all 20 jobs done", Duration::from_secs(30), || {
        w.count_lines("done elapsed_ms") >= 20 && redis.llen("queue:default") == 0
    });
    assert_eq!(rx.requests(), 1, "the first export is still held");
    let dropped = scrape(metrics)
        .get("playguard_trace_spans_dropped_total")
        .copied();
    assert!(dropped.is_some_and(|d| d >= 10.0), "dropped: {dropped:?}");
}

#[test]
fn playguard_enqueue_pushes_under_a_publish_span_that_the_job_span_follows() {
    let redis = RedisServer::start();
    let rx = Receiver::start(true);
    let out = std::process::Command::new(bin())
        .args(["enqueue", "-r", &redis.url(), "Quick", "--queue", "default"])
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", rx.endpoint())
        .output()
        .unwrap();
    assert_success(&out);
    let queued = redis.lrange("queue:default");
    let job: serde_json::Value = serde_json::from_str(&queued[0]).unwrap();
    let tp = job["traceparent"]
        .as_str()
        .expect("a traceparent")
        .to_string();
    let parts: Vec<&str> = tp.split('-').collect();
    assert_eq!((parts.len(), parts[0], parts[3]), (4, "00", "01"), "{tp}");
    // Sent at the command's exit (the flush at stop), so already here.
    let publish = span_named(&rx, parts[1], "default publish");
    assert_eq!(hex(&publish.span_id), parts[2]);
    assert_eq!(publish.kind, 4, "a producer span");

    let p = project();
    let _w = Worker::builder(&redis)
        .jobs(p.path())
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", rx.endpoint())
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .start();
    let process = span_named(&rx, parts[1], "default process");
    assert_eq!(process.parent_span_id, publish.span_id);
}

#[test]
fn a_collector_that_is_down_delays_no_job_and_its_failures_are_counted_and_said_once() {
    let redis = RedisServer::start();
    let p = project();
    let (dead, metrics) = (free_port(), free_port());
    let w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["--metrics-addr", &format!("127.0.0.1:{metrics}")])
        .env(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            format!("http://127.0.0.1:{dead}"),
        )
        .env("OTEL_BSP_SCHEDULE_DELAY", "50")
        .start();
    w.wait_for_line("playguard starting", Duration::from_secs(10));
    push_to_default(&redis, payload("Quick", "cccccccccccccccccccccccc", ""));
    w.wait_for_line("done elapsed_ms", Duration::from_secs(30));
    w.wait_for_line("traces: export failed", Duration::from_secs(30));
    push_to_default(&redis, payload("Quick", "dddddddddddddddddddddddd", ""));
    let failed = || {
        scrape(metrics)
            .get("playguard_trace_exports_failed_total")
            .copied()
            .unwrap_or(0.0)
    };
    wait_until("a second failed export", Duration::from_secs(30), || {
        failed() >= 2.0
    });
    wait_until("both jobs done", Duration::from_secs(30), || {
        w.count_lines("done elapsed_ms") == 2
    });
    assert_eq!(w.count_lines("traces: export failed"), 1, "said once");
}

#[test]
fn a_periodic_tick_pushes_its_jobs_under_one_publish_span() {
    let redis = RedisServer::start();
    let rx = Receiver::start(true);
    let _: () = redis::cmd("SADD")
        .arg(MARQUEE_SET)
        .arg("m1")
        .arg("m2")
        .query(&mut redis.conn())
        .unwrap();
    let p = dispatch_project(1, "");
    let _w = Worker::builder(&redis)
        .jobs(p.path())
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", rx.endpoint())
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .start();
    wait_until("a tick's two jobs", Duration::from_secs(30), || {
        redis.llen("queue:marquees") >= 2
    });
    let queued = redis.lrange("queue:marquees");
    let tps: Vec<String> = queued[queued.len() - 2..]
        .iter()
        .map(|j| {
            let v: serde_json::Value = serde_json::from_str(j).unwrap();
            v["traceparent"]
                .as_str()
                .expect("a traceparent")
                .to_string()
        })
        .collect();
    assert_eq!(tps[0], tps[1], "one tick, one span: {tps:?}");
    let parts: Vec<&str> = tps[0].split('-').collect();
    let publish = span_named(&rx, parts[1], "marquees publish");
    assert_eq!(hex(&publish.span_id), parts[2]);
    assert_eq!(publish.kind, 4, "a producer span");
}

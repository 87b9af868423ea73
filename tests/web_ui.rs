//! playguard as Sidekiq's own API and Web UI (ruby-sidekiq 6.4.1) see it: ProcessSet, Workers,
//! Stats, remote quiet/stop, expiry after SIGKILL, and the real Sidekiq::Web rack app rendering
//! /busy, /retries/<key> and /morgue for playguard's process and failures, and the Playguard
//! tab (ruby/playguard/web.rb) with a cycle running (headless Chromium screenshots kept under
//! target/test-artifacts/). Each test owns its redis-server (and PostgreSQL cluster).
mod support;

use serde_json::Value;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use support::*;

const FAIL: &str = "#!/bin/sh\necho \"it broke: $PLAYGUARD_ARGS\" >&2\nexit 1\n";

fn project() -> Project {
    Project::with_jobs(&[
        ("BlockJob", "block", BLOCK_UNTIL_RELEASE),
        ("RecordJob", "record", RECORD_JID),
        ("FailJob", "fail", FAIL),
    ])
}

fn json(s: &str) -> Value {
    serde_json::from_str(s.trim()).unwrap_or_else(|e| panic!("bad JSON from ruby ({e}): {s}"))
}

/// What `Sidekiq::ProcessSet` reports, one object per process (after its cleanup ran).
fn process_set(redis: &RedisServer) -> Vec<Value> {
    json(&ruby(
        redis,
        r#"
out = Sidekiq::ProcessSet.new.map do |p|
  {identity: p.identity, hostname: p["hostname"], pid: p["pid"], tag: p["tag"],
   concurrency: p["concurrency"], queues: p["queues"], busy: p["busy"], quiet: p["quiet"],
   labels: p["labels"], beat: p["beat"]}
end
puts JSON.generate(out)
"#,
    ))
    .as_array()
    .unwrap()
    .clone()
}

/// `Sidekiq::Workers` entries plus the two busy counters the UI shows.
fn workers(redis: &RedisServer) -> Value {
    json(&ruby(
        redis,
        r#"
ws = Sidekiq::Workers.new
list = ws.map do |process, tid, work|
  {process: process, tid: tid, queue: work["queue"], run_at: work["run_at"],
   jid: work["payload"]["jid"], class: work["payload"]["class"]}
end
puts JSON.generate({list: list, size: ws.size, workers_size: Sidekiq::Stats.new.workers_size})
"#,
    ))
}

fn push(redis: &RedisServer, class: &str, retry: &str) -> String {
    ruby(
        redis,
        &format!(
            "puts Sidekiq::Client.push('class' => '{class}', 'args' => ['web', 1], 'retry' => {retry})"
        ),
    )
    .trim()
    .to_string()
}

fn wait_for_one_process(redis: &RedisServer) -> Value {
    wait_until(
        "one process in `processes`",
        Duration::from_secs(20),
        || {
            let n: i64 = redis::cmd("SCARD")
                .arg("processes")
                .query(&mut redis.conn())
                .unwrap();
            n == 1
        },
    );
    let ps = process_set(redis);
    assert_eq!(ps.len(), 1, "{ps:?}");
    ps[0].clone()
}

fn wait_for_running(redis: &RedisServer, jid: &str) -> Value {
    let what = format!("Sidekiq::Workers lists {jid}");
    let mut last = Value::Null;
    wait_until(&what, Duration::from_secs(30), || {
        last = workers(redis);
        last["list"]
            .as_array()
            .unwrap()
            .iter()
            .any(|w| w["jid"] == jid)
    });
    last
}

#[test]
fn process_set_workers_and_stats_show_a_playguard_process() {
    if !ruby_available() {
        return;
    }
    let redis = RedisServer::start();
    let p = project();
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args([
            "-c",
            "3",
            "-q",
            "critical,2",
            "-q",
            "default",
            "-g",
            "webtag",
        ])
        .start();
    let proc = wait_for_one_process(&redis);
    assert_eq!(proc["concurrency"], 3, "{proc}");
    assert_eq!(proc["queues"], serde_json::json!(["critical", "default"]));
    assert_eq!(proc["tag"], "webtag");
    assert_eq!(proc["pid"], w.pid());
    assert_eq!(proc["quiet"], "false");
    assert_eq!(proc["busy"], 0);
    // Identity is hostname:pid:nonce, the nonce 12 hex characters as SecureRandom.hex(6).
    let identity = proc["identity"].as_str().unwrap().to_string();
    let prefix = format!("{}:{}:", proc["hostname"].as_str().unwrap(), w.pid());
    let nonce = identity
        .strip_prefix(&prefix)
        .unwrap_or_else(|| panic!("{identity} does not start with {prefix}"));
    assert!(
        nonce.len() == 12 && nonce.chars().all(|c| c.is_ascii_hexdigit()),
        "{identity}"
    );

    let jid = push(&redis, "BlockJob", "true");
    let ws = wait_for_running(&redis, &jid);
    let list = ws["list"].as_array().unwrap();
    assert_eq!(list.len(), 1, "{ws}");
    assert_eq!(list[0]["process"], identity.as_str());
    assert_eq!(list[0]["queue"], "default");
    assert_eq!(list[0]["class"], "BlockJob");
    assert!(
        list[0]["run_at"].is_i64(),
        "run_at is integer seconds: {ws}"
    );
    assert_eq!(ws["size"], 1, "Workers#size (sum of busy) agrees: {ws}");
    assert_eq!(ws["workers_size"], 1, "Stats#workers_size agrees: {ws}");
    assert_eq!(process_set(&redis)[0]["busy"], 1);
    // Both work keys carry the same entries, the payload as the original JSON string.
    let mut c = redis.conn();
    let old: std::collections::HashMap<String, String> = redis::cmd("HGETALL")
        .arg(format!("{identity}:workers"))
        .query(&mut c)
        .unwrap();
    let new: std::collections::HashMap<String, String> = redis::cmd("HGETALL")
        .arg(format!("{identity}:work"))
        .query(&mut c)
        .unwrap();
    assert_eq!(old, new);
    let entry = json(old.values().next().unwrap());
    let payload = json(entry["payload"].as_str().expect("payload is a string"));
    assert_eq!(payload["jid"], jid.as_str());

    p.write("release", "");
    wait_until(
        "the job finished and the beat flushed processed=1",
        Duration::from_secs(30),
        || {
            let ws = workers(&redis);
            ws["size"] == 0
                && ws["list"].as_array().unwrap().is_empty()
                && ruby(&redis, "puts Sidekiq::Stats.new.processed").trim() == "1"
        },
    );

    w.stop(Duration::from_secs(30));
    // Gone at once after a clean stop: no cleanup or TTL needed.
    assert_eq!(
        ruby(&redis, "puts Sidekiq::ProcessSet.new.size").trim(),
        "0"
    );
    assert!(process_set(&redis).is_empty());
    let exists: i64 = redis::cmd("EXISTS")
        .arg(format!("{identity}:workers"))
        .arg(format!("{identity}:work"))
        .query(&mut c)
        .unwrap();
    assert_eq!(exists, 0, "work keys removed at exit");
}

#[test]
fn quiet_and_stop_from_the_ruby_api() {
    if !ruby_available() {
        return;
    }
    let redis = RedisServer::start();
    let p = project();
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-c", "2"])
        .start();
    let identity = wait_for_one_process(&redis)["identity"]
        .as_str()
        .unwrap()
        .to_string();

    ruby(&redis, "Sidekiq::ProcessSet.new.each(&:quiet!)");
    wait_until(
        "ProcessSet shows quiet=true after a remote TSTP",
        Duration::from_secs(20),
        || process_set(&redis).first().map(|p| p["quiet"] == "true") == Some(true),
    );
    // Quiet: a job pushed now stays queued through two further beats.
    let jid = push(&redis, "RecordJob", "true");
    let beat = |c: &mut redis::Connection| -> f64 {
        redis::cmd("HGET")
            .arg(&identity)
            .arg("beat")
            .query::<String>(c)
            .unwrap()
            .parse()
            .unwrap()
    };
    let mut c = redis.conn();
    for _ in 0..2 {
        let b0 = beat(&mut c);
        wait_until("the next beat", Duration::from_secs(20), || {
            beat(&mut redis.conn()) > b0
        });
    }
    let queued: Vec<String> = redis::cmd("LRANGE")
        .arg("queue:default")
        .arg(0)
        .arg(-1)
        .query(&mut c)
        .unwrap();
    assert_eq!(queued.len(), 1, "a quiet process fetched: {queued:?}");
    assert!(queued[0].contains(&jid));

    ruby(&redis, "Sidekiq::ProcessSet.new.each(&:stop!)");
    assert_eq!(
        w.wait_exit(Duration::from_secs(40)),
        Some(0),
        "remote TERM is a clean exit"
    );
    assert!(w.saw("remote TERM"), "{}", w.output());
    assert_eq!(
        ruby(&redis, "puts Sidekiq::ProcessSet.new.size").trim(),
        "0"
    );
    let n: i64 = redis::cmd("LLEN")
        .arg("queue:default")
        .query(&mut c)
        .unwrap();
    assert_eq!(n, 1, "the queued job is still there for the next worker");
}

/// Takes about a minute: the identity hash's 60 s TTL has to run out, as with Ruby Sidekiq.
#[test]
fn sigkilled_process_leaves_process_set_once_its_hash_expires() {
    if !ruby_available() {
        return;
    }
    let redis = RedisServer::start();
    let p = project();
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-c", "1", "--fetch", "basic"])
        .start();
    let identity = wait_for_one_process(&redis)["identity"]
        .as_str()
        .unwrap()
        .to_string();
    w.kill9();
    // Still listed right after the kill: nothing cleaned up for it.
    assert_eq!(
        ruby(&redis, "puts Sidekiq::ProcessSet.new.size").trim(),
        "1"
    );
    let ttl: i64 = redis::cmd("TTL")
        .arg(&identity)
        .query(&mut redis.conn())
        .unwrap();
    assert!(ttl > 0 && ttl <= 60, "identity hash TTL {ttl}");
    // Wait cheaply on the hash itself, then let ProcessSet's own cleanup drop the member.
    wait_until(
        "the identity hash expired (TTL 60 s)",
        Duration::from_secs(90),
        || {
            let n: i64 = redis::cmd("EXISTS")
                .arg(&identity)
                .query(&mut redis.conn())
                .unwrap();
            n == 0
        },
    );
    assert!(process_set(&redis).is_empty());
    assert_eq!(
        ruby(&redis, "puts Sidekiq::ProcessSet.new.size").trim(),
        "0",
        "ProcessSet's cleanup removed the dead member"
    );
}

/// Whether the rack pieces for serving Sidekiq::Web are installed (ruby-rack, ruby-webrick).
fn web_available() -> bool {
    ruby_can(
        "require 'sidekiq/web'; require 'rack/session/cookie'; require 'rack/handler/webrick'",
        "ruby-sidekiq ruby-rack ruby-webrick",
    )
}

/// One HTTP/1.0 exchange; (status, head, body), or None when nothing answers yet.
fn request(port: u16, req: &str) -> Option<(u16, String, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(req.as_bytes()).ok()?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).ok()?;
    let text = String::from_utf8_lossy(&buf).to_string();
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    Some((status, head.to_string(), body.to_string()))
}

/// One GET; (status, body), or None when nothing answers yet.
fn get(port: u16, path: &str) -> Option<(u16, String)> {
    request(
        port,
        &format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\r\n"),
    )
    .map(|(st, _, body)| (st, body))
}

/// application/x-www-form-urlencoded, enough for tokens and identities.
fn form_escape(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Press a process's Quiet or Stop button on /busy as a browser would: GET the page for the
/// session cookie and CSRF token (6.4.1's csrf_protection.rb), then POST the form.
fn press_busy_button(port: u16, identity: &str, button: &str) {
    let (status, head, body) = request(
        port,
        &format!("GET /busy HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\r\n"),
    )
    .expect("GET /busy");
    assert_eq!(status, 200);
    let cookie = head
        .lines()
        .find_map(|l| {
            l.strip_prefix("Set-Cookie: ")
                .or_else(|| l.strip_prefix("set-cookie: "))
        })
        .and_then(|c| c.split(';').next())
        .unwrap_or_else(|| panic!("no session cookie:\n{head}"))
        .to_string();
    let token = body
        .split("name='authenticity_token' value='")
        .nth(1)
        .and_then(|r| r.split('\'').next())
        .unwrap_or_else(|| panic!("no authenticity_token on /busy:\n{body}"));
    let form = format!(
        "authenticity_token={}&identity={}&{button}=1",
        form_escape(token),
        form_escape(identity)
    );
    let (status, head, body) = request(
        port,
        &format!(
            "POST /busy HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\nCookie: {cookie}\r\n\
             Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n\r\n{form}",
            form.len()
        ),
    )
    .expect("POST /busy");
    assert_eq!(status, 302, "POST /busy {button}:\n{head}\n{body}");
}

/// The real Sidekiq::Web on a loopback port, stopped by its PID on drop.
struct WebServer {
    port: u16,
    child: Child,
}

impl WebServer {
    fn start(redis: &RedisServer) -> WebServer {
        WebServer::start_with(redis, &[])
    }

    /// With extra environment (PLAYGUARD_TAB=1 loads the Playguard tab; DATABASE_URL its ledger).
    fn start_with(redis: &RedisServer, env: &[(&str, &str)]) -> WebServer {
        let port = free_port();
        let child = Command::new("ruby")
            .arg(project_dir().join("tests/web/serve.rb"))
            .env("PORT", port.to_string())
            .env("REDIS_URL", redis.url())
            .env_remove("DATABASE_URL")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn ruby tests/web/serve.rb");
        let mut web = WebServer { port, child };
        wait_until("Sidekiq::Web answers", Duration::from_secs(30), || {
            if let Ok(Some(st)) = web.child.try_wait() {
                panic!("tests/web/serve.rb exited early: {st}");
            }
            get(port, "/").is_some()
        });
        web
    }

    /// GET a page and insist on 200 and that it names every needle.
    fn page(&self, path: &str, needles: &[&str]) -> String {
        let (status, body) = get(self.port, path).unwrap_or_else(|| panic!("GET {path}"));
        assert_eq!(status, 200, "GET {path}:\n{body}");
        for n in needles {
            assert!(body.contains(n), "GET {path} lacks {n:?}:\n{body}");
        }
        body
    }
}

impl Drop for WebServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn artifacts_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| project_dir().join("target"));
    let d = target.join("test-artifacts");
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn chromium() -> Option<&'static str> {
    ["chromium", "chromium-browser"].into_iter().find(|b| {
        Command::new(b)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    })
}

/// Headless Chromium screenshot of a page; false (with a message) when chromium is absent.
fn screenshot(url: &str, file: &std::path::Path) -> bool {
    let Some(bin) = chromium() else {
        eprintln!("skipping the screenshot: chromium is not installed (apt-get install chromium)");
        return false;
    };
    let profile = tempfile::tempdir().unwrap();
    let _ = std::fs::remove_file(file);
    let mut child = Command::new(bin)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg(format!("--screenshot={}", file.display()))
        .arg("--window-size=1280,900")
        .arg(url)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn chromium");
    let mut status = None;
    let waited = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        wait_until(
            "chromium wrote the screenshot",
            Duration::from_secs(120),
            || {
                status = child.try_wait().unwrap();
                status.is_some()
            },
        )
    }));
    if waited.is_err() {
        let _ = child.kill();
        let _ = child.wait();
        panic!("chromium did not finish the screenshot of {url}");
    }
    let size = std::fs::metadata(file).map(|m| m.len()).unwrap_or(0);
    assert!(
        size > 0,
        "chromium ({status:?}) wrote no screenshot to {}",
        file.display()
    );
    eprintln!("screenshot of {url}: {} ({size} bytes)", file.display());
    true
}

#[test]
fn sidekiq_web_renders_busy_retries_and_morgue() {
    if !web_available() {
        return;
    }
    let redis = RedisServer::start();
    let p = project();
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-c", "2", "-g", "webui-tag"])
        .start();
    let proc = wait_for_one_process(&redis);
    let retried = push(&redis, "FailJob", "3");
    let dead = push(&redis, "FailJob", "0");
    wait_until(
        "one retry and one dead entry",
        Duration::from_secs(30),
        || {
            ruby(
                &redis,
                "puts [Sidekiq::RetrySet.new.size, Sidekiq::DeadSet.new.size].join(',')",
            )
            .trim()
                == "1,1"
        },
    );
    let running = push(&redis, "BlockJob", "true");
    wait_for_running(&redis, &running);
    // The UI's own names for the entries: "<score>-<jid>" (helpers.rb job_params).
    let keys = ruby(
        &redis,
        "r = Sidekiq::RetrySet.new.first; d = Sidekiq::DeadSet.new.first\n\
         puts \"#{r.score}-#{r.jid}\"; puts \"#{d.score}-#{d.jid}\"",
    );
    let mut keys = keys.lines().map(str::to_string);
    let (retry_key, dead_key) = (keys.next().unwrap(), keys.next().unwrap());
    assert!(retry_key.ends_with(&retried) && dead_key.ends_with(&dead));

    let web = WebServer::start(&redis);
    let host_pid = format!("{}:{}", proc["hostname"].as_str().unwrap(), w.pid());
    web.page("/", &["Dashboard"]);
    web.page(
        "/busy",
        &[&host_pid, "webui-tag", &running, "BlockJob", "default"],
    );
    web.page("/retries", &[&retried, "FailJob"]);
    web.page(
        &format!("/retries/{retry_key}"),
        &[&retried, "FailJob", "it broke"],
    );
    web.page("/morgue", &[&dead, "FailJob"]);
    web.page(
        &format!("/morgue/{dead_key}"),
        &[&dead, "FailJob", "it broke"],
    );
    web.page("/queues", &[]);

    let shot = artifacts_dir().join("web_ui_busy.png");
    screenshot(&format!("http://127.0.0.1:{}/busy", web.port), &shot);

    // The Busy page's own buttons: Quiet, then Stop (remote TSTP/TERM read at the next beat).
    p.write("release", "");
    let identity = proc["identity"].as_str().unwrap();
    press_busy_button(web.port, identity, "quiet");
    wait_until(
        "quiet=true after the Busy page's Quiet button",
        Duration::from_secs(20),
        || process_set(&redis).first().map(|p| p["quiet"] == "true") == Some(true),
    );
    press_busy_button(web.port, identity, "stop");
    assert_eq!(
        w.wait_exit(Duration::from_secs(40)),
        Some(0),
        "Stop button: clean exit"
    );
    let body = web.page("/busy", &[]);
    assert!(!body.contains(&host_pid), "stopped process still on /busy");
}

/// The Playguard tab (ruby/playguard/web.rb, required next to sidekiq/web as a Rails app does)
/// in the real Sidekiq::Web 6.4.1, against a real worker whose database-fenced cycle waits in
/// its `apply` phase: the lock with its holder, phase, lease bar and PostgreSQL fence, the
/// ledger's finished cycle, the page's refresh; without a database URL, the running cycle from
/// Redis and a note saying so; a key retaken behind its back, stale; after the cycle ends (lock
/// lost), no lock and a lock_lost row. Screenshot: playguard_tab.png.
#[test]
fn playguard_tab_shows_the_running_cycle_and_the_ledger() {
    if !web_available() || !ruby_can("require 'pg'", "ruby-pg") {
        return;
    }
    let redis = RedisServer::start();
    let pg = PostgresServer::start();
    let p = Project::go_gated_cycle("lock:marquee:");
    let db = pg.url();
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-c", "2", "-t", "5"])
        .env("DATABASE_URL", &db)
        .start();
    let proc = wait_for_one_process(&redis);
    let identity = proc["identity"].as_str().unwrap().to_string();
    let host = proc["hostname"].as_str().unwrap().to_string();
    let outcomes = |key: &str| {
        pg.psql(&format!(
        "SELECT string_agg(outcome, ',' ORDER BY id) FROM playguard_cycles WHERE lock_key = '{key}'"
    ))
    };
    // One finished cycle in the ledger, then one left running in `apply`.
    p.go("3");
    enqueue(&redis, &["MarqueeCycle", "3"]);
    wait_until("Marquee 3 complete", Duration::from_secs(30), || {
        outcomes("lock:marquee:3") == "complete"
    });
    let jid = enqueue(&redis, &["MarqueeCycle", "7"]);
    wait_until(
        "Marquee 7 in its slow phase",
        Duration::from_secs(30),
        || p.path().join("7.started").exists(),
    );
    let fence = pg.psql("SELECT fence FROM playguard_fences WHERE lock_key = 'lock:marquee:7'");
    let cycle_id = pg.psql("SELECT id FROM playguard_cycles WHERE lock_key = 'lock:marquee:7'");

    let web = WebServer::start_with(&redis, &[("PLAYGUARD_TAB", "1"), ("DATABASE_URL", &db)]);
    // The phase reaches the work hash at the worker's next heartbeat.
    let mut body = String::new();
    wait_until(
        "the tab shows the apply phase",
        Duration::from_secs(30),
        || {
            body = web.page("/playguard", &[]);
            body.contains("<td>apply</td>")
        },
    );
    for needle in [
        "lock:marquee:7",
        "Marquee 7",
        &identity,
        &host,
        &jid,
        "MarqueeCycle",
        &fence,
        &format!("ledger (cycle {cycle_id})"),
        "class=\"pg-lease\"",
        "lock:marquee:3",
        ">complete</span>",
        ">running</span>",
        // Refreshes like the Busy page: its Live Poll button, and a reload every 5 s.
        "live-poll",
        "<meta http-equiv=\"refresh\" content=\"5\">",
        // The tab in Sidekiq's nav bar.
        "href=\"/playguard\"",
    ] {
        assert!(
            body.contains(needle),
            "/playguard lacks {needle:?}:\n{body}"
        );
    }
    assert!(
        !body.contains("pg-note"),
        "the ledger was read, no note: {body}"
    );
    // The running ledger row names the phase its lock is in.
    let running = body
        .split("<tr class=\"pg-cycle\">")
        .find(|r| r.contains(">running</span>"))
        .unwrap_or_else(|| panic!("no running cycle row:\n{body}"));
    assert!(
        running.contains("<td>apply</td>") && running.contains(&jid),
        "{running}"
    );
    // The lock's row: key, holder, phase and the PostgreSQL fence together.
    let row = body
        .split("<tr class=\"pg-lock pg-held\">")
        .nth(1)
        .and_then(|r| r.split("</tr>").next())
        .unwrap_or_else(|| panic!("no held lock row:\n{body}"));
    for needle in [
        "lock:marquee:7",
        identity.as_str(),
        "<td>apply</td>",
        fence.as_str(),
    ] {
        assert!(row.contains(needle), "lock row lacks {needle:?}:\n{row}");
    }
    web.page("/busy", &[&jid, "Playguard"]);
    let shot = artifacts_dir().join("playguard_tab.png");
    screenshot(&format!("http://127.0.0.1:{}/playguard", web.port), &shot);

    // No database URL: the running cycle from Redis, and a note saying why there is no more.
    let plain = WebServer::start_with(&redis, &[("PLAYGUARD_TAB", "1")]);
    let body = plain.page(
        "/playguard",
        &[
            "lock:marquee:7",
            &jid,
            "<td>apply</td>",
            "No database URL",
            ">running</span>",
            "Redis record",
        ],
    );
    assert!(
        !body.contains("lock:marquee:3"),
        "no ledger without a database: {body}"
    );
    drop(plain);

    // Another token in the key (its lease retaken behind the holder's back): a stale row with
    // no lease bar; the holder's renewal after the phase then ends the cycle as lock_lost.
    redis::cmd("SET")
        .arg("lock:marquee:7")
        .arg("another-owner")
        .arg("PX")
        .arg(60_000)
        .query::<()>(&mut redis.conn())
        .unwrap();
    web.page(
        "/playguard",
        &[
            "<tr class=\"pg-lock pg-stale\">",
            "class=\"pg-stale\">stale</span>",
            "(0 held)",
        ],
    );
    p.go("7");
    wait_until("Marquee 7 lock_lost", Duration::from_secs(30), || {
        outcomes("lock:marquee:7") == "lock_lost"
    });
    wait_until("the tab shows no lock", Duration::from_secs(30), || {
        web.page("/playguard", &[]).contains("No locks held.")
    });
    web.page(
        "/playguard",
        &[">lock_lost</span>", "the key now holds another owner"],
    );
    w.stop(Duration::from_secs(30));
}

//! A real Rails 6.1 app (generated offline by Debian's `rails new` into a temp dir) enqueues
//! with ActiveJob's Sidekiq adapter and a stub `Sidekiq::Worker`; playguard runs the jobs under
//! foreman from the app's Procfile, next to `web:`, whose Sidekiq::Web carries the Playguard
//! tab. Every snippet of docs/rails.md (README's "From your Rails app" points there), the
//! tab's routes.rb included, is one of the files or lines written here. Keys: `queue:myapp_playguard`,
//! `queue:playguard`, `schedule`, `processes` of the test's own redis-server.
mod support;

use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use support::*;

const REPORT_JOB: &str = r#"class ReportJob < ApplicationJob
  queue_as :playguard # with queue_name_prefix "myapp", the queue is "myapp_playguard"

  def perform(*args, **opts)
    raise "ReportJob runs in playguard"
  end
end
"#;

const STUB_WORKER: &str = r#"class PlayguardJob
  include Sidekiq::Worker
  sidekiq_options queue: "playguard"

  def perform(*)
    raise "PlayguardJob runs in playguard, never in Ruby"
  end
end
"#;

const APP_CONFIG: &str = r#"    config.active_job.queue_adapter = :sidekiq
    config.active_job.queue_name_prefix = "myapp"
"#;

const ENQUEUE: &str = r#"ReportJob.perform_later(7, mode: "full")
ReportJob.set(wait: 2.seconds).perform_later(7)
PlayguardJob.perform_async(7)
Sidekiq::Client.push("class" => "PlayguardJob", "queue" => "playguard", "args" => [7, "x"])
"#;

const PROCFILE: &str = r#"web: bin/rails server -b 127.0.0.1 -p $PORT
worker: playguard run -j playguard -q myapp_playguard -q playguard
"#;

/// docs/rails.md's "Playguard tab in the Web UI": the tab required next to sidekiq/web.
const ROUTES: &str = r#"require "sidekiq/web"
require "playguard/web" # registers the tab: Sidekiq::Web.register(PlayguardWeb)

Rails.application.routes.draw do
  mount Sidekiq::Web => "/sidekiq"
end
"#;

const SIDEKIQ_YML: &str = r#":concurrency: <%= ENV.fetch("SIDEKIQ_CONCURRENCY", 3) %>
:timeout: 20
:queues:
  - default
  - mailers
"#;

const MANIFEST: &str = r#"[[job]]
class = "ReportJob"      # ActiveJob: dispatched on job_class, the command sees `arguments`
run = ["playguard/bin/report"]

[[job]]
class = "PlayguardJob"   # the stub worker's class name
run = ["playguard/bin/report"]
"#;

/// The command: records what it got (class, jid, PLAYGUARD_ARGS), one line per run.
const RECORD: &str = "#!/bin/sh\nprintf '%s\\t%s\\t%s\\n' \"$PLAYGUARD_CLASS\" \"$PLAYGUARD_JID\" \"$PLAYGUARD_ARGS\" >> tmp/playguard-runs.tsv\n";

/// Around docs/rails.md's lines: collect what each enqueue wrote, and more argument shapes.
const RUNNER_PRELUDE: &str = r#"$sent = {}
# ActiveJob's own serialization of each job's arguments, keyed by the Sidekiq jid.
ActiveJob::Base.after_enqueue { |job| $sent[job.provider_job_id] = ActiveJob::Arguments.serialize(job.arguments) }
class CaptureArgs
  def call(_klass, job, _queue, _pool) = yield.tap { $sent[job["jid"]] ||= job["args"] }
end
Sidekiq.configure_client { |c| c.client_middleware { |chain| chain.add CaptureArgs } }
"#;

const RUNNER_MORE: &str = r#"t = Time.utc(2026, 3, 4, 5, 6, 7.5r)
ReportJob.perform_later({marquee: 7, "name" => "x", nested: {deep: [1, :sym, nil, 2.5]}})
ReportJob.perform_later(t, Date.new(2026, 3, 4), t.in_time_zone("Tokyo"), 10**20)
ReportJob.set(wait: 2.seconds).perform_later("later", at: t, list: [1, "two"])
puts JSON.generate($sent)
"#;

fn rails_available() -> bool {
    ruby_can(
        "require 'rails'; require 'active_job'; require 'sidekiq'; require 'webrick'",
        "ruby-railties ruby-activejob ruby-sidekiq ruby-webrick",
    ) && foreman_available()
}

fn run(cmd: &mut Command, what: &str) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn write(dir: &Path, rel: &str, content: &str) {
    let p = dir.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, content).unwrap();
}

/// `rails new` with everything a job-enqueuing app does not need skipped, offline, then the
/// docs/rails.md's files. Debian ships no activemodel gem, so its railtie is not required.
fn generate_app(root: &Path) -> std::path::PathBuf {
    run(
        Command::new("rails")
            .args([
                "new",
                "myapp",
                "--skip-bundle",
                "--skip-git",
                "--skip-keeps",
            ])
            .args([
                "--skip-active-record",
                "--skip-active-storage",
                "--skip-action-mailer",
            ])
            .args([
                "--skip-action-mailbox",
                "--skip-action-text",
                "--skip-action-cable",
            ])
            .args(["--skip-sprockets", "--skip-javascript", "--skip-turbolinks"])
            .args(["--skip-webpack-install", "--skip-spring", "--skip-listen"])
            .args([
                "--skip-bootsnap",
                "--skip-jbuilder",
                "--skip-test",
                "--skip-system-test",
            ])
            .args(["--skip-puma"])
            .current_dir(root),
        "rails new",
    );
    let app = root.join("myapp");
    // Only gems Debian installs, so bundler resolves offline.
    write(
        &app,
        "Gemfile",
        "source 'https://rubygems.org'\ngem 'railties'\ngem 'activejob'\ngem 'actionpack'\ngem 'sidekiq'\ngem 'webrick'\n",
    );
    let cfg = std::fs::read_to_string(app.join("config/application.rb")).unwrap();
    let cfg = cfg
        .replace(
            "require \"active_model/railtie\"",
            "# require \"active_model/railtie\"",
        )
        .replace(
            "    config.load_defaults 6.1\n",
            &format!("    config.load_defaults 6.1\n{APP_CONFIG}"),
        );
    assert!(
        cfg.contains(APP_CONFIG),
        "config/application.rb changed shape"
    );
    write(&app, "config/application.rb", &cfg);
    write(&app, "app/jobs/report_job.rb", REPORT_JOB);
    write(&app, "app/workers/playguard_job.rb", STUB_WORKER);
    write(&app, "config/sidekiq.yml", SIDEKIQ_YML);
    write(&app, "playguard/jobs.toml", MANIFEST);
    write(&app, "playguard/bin/report", RECORD);
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(
        app.join("playguard/bin/report"),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    write(&app, "Procfile", PROCFILE);
    // docs/rails.md: copy ruby/playguard/ into the app's lib/playguard/, require it in the routes.
    for rel in ["web.rb", "views/playguard.erb"] {
        let src = project_dir().join("ruby/playguard").join(rel);
        write(
            &app,
            &format!("lib/playguard/{rel}"),
            &std::fs::read_to_string(src).unwrap(),
        );
    }
    write(&app, "config/routes.rb", ROUTES);
    write(
        &app,
        "script/enqueue.rb",
        &format!("{RUNNER_PRELUDE}{ENQUEUE}{RUNNER_MORE}"),
    );
    app
}

/// foreman, stopped with TERM (it then stops web and worker) when the test ends either way.
struct Foreman(Child);

impl Drop for Foreman {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            signal(self.0.id() as i32, "TERM");
            let deadline = Instant::now() + Duration::from_secs(40);
            while self.0.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// jid -> the arguments as the payload in Redis carries them (ActiveJob: args[0].arguments).
fn payload_args(raw: &str) -> (String, Value) {
    let v: Value = serde_json::from_str(raw).unwrap();
    let args = if v["class"] == "ActiveJob::QueueAdapters::SidekiqAdapter::JobWrapper" {
        v["args"][0]["arguments"].clone()
    } else {
        v["args"].clone()
    };
    (v["jid"].as_str().unwrap().to_string(), args)
}

/// The status of `GET /` (HTTP/1.0, so WEBrick closes the connection after its reply).
fn web_status(port: u16) -> Option<u16> {
    use std::io::{BufRead, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    s.write_all(b"GET / HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .ok()?;
    let mut line = String::new();
    std::io::BufReader::new(s).read_line(&mut line).ok()?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// GET `path` (HTTP/1.0): (status, body).
fn web_get(port: u16, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    let status = buf.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, buf.split_once("\r\n\r\n")?.1.to_string()))
}

fn runs(app: &Path) -> Vec<(String, String, Value)> {
    std::fs::read_to_string(app.join("tmp/playguard-runs.tsv"))
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let mut it = l.splitn(3, '\t');
            let class = it.next().unwrap().to_string();
            let jid = it.next().unwrap().to_string();
            let args = serde_json::from_str(it.next().unwrap()).expect("PLAYGUARD_ARGS is JSON");
            (class, jid, args)
        })
        .collect()
}

#[test]
fn a_rails_app_enqueues_and_playguard_under_foreman_runs_exactly_what_activejob_wrote() {
    if !rails_available() {
        return;
    }
    let guide = std::fs::read_to_string(project_dir().join("docs/rails.md")).unwrap();
    for (name, snippet) in [
        ("ReportJob", REPORT_JOB),
        ("stub worker", STUB_WORKER),
        ("application.rb lines", APP_CONFIG),
        ("enqueue lines", ENQUEUE),
        ("Procfile", PROCFILE),
        ("sidekiq.yml", SIDEKIQ_YML),
        ("manifest", MANIFEST),
        ("routes.rb with the Playguard tab", ROUTES),
    ] {
        assert!(
            guide.contains(snippet),
            "docs/rails.md must show the {name} this test uses:\n{snippet}"
        );
    }

    let redis = RedisServer::start();
    let root = tempfile::tempdir().unwrap();
    let app = generate_app(root.path());

    let sent = run(
        Command::new("bin/rails")
            .args(["runner", "script/enqueue.rb"])
            .env("REDIS_URL", redis.url())
            .current_dir(&app),
        "bin/rails runner",
    );
    let sent: BTreeMap<String, Value> = serde_json::from_str(sent.lines().last().unwrap()).unwrap();
    assert_eq!(sent.len(), 7, "{sent:?}");

    // What Rails pushed, read before any worker runs.
    let mut c = redis.conn();
    let prefixed: Vec<String> = redis::cmd("LRANGE")
        .arg("queue:myapp_playguard")
        .arg(0)
        .arg(-1)
        .query(&mut c)
        .unwrap();
    let plain: Vec<String> = redis::cmd("LRANGE")
        .arg("queue:playguard")
        .arg(0)
        .arg(-1)
        .query(&mut c)
        .unwrap();
    let scheduled: Vec<String> = redis::cmd("ZRANGE")
        .arg("schedule")
        .arg(0)
        .arg(-1)
        .query(&mut c)
        .unwrap();
    assert_eq!(
        (prefixed.len(), plain.len(), scheduled.len()),
        (3, 2, 2),
        "ActiveJob goes to the prefixed queue, set(wait:) to schedule, the stub worker unprefixed"
    );
    let pushed: BTreeMap<String, Value> = prefixed
        .iter()
        .chain(&plain)
        .chain(&scheduled)
        .map(|raw| payload_args(raw))
        .collect();
    assert_eq!(
        pushed, sent,
        "the payloads carry ActiveJob::Arguments.serialize of each job's arguments"
    );
    let all = serde_json::to_string(&pushed).unwrap();
    for marker in [
        "_aj_ruby2_keywords",
        "_aj_symbol_keys",
        "ActiveJob::Serializers::TimeSerializer",
        "ActiveJob::Serializers::DateSerializer",
        "ActiveJob::Serializers::TimeWithZoneSerializer",
        "ActiveJob::Serializers::SymbolSerializer",
    ] {
        assert!(all.contains(marker), "no {marker} in {all}");
    }

    // foreman finds `playguard` on PATH, as after `cargo install`.
    let bin_dir = Path::new(bin()).parent().unwrap();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let web_port = free_port();
    let log = std::fs::File::create(root.path().join("foreman.log")).unwrap();
    let foreman = Foreman(
        Command::new("foreman")
            .args(["start", "-t", "30", "-p", &web_port.to_string()])
            .env("PATH", path)
            .env("REDIS_URL", redis.url())
            .env("RUST_LOG", "info")
            .current_dir(&app)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("spawn foreman"),
    );
    let log = || std::fs::read_to_string(root.path().join("foreman.log")).unwrap_or_default();

    wait_until("all 7 jobs ran", Duration::from_secs(60), || {
        runs(&app).len() >= 7
    });
    let ran = runs(&app);
    assert_eq!(ran.len(), 7, "each job ran once: {ran:?}");
    for (class, jid, args) in &ran {
        let want = pushed
            .get(jid)
            .unwrap_or_else(|| panic!("{class} ran with unknown jid {jid}"));
        assert_eq!(args, want, "PLAYGUARD_ARGS of {class} {jid}");
        let expected_class = if plain.iter().any(|p| p.contains(jid.as_str())) {
            "PlayguardJob"
        } else {
            "ReportJob"
        };
        assert_eq!(class, expected_class, "{jid}");
    }

    // The worker took its queues from -q and concurrency from the shared sidekiq.yml.
    let ids: Vec<String> = redis::cmd("SMEMBERS")
        .arg("processes")
        .query(&mut c)
        .unwrap();
    assert_eq!(ids.len(), 1, "{ids:?}");
    let info: String = redis::cmd("HGET")
        .arg(&ids[0])
        .arg("info")
        .query(&mut c)
        .unwrap();
    let info: Value = serde_json::from_str(&info).unwrap();
    assert_eq!(
        info["queues"],
        serde_json::json!(["myapp_playguard", "playguard"])
    );
    assert_eq!(info["concurrency"], 3);

    // web: runs beside the worker.
    wait_until("web answers", Duration::from_secs(60), || {
        web_status(web_port) == Some(200)
    });
    // The Playguard tab, mounted as docs/rails.md says, inside the app's own Sidekiq::Web.
    let (status, body) = web_get(web_port, "/sidekiq/playguard").expect("GET /sidekiq/playguard");
    assert_eq!(status, 200, "{body}");
    for needle in [
        "Playguard locks",
        "href=\"/sidekiq/playguard\"",
        "No database URL",
    ] {
        assert!(
            body.contains(needle),
            "/sidekiq/playguard lacks {needle:?}:\n{body}"
        );
    }

    let mut foreman = foreman;
    signal(foreman.0.id() as i32, "TERM");
    let deadline = Instant::now() + Duration::from_secs(40);
    while foreman.0.try_wait().unwrap().is_none() {
        assert!(
            Instant::now() < deadline,
            "foreman did not stop:\n{}",
            log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = log();
    assert!(
        out.contains("timeout_secs=20"),
        "timeout from config/sidekiq.yml:\n{out}"
    );
    assert!(out.contains("bye"), "the worker stopped cleanly:\n{out}");
}

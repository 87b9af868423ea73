//! sidekiq-cron (ruby-sidekiq-cron 1.8.0 on Ruby Sidekiq 6.4.1) and `--sidekiq-cron`: the gem's
//! API writes the schedule, a Ruby Sidekiq process running the gem and two playguard processes
//! fire it together, and every tick is enqueued once, in the gem's payload shape, with the
//! `last_enqueue_time` and jid history the gem's Web UI tab shows. Each test owns its
//! redis-server. Skips without Ruby and the gem unless PLAYGUARD_REQUIRE_RUBY=1.
mod support;

use serde_json::{Map, Value};
use std::collections::HashSet;
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use support::*;

/// The Ruby process: the gem's poller, and a client middleware that notes each jid it pushes
/// (the payload itself unchanged), so the test knows which ticks Ruby fired.
const RUBY_APP: &str = r##"require 'sidekiq'
require 'sidekiq-cron'
class NotePush
  def call(_class, job, _queue, _pool)
    File.open(ENV.fetch('LEDGER'), 'a') { |f| f.puts("#{job['wrapped'] || job['class']} #{job['jid']}") }
    yield
  end
end
Sidekiq.configure_server do |config|
  config.client_middleware { |chain| chain.add NotePush }
end
"##;

/// Shared by all processes, in the gem's keys: one poll a second on average, and a jid
/// history of 5 (not the default 10), which both sides keep.
const SIDEKIQ_YML: &str = ":cron_poll_interval: 1\n:cron_history_size: 5\n";

/// A Ruby Sidekiq process, killed on drop if still running.
struct RubySidekiq(Child);

impl Drop for RubySidekiq {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn gem_available() -> bool {
    ruby_available()
        && ruby_can(
            "require 'sidekiq'; require 'sidekiq-cron'; require 'sidekiq/web'; require 'sidekiq/cron/web'; require 'rack/session/cookie'; require 'rack/mock'",
            "ruby-sidekiq ruby-sidekiq-cron ruby-rack",
        )
}

/// The jids playguard logged for entry `name` (`sidekiq-cron: enqueued cron=<name> jid=…`).
fn pg_jids(workers: &[&Worker], name: &str) -> Vec<String> {
    let entry = format!("cron={name} ");
    workers
        .iter()
        .flat_map(|w| w.lines())
        .filter(|l| l.contains("sidekiq-cron: enqueued") && l.contains(&entry))
        .filter_map(|l| {
            l.split_whitespace()
                .find_map(|t| t.strip_prefix("jid=").map(str::to_string))
        })
        .collect()
}

/// The jids the Ruby process pushed for class `class`.
fn ruby_jids(p: &Project, class: &str) -> Vec<String> {
    p.lines("ruby_pushes.txt")
        .iter()
        .filter_map(|l| l.strip_prefix(&format!("{class} ")).map(str::to_string))
        .collect()
}

fn payloads(redis: &RedisServer, queue: &str) -> Vec<Map<String, Value>> {
    redis
        .lrange(&format!("queue:{queue}"))
        .iter()
        .map(|s| serde_json::from_str(s).unwrap())
        .collect()
}

fn keys(m: &Map<String, Value>) -> Vec<&str> {
    m.keys().map(String::as_str).collect()
}

/// The entry's `:enqueued` members (Ruby's iso8601, as the gem writes them) and scores.
fn ticks(redis: &RedisServer, name: &str) -> Vec<(String, f64)> {
    redis::cmd("ZRANGE")
        .arg(format!("cron_job:{name}:enqueued"))
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query(&mut redis.conn())
        .unwrap()
}

/// One job per tick: as many jobs as ticks taken after the one `save` wrote, each tick in
/// the gem's spelling (Ruby's `Time#iso8601` in UTC, so a Ruby and a playguard spelling of one
/// tick cannot both be there), and no jid twice.
fn assert_one_job_per_tick(redis: &RedisServer, name: &str, jobs: &[Map<String, Value>]) {
    let ticks = ticks(redis, name);
    let format = "%Y-%m-%dT%H:%M:%SZ";
    for (member, _) in &ticks {
        let t = chrono::NaiveDateTime::parse_from_str(member, format).unwrap();
        assert_eq!(member, &t.format(format).to_string());
    }
    assert_eq!(ticks.len(), jobs.len() + 1, "{name}: ticks {ticks:?}");
    let jids: HashSet<&str> = jobs.iter().map(|j| j["jid"].as_str().unwrap()).collect();
    assert_eq!(jids.len(), jobs.len(), "{name}: a jid twice");
}

/// Each enqueue of `name` came from exactly one side, and both sides fired some.
fn assert_both_fired(jobs: &[Map<String, Value>], ruby: &[String], pg: &[String], name: &str) {
    let queued: HashSet<&str> = jobs.iter().map(|j| j["jid"].as_str().unwrap()).collect();
    let ruby: HashSet<&str> = ruby.iter().map(String::as_str).collect();
    let pg: HashSet<&str> = pg.iter().map(String::as_str).collect();
    assert!(ruby.is_disjoint(&pg), "{name}: a jid from both sides");
    assert_eq!(queued, &ruby | &pg, "{name}: every job from one side");
    assert!(
        !ruby.is_empty() && !pg.is_empty(),
        "{name}: ruby {ruby:?} pg {pg:?}"
    );
}

/// The schedule, through the gem's API: a Sidekiq job, an ActiveJob one and a disabled one.
fn create_schedule(redis: &RedisServer) {
    let names = ruby(
        redis,
        r#"
require 'sidekiq-cron'
Sidekiq::Cron::Job.create(name: 'tick', cron: '* * * * * *', class: 'CronTickJob', queue: 'cron', args: [1, 'two'])
Sidekiq::Cron::Job.create(name: 'wrapped', cron: '* * * * * *', class: 'CronReportJob', queue: 'reports',
  active_job: true, description: 'nightly report')
Sidekiq::Cron::Job.new(name: 'off', cron: '* * * * * *', class: 'OffJob', queue: 'cron_off', status: 'disabled').save
puts Sidekiq::Cron::Job.all.map(&:name).sort.join(',')
"#,
    );
    assert_eq!(names.trim(), "off,tick,wrapped");
}

fn start_ruby(redis: &RedisServer, p: &Project) -> RubySidekiq {
    RubySidekiq(
        Command::new("sidekiq")
            .args([
                "-r",
                "./cron_app.rb",
                "-C",
                "sidekiq.yml",
                "-q",
                "ruby_only",
            ])
            .current_dir(p.path())
            .env("REDIS_URL", redis.url())
            .env("LEDGER", p.path().join("ruby_pushes.txt"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the sidekiq CLI"),
    )
}

/// The gem's Web UI page for `name`: the `datetime` of its last enqueue, as the tab shows it.
fn web_last_enqueue(redis: &RedisServer, name: &str) -> String {
    ruby(
        redis,
        &format!(
            r##"
require 'sidekiq/web'; require 'sidekiq-cron'; require 'sidekiq/cron/web'
require 'rack/session/cookie'; require 'rack/mock'
app = Rack::Builder.new {{ use Rack::Session::Cookie, secret: 'k' * 64; run Sidekiq::Web }}
res = Rack::MockRequest.new(app).get('/cron/{name}')
raise "HTTP #{{res.status}}" unless res.status == 200
stamps = res.body.scan(/datetime="([^"]+)"/).flatten
puts stamps.first
"##
        ),
    )
    .trim()
    .to_string()
}

#[test]
fn mixed_fleet_fires_each_tick_once_in_the_gems_shape() {
    if !gem_available() {
        return;
    }
    let redis = RedisServer::start();
    // playguard's own queue and class, which no cron entry uses.
    let p = Project::with_jobs(&[("PgOnlyJob", "noop", "#!/bin/sh\n")]);
    p.write("cron_app.rb", RUBY_APP);
    p.write("sidekiq.yml", SIDEKIQ_YML);
    p.write(
        "sidekiq_cron.yml",
        &format!("sidekiq_cron: true\n{SIDEKIQ_YML}"),
    );
    create_schedule(&redis);
    let mut rb = start_ruby(&redis, &p);
    // One playguard with the flag, one with the sidekiq.yml key; neither serves the cron queues.
    let base = ["-q", "pg_only", "-c", "1"];
    let mut a = Worker::builder(&redis)
        .jobs(p.path())
        .args(base)
        .args(["--sidekiq-cron", "-C"])
        .arg(p.path().join("sidekiq.yml"))
        .start();
    let mut b = Worker::builder(&redis)
        .jobs(p.path())
        .args(base)
        .arg("-C")
        .arg(p.path().join("sidekiq_cron.yml"))
        .start();
    wait_until(
        "Ruby and both playguards fired ticks",
        Duration::from_secs(120),
        || {
            ruby_jids(&p, "CronTickJob").len() >= 2
                && ruby_jids(&p, "CronReportJob").len() >= 2
                && pg_jids(&[&a], "tick").len() >= 2
                && pg_jids(&[&b], "tick").len() >= 2
                && pg_jids(&[&a, &b], "wrapped").len() >= 2
        },
    );
    // Ruby stops cleanly (its poller finishes the enqueue it is in); the playguards go on, so
    // the last enqueue of each entry is theirs.
    signal(rb.0.id() as i32, "TERM");
    reap_within(&mut rb.0, Duration::from_secs(30));
    let before = pg_jids(&[&a, &b], "tick").len();
    wait_until(
        "playguard fired after Ruby left",
        Duration::from_secs(60),
        || pg_jids(&[&a, &b], "tick").len() >= before + 2,
    );
    a.stop(Duration::from_secs(30));
    b.stop(Duration::from_secs(30));

    let tick_jobs = payloads(&redis, "cron");
    assert_one_job_per_tick(&redis, "tick", &tick_jobs);
    let pg_tick = pg_jids(&[&a, &b], "tick");
    assert_both_fired(&tick_jobs, &ruby_jids(&p, "CronTickJob"), &pg_tick, "tick");
    for j in &tick_jobs {
        // Ruby's and ours alike: Sidekiq's client on the stored message.
        assert_eq!(
            keys(j),
            [
                "retry",
                "queue",
                "class",
                "args",
                "jid",
                "created_at",
                "enqueued_at"
            ]
        );
        assert_eq!(
            (&j["retry"], &j["queue"], &j["class"], &j["args"]),
            (
                &Value::Bool(true),
                &Value::from("cron"),
                &Value::from("CronTickJob"),
                &serde_json::json!([1, "two"])
            )
        );
    }
    let aj_jobs = payloads(&redis, "reports");
    assert_one_job_per_tick(&redis, "wrapped", &aj_jobs);
    let pg_aj = pg_jids(&[&a, &b], "wrapped");
    assert_both_fired(&aj_jobs, &ruby_jids(&p, "CronReportJob"), &pg_aj, "wrapped");
    for j in &aj_jobs {
        assert_eq!(
            keys(j),
            [
                "retry",
                "queue",
                "class",
                "wrapped",
                "description",
                "args",
                "jid",
                "created_at",
                "enqueued_at"
            ]
        );
        assert_eq!(
            j["class"],
            "ActiveJob::QueueAdapters::SidekiqAdapter::JobWrapper"
        );
        assert_eq!(
            (&j["wrapped"], &j["description"]),
            (
                &Value::from("CronReportJob"),
                &Value::from("nightly report")
            )
        );
        let inner = j["args"][0].as_object().unwrap();
        assert_eq!(
            keys(inner),
            ["job_class", "job_id", "queue_name", "arguments"]
        );
        assert_eq!(
            (&inner["queue_name"], &inner["arguments"]),
            (&Value::from("reports"), &serde_json::json!([]))
        );
    }
    // Disabled: never enqueued, by either side.
    assert_eq!(redis.llen("queue:cron_off"), 0);
    assert_eq!(ticks(&redis, "off").len(), 1);
    assert_history_and_web(&redis, &pg_tick);
}

/// The jid history and `last_enqueue_time` as the gem reads them, its Web UI tab included:
/// the last enqueue was a playguard's.
fn assert_history_and_web(redis: &RedisServer, pg_tick: &[String]) {
    let history: Vec<Map<String, Value>> = redis
        .lrange("cron_job:tick:jid_history")
        .iter()
        .map(|s| serde_json::from_str(s).unwrap())
        .collect();
    let jobs = redis.llen("queue:cron");
    assert_eq!(history.len(), jobs.min(5), "cron_history_size: 5");
    assert!(history.iter().all(|h| keys(h) == ["jid", "enqueued"]));
    let newest = history[0]["jid"].as_str().unwrap();
    assert!(
        pg_tick.iter().any(|j| j == newest),
        "newest {newest} is playguard's"
    );
    let last: String = redis::cmd("HGET")
        .arg("cron_job:tick")
        .arg("last_enqueue_time")
        .query(&mut redis.conn())
        .unwrap();
    assert_eq!(history[0]["enqueued"], last.as_str());
    let t = chrono::DateTime::parse_from_str(&last, "%Y-%m-%d %H:%M:%S %z").unwrap();
    assert!(last.ends_with(" +0000"), "{last}");
    let read_back = ruby(
        redis,
        "require 'sidekiq-cron'\nj = Sidekiq::Cron::Job.find('tick')\nputs j.last_enqueue_time.to_i, j.jid_history_from_redis.first['jid']",
    );
    assert_eq!(
        read_back.split_whitespace().collect::<Vec<_>>(),
        [t.timestamp().to_string().as_str(), newest]
    );
    let shown = web_last_enqueue(redis, "tick");
    assert_eq!(shown, t.format("%Y-%m-%dT%H:%M:%SZ").to_string());
}

/// The gem's gate, alone: `save` claims the current tick of a new entry (so that a poller
/// started right after does not fire it), with no `last_enqueue_time` written; playguard must
/// leave that tick alone and only fire the next. Beside it, an entry whose queue key holds a
/// string is refused whole (nothing written, the reason logged), as is a `cron_jobs` member
/// whose key is not a hash, and the others go on.
#[test]
fn a_claimed_tick_is_left_and_a_bad_queue_key_loses_nothing() {
    if !gem_available() {
        return;
    }
    let mut redis = RedisServer::start();
    let p = Project::with_jobs(&[("PgOnlyJob", "noop", "#!/bin/sh\n")]);
    p.write("sidekiq.yml", SIDEKIQ_YML);
    // Claim a tick with most of its minute still ahead, so playguard polls inside it. On a
    // loaded machine Ruby can return late: a minute with under 15 s left is claimed again in
    // the next one, on a fresh redis-server of the test's own, else the test would prove
    // nothing.
    let mut claimed = String::new();
    for _ in 0..5 {
        wait_until("a minute's first 40 s", Duration::from_secs(70), || {
            chrono::Timelike::second(&chrono::Utc::now()) < 40
        });
        claimed = ruby(
            &redis,
            r#"
    require 'sidekiq-cron'
    Sidekiq::Cron::Job.create(name: 'minute', cron: '* * * * *', class: 'MinuteJob', queue: 'minute')
    Sidekiq::Cron::Job.create(name: 'tick', cron: '* * * * * *', class: 'CronTickJob', queue: 'cron')
    Sidekiq::Cron::Job.create(name: 'blocked', cron: '* * * * * *', class: 'BlockedJob', queue: 'blocked')
    Sidekiq.redis { |c| c.set('queue:blocked', 'not a list') }
    Sidekiq.redis { |c| c.sadd('cron_jobs', 'cron_job:broken'); c.set('cron_job:broken', 'not a hash') }
    puts Sidekiq.redis { |c| c.zrange('cron_job:minute:enqueued', 0, -1) }
    "#,
        );
        let now = chrono::Utc::now();
        let minute = now.format("%Y-%m-%dT%H:%M:").to_string();
        if claimed.trim().starts_with(&minute) && chrono::Timelike::second(&now) < 45 {
            break;
        }
        redis = RedisServer::start();
    }
    let claimed = claimed.trim().to_string();
    let minute = &claimed[..17];
    let mut w = Worker::builder(&redis)
        .jobs(p.path())
        .args(["-q", "pg_only", "--sidekiq-cron", "-C"])
        .arg(p.path().join("sidekiq.yml"))
        .start();
    wait_until(
        "polls inside the claimed minute",
        Duration::from_secs(60),
        || {
            w.lines()
                .iter()
                .filter(|l| l.contains("cron=tick ") && l.contains(&format!("tick={minute}")))
                .count()
                >= 2
        },
    );
    w.wait_for_line("key=cron_job:blocked", Duration::from_secs(30));
    w.wait_for_line("key=cron_job:broken", Duration::from_secs(30));
    w.stop(Duration::from_secs(30));
    let fired: Vec<String> = w
        .lines()
        .into_iter()
        .filter(|l| l.contains("sidekiq-cron: enqueued cron=minute "))
        .collect();
    assert!(
        fired
            .iter()
            .all(|l| !l.contains(&format!("tick={claimed}"))),
        "the claimed tick {claimed} fired again: {fired:?}"
    );
    assert_eq!(redis.llen("queue:minute"), fired.len());
    assert_eq!(ticks(&redis, "minute").len(), 1 + fired.len());
    // The refused entry: its queue key as it was, no tick taken, one reason logged.
    let kept: String = redis::cmd("GET")
        .arg("queue:blocked")
        .query(&mut redis.conn())
        .unwrap();
    assert_eq!(kept, "not a list");
    assert_eq!(ticks(&redis, "blocked").len(), 1);
    let reason = w.line_with("key=cron_job:blocked").unwrap();
    assert!(reason.contains("queue:blocked holds a string"), "{reason}");
    assert_eq!(w.count_lines("key=cron_job:blocked"), 1, "logged once");
    let broken = w.line_with("key=cron_job:broken").unwrap();
    assert!(broken.contains("WRONGTYPE"), "{broken}");
    assert_eq!(w.count_lines("key=cron_job:broken"), 1, "logged once");
}

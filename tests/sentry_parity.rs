//! sentry-sidekiq parity: the same failing jobs (the same payload bytes) run once by the real
//! Ruby Sidekiq 6.4.1 with sentry-sidekiq 5.3.0 and once by playguard, each reporting to a
//! loopback Sentry listener of its own; each job's two events are compared field by field. What
//! must differ (event_id, timestamps, the stack frames, the Ruby-only platform, sdk, modules,
//! runtime and os fields) is taken out first; every other difference must be one of those
//! docs/failures.md lists as left on purpose, and each of those must still be there, so a
//! field changed on either side fails the test. Skips without Ruby and the gem, unless
//! PLAYGUARD_REQUIRE_RUBY=1. A second test leaves `SENTRY_RELEASE` unset: both must find the
//! same release in the app's directory.
mod support;

use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;
use support::*;

const PATIENCE: Duration = Duration::from_secs(60);

/// The Ruby app: sentry-sidekiq configured from the environment only (SENTRY_DSN,
/// SENTRY_ENVIRONMENT, SENTRY_RELEASE), and the jobs, each raising the error class playguard
/// gives a failed command, with the message the command's last stderr line gives.
const APP_RB: &str = r#"
require 'sidekiq'
require 'sentry-ruby'
require 'sentry-sidekiq'
require 'active_job'
Sentry.init { |c| c.dsn = ENV.fetch('SENTRY_DSN') }
ActiveJob::Base.queue_adapter = :sidekiq
ActiveJob::Base.logger = Logger.new(nil)
module Playguard
  class CommandFailed < StandardError; end
end
class FailJob
  include Sidekiq::Worker
  def perform(*)
    raise Playguard::CommandFailed, 'disk full'
  end
end
class AgainJob < FailJob; end
class DeadJob < FailJob; end
class ReportJob < ActiveJob::Base
  def perform(*)
    raise Playguard::CommandFailed, 'disk full'
  end
end
"#;

/// The same jobs for playguard: a command that fails with the same last stderr line; `args`
/// opted in, so the `sidekiq` context is compared whole.
fn manifest() -> String {
    ["FailJob", "AgainJob", "DeadJob", "ReportJob"]
        .iter()
        .map(|c| {
            format!("[[job]]\nclass = \"{c}\"\nrun = [\"jobs/bin/fail\"]\nreport_args = true\n")
        })
        .collect()
}

const FAIL: &str = "#!/bin/sh\necho 'checking disk' >&2\necho 'disk full' >&2\nexit 1\n";

/// A first failure (tags, a Sentry user as sentry-sidekiq's client middleware adds it); a
/// job already retried once (its failure fields as Sidekiq wrote them), whose argument `PAD`
/// makes ({"k": "v" * PAD}, [`payloads`]) sentry-ruby gzip its event (it does past 30 kB); a
/// job that dies (`retry: 0`); an ActiveJob job as Rails 6.1's Sidekiq adapter pushes it (its
/// `_aj_` keys are what sentry-sidekiq renames).
const JID_FRESH: &str = "aaaaaaaaaaaaaaaaaaaaaaa1";
const FRESH: &str = r#"{"class":"FailJob","args":["a",1],"retry":3,"queue":"default","jid":"aaaaaaaaaaaaaaaaaaaaaaa1","created_at":1796660000.5,"enqueued_at":1796660001.25,"tags":["alpha","beta"],"sentry_user":{"id":42,"username":"ada"}}"#;
const PAD: usize = 40_000;
const AGAIN: &str = r#"{"class":"AgainJob","args":[{"k":"v"}],"retry":5,"queue":"default","jid":"bbbbbbbbbbbbbbbbbbbbbbb2","created_at":1796660000.5,"enqueued_at":1796660004.5,"error_message":"disk was full","error_class":"Playguard::CommandFailed","failed_at":1796660002.5,"retry_count":1,"retried_at":1796660003.5}"#;
const DEAD: &str = r#"{"class":"DeadJob","args":[],"retry":0,"queue":"default","jid":"ccccccccccccccccccccccc3","created_at":1796660000.5,"enqueued_at":1796660001.5}"#;
const ACTIVE: &str = r#"{"class":"ActiveJob::QueueAdapters::SidekiqAdapter::JobWrapper","wrapped":"ReportJob","queue":"default","args":[{"job_class":"ReportJob","job_id":"5f7c0d1e-0000-4000-8000-000000000001","provider_job_id":null,"queue_name":"default","priority":null,"arguments":[7,{"mode":"full","_aj_symbol_keys":["mode"]}],"executions":0,"exception_executions":{},"locale":"en","timezone":"UTC","enqueued_at":"2026-12-01T00:00:00Z"}],"retry":3,"jid":"ddddddddddddddddddddddd4","created_at":1796660000.5,"enqueued_at":1796660001.5}"#;

/// The four payloads (AGAIN padded), byte for byte the same for both runs.
fn payloads() -> Vec<String> {
    let pad = format!("\"{}\"", "v".repeat(PAD));
    vec![
        FRESH.to_string(),
        AGAIN.replace("\"v\"", &pad),
        DEAD.to_string(),
        ACTIVE.to_string(),
    ]
}

/// What playguard's event has that sentry-sidekiq's has not, or has otherwise, on purpose
/// (docs/failures.md, "Compared with sentry-sidekiq"): (path, how it differs).
const LEFT_ON_PURPOSE: &[(&str, &str)] = &[
    ("contexts.playguard.event", "playguard only"),
    ("contexts.playguard.stderr", "playguard only"),
    // The `sentry` crate writes a custom context's `type` as "unknown"; Sentry files the
    // context under its key either way.
    ("contexts.playguard.type", "playguard only"),
    ("contexts.sidekiq.type", "playguard only"),
    ("extra.suppressed", "playguard only"),
    ("fingerprint", "differs"),
    ("logger", "playguard only"),
    ("tags.class", "playguard only"),
    ("tags.event", "playguard only"),
];

/// Fields that must differ between a Ruby process and this one, or that only a Ruby SDK has.
const NOT_COMPARED: &[&str] = &[
    "event_id",
    "timestamp",
    "platform",
    "sdk",
    "modules",
    "threads",
    "breadcrumbs",
    "type",
    "contexts.os",
    "contexts.runtime",
];

#[test]
fn playguards_sentry_event_matches_sentry_sidekiqs_for_the_same_job() {
    if !ruby_can(
        "require 'sidekiq'; require 'sentry-sidekiq'; require 'active_job'",
        "ruby-sidekiq ruby-sentry-sidekiq ruby-activejob",
    ) {
        return;
    }
    let run = Run {
        payloads: payloads(),
        release_env: true,
        prepare: &|_| {},
    };
    let (ruby, gzipped) = ruby_events(&run);
    assert!(gzipped >= 1, "the padded job's event came gzip'd");
    let ours = playguard_events(&run);
    let mut report = String::new();
    for (jid, r) in &ruby {
        let o = ours
            .get(jid)
            .unwrap_or_else(|| panic!("playguard sent no event for {jid}: {ours:?}"));
        let found = differences(r, o);
        let kinds: Vec<(&str, &str)> = found.iter().map(|d| (d.0.as_str(), d.1)).collect();
        if kinds != LEFT_ON_PURPOSE {
            for (path, how, rv, ov) in &found {
                report += &format!("{jid} {path}: {how}\n  ruby:      {rv}\n  playguard: {ov}\n");
            }
        }
    }
    assert_eq!(ruby.len(), payloads().len(), "{ruby:?}");
    assert!(
        report.is_empty(),
        "differences other than those left on purpose ({LEFT_ON_PURPOSE:?}):\n{report}"
    );
}

#[test]
fn without_sentry_release_both_find_the_same_release_in_the_apps_directory() {
    if !ruby_can(
        "require 'sidekiq'; require 'sentry-sidekiq'; require 'active_job'",
        "ruby-sidekiq ruby-sentry-sidekiq ruby-activejob",
    ) {
        return;
    }
    // A Capistrano release directory, then a git checkout (git comes first for both). The
    // commit's dates are fixed, so both sides' checkouts have the same commit.
    let capistrano = |dir: &Path| {
        std::fs::write(dir.join("REVISION"), "0f1e2d3c4b5a\n").unwrap();
    };
    let checkout = |dir: &Path| {
        capistrano(dir);
        let git = |args: &[&str]| {
            let out = Command::new("git")
                .args(["-c", "user.name=t", "-c", "user.email=t@example.com"])
                .args(args)
                .env("GIT_AUTHOR_DATE", "2026-12-01T00:00:00Z")
                .env("GIT_COMMITTER_DATE", "2026-12-01T00:00:00Z")
                .current_dir(dir)
                .output()
                .expect("run git");
            assert_success(&out);
        };
        git(&["init", "-q"]);
        git(&["commit", "-q", "--allow-empty", "-m", "deploy"]);
    };
    for (what, prepare, from_revision) in [
        ("Capistrano's REVISION", &capistrano as &dyn Fn(&Path), true),
        ("the git checkout", &checkout, false),
    ] {
        let run = Run {
            payloads: vec![FRESH.to_string()],
            release_env: false,
            prepare,
        };
        let (ruby, _) = ruby_events(&run);
        let ours = playguard_events(&run);
        let (r, o) = (&ruby[JID_FRESH]["release"], &ours[JID_FRESH]["release"]);
        assert!(
            r.is_string(),
            "sentry-ruby found a release in {what}: {ruby:?}"
        );
        assert_eq!(r == "0f1e2d3c4b5a", from_revision, "{what}: {r}");
        assert_eq!(r, o, "the release from {what}");
    }
}

/// One side's run: the payloads pushed, whether the deploy sets `SENTRY_RELEASE`, and what
/// else the app's directory (both sides' working directory) holds.
struct Run<'a> {
    payloads: Vec<String>,
    release_env: bool,
    prepare: &'a dyn Fn(&Path),
}

/// The events sentry-sidekiq sends for the payloads, by jid, and how many came gzip'd.
fn ruby_events(run: &Run) -> (BTreeMap<String, Value>, usize) {
    let redis = RedisServer::start();
    let sentry = SentryListener::start();
    let p = Project::new();
    let app = p.write("app.rb", APP_RB);
    (run.prepare)(p.path());
    push_to_default(&redis, run.payloads.clone());
    let log = std::fs::File::create(p.path().join("sidekiq.log")).unwrap();
    let mut sidekiq = Command::new("sidekiq")
        .args(["-r".as_ref(), app.as_os_str()])
        .args(["-c", "1", "-q", "default", "-t", "5"])
        .current_dir(p.path())
        .env("REDIS_URL", redis.url())
        .env_remove("SENTRY_RELEASE")
        .envs(sentry_env(&sentry, run.release_env))
        .env_remove("RAILS_ENV")
        .env_remove("RACK_ENV")
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("start sidekiq");
    let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        wait_until("an event per job from sentry-sidekiq", PATIENCE, || {
            sentry.events().len() >= run.payloads.len()
        })
    }));
    signal(sidekiq.id() as i32, "TERM");
    reap_within(&mut sidekiq, Duration::from_secs(15));
    if got.is_err() {
        panic!("sidekiq's log:\n{}", p.read("sidekiq.log"));
    }
    (by_jid(sentry.events()), sentry.gzipped())
}

/// The events playguard sends for the same payloads, by jid.
fn playguard_events(run: &Run) -> BTreeMap<String, Value> {
    let redis = RedisServer::start();
    let sentry = SentryListener::start();
    let p = Project::new();
    p.script("jobs/bin/fail", FAIL);
    p.write("jobs/app.toml", &manifest());
    (run.prepare)(p.path());
    let mut cmd = Worker::builder(&redis).jobs(p.path()).command();
    cmd.env_remove("SENTRY_RELEASE")
        .envs(sentry_env(&sentry, run.release_env));
    let mut w = Worker::spawn(&mut cmd);
    push_to_default(&redis, run.payloads.clone());
    wait_until("every job in the retry or dead set", PATIENCE, || {
        (redis.zcard("retry") + redis.zcard("dead")) as usize == run.payloads.len()
    });
    // A clean stop flushes what is queued.
    w.stop(PATIENCE);
    by_jid(sentry.events())
}

/// The environment a Rails app's deploy sets, the same for both. `DYNO` too, off Heroku:
/// sentry-ruby names the server by it only on Heroku.
fn sentry_env(sentry: &SentryListener, release: bool) -> Vec<(&'static str, String)> {
    let mut env = vec![
        ("SENTRY_DSN", sentry.dsn()),
        ("SENTRY_ENVIRONMENT", "staging".into()),
        ("DYNO", "worker.1".into()),
    ];
    if release {
        env.push(("SENTRY_RELEASE", "app@1.2.3".into()));
    }
    env
}

fn by_jid(events: Vec<Value>) -> BTreeMap<String, Value> {
    events
        .into_iter()
        .map(|e| (e["tags"]["jid"].as_str().unwrap_or("?").to_string(), e))
        .collect()
}

/// (path, how, ruby's value, playguard's value) of every leaf that differs, sorted by path.
fn differences(ruby: &Value, ours: &Value) -> Vec<(String, &'static str, Value, Value)> {
    let (r, o) = (leaves(ruby), leaves(ours));
    let mut paths: Vec<&String> = r.keys().chain(o.keys()).collect();
    paths.sort();
    paths.dedup();
    paths
        .into_iter()
        .filter_map(|p| {
            let how = match (r.get(p), o.get(p)) {
                (Some(a), Some(b)) if a == b => return None,
                (Some(_), Some(_)) => "differs",
                (Some(_), None) => "ruby only",
                _ => "playguard only",
            };
            let v = |m: &BTreeMap<String, Value>| m.get(p).cloned().unwrap_or(Value::Null);
            Some((p.clone(), how, v(&r), v(&o)))
        })
        .collect()
}

/// An event as dotted paths to its leaves (arrays are leaves, but the exception's values are
/// walked), normalised: what is not compared left out, tags and the user's id as the strings
/// Sentry stores (a boolean tag is shown as "true", a numeric id as its digits), an absent level as the protocol's default (error), an
/// empty message as none.
fn leaves(e: &Value) -> BTreeMap<String, Value> {
    let mut out = BTreeMap::new();
    walk("", e, &mut out);
    out.retain(|p, _| {
        !NOT_COMPARED
            .iter()
            .any(|n| p == n || p.starts_with(&format!("{n}.")))
            && !(p.starts_with("exception.values.")
                && (p.contains(".stacktrace") || p.ends_with(".thread_id")))
    });
    for (p, v) in out.iter_mut() {
        if (p.starts_with("tags.") || p == "user.id") && !v.is_string() {
            *v = Value::from(v.to_string());
        }
    }
    out.entry("level".into()).or_insert_with(|| "error".into());
    if out.get("message") == Some(&Value::from("")) {
        out.remove("message");
    }
    out
}

fn walk(path: &str, v: &Value, out: &mut BTreeMap<String, Value>) {
    let join = |k: &str| {
        if path.is_empty() {
            k.to_string()
        } else {
            format!("{path}.{k}")
        }
    };
    match v {
        Value::Object(m) => m.iter().for_each(|(k, v)| walk(&join(k), v, out)),
        Value::Array(a) if path == "exception.values" => a
            .iter()
            .enumerate()
            .for_each(|(i, v)| walk(&join(&i.to_string()), v, out)),
        Value::Null => {}
        leaf => {
            out.insert(path.to_string(), leaf.clone());
        }
    }
}

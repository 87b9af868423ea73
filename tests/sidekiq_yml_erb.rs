//! ERB in `config/sidekiq.yml`: shapes of the file seen in public Rails apps, each rendered and
//! parsed by playguard and by Ruby's own ERB and YAML as Sidekiq 7.3+ reads the file
//! (`ERB.new(text, trim_mode: "-")`, then `YAML.safe_load`, keys symbolized, the environment's
//! section merged), with the variables unset and set. An expression outside the subset stops
//! `run` with exit 2 and one line naming the file, the line and the expression.
mod support;

use serde_json::{json, Value};
use std::collections::HashMap;
use std::process::Command;
use support::*;

const SHAPES: &[&str] = &[
    // The issue's line.
    ":concurrency: <%= ENV.fetch(\"SIDEKIQ_CONCURRENCY\", 10) %>\n:queues:\n  - default\n",
    ":concurrency: <%= ENV[\"SIDEKIQ_CONCURRENCY\"] || 5 %>\n:timeout: <%= ENV.fetch('SIDEKIQ_TIMEOUT', 25).to_i %>\n",
    ":concurrency: <%= ENV.fetch(\"RAILS_MAX_THREADS\") { 5 } %>\n",
    "---\n:concurrency: <%= ENV.fetch(\"SIDEKIQ_CONCURRENCY\", \"5\").to_i %>\n:tag: <%= ENV.fetch('APP_NAME', 'myapp') %>\n:labels:\n  - <%= ENV['REGION'] || \"eu\" %>\n",
    "<%# Concurrency comes from the environment %>\n---\n:concurrency: <%= ENV['SIDEKIQ_CONCURRENCY'] || 5 %>\n:queues:\n  - [critical, 6]\n  - [default, 4]\n  <%- # mailers go last -%>\n  - [mailers, <%= ENV.fetch(\"MAILER_WEIGHT\", 2) -%>\n]\nproduction:\n  :concurrency: <%= ENV.fetch(\"WORKERS\") { ENV.fetch(\"SIDEKIQ_CONCURRENCY\", 20) } %>\n",
    "development:\n  :concurrency: <%= (ENV[\"RAILS_MAX_THREADS\"] || 3).to_i %>\nproduction:\n  :concurrency: <%= ENV[\"WORKERS\"] || ENV[\"RAILS_MAX_THREADS\"] || 10 %>\n  :timeout: <%= ENV.fetch(\"SIDEKIQ_TIMEOUT\", 8) %>\n",
];

const VARS: &[(&str, &str)] = &[
    ("SIDEKIQ_CONCURRENCY", "7"),
    ("SIDEKIQ_TIMEOUT", "30"),
    ("RAILS_MAX_THREADS", "4"),
    ("APP_NAME", "shop"),
    ("REGION", "us"),
    ("MAILER_WEIGHT", "1"),
    ("WORKERS", "12"),
];

const RUBY: &str = r#"
require "erb"; require "yaml"; require "json"
text = File.read(ARGV[0])
rendered = ERB.new(text, trim_mode: "-").result
opts = YAML.safe_load(rendered, permitted_classes: [Symbol], aliases: true) || {}
opts = opts.transform_keys(&:to_sym)
section = opts.delete(ARGV[1].to_sym) || {}
opts = opts.merge(section.transform_keys(&:to_sym))
queues = opts[:queues]&.map { |q| q.is_a?(Array) ? [q[0], q[1] || 0] : [q, 0] }
puts JSON.generate(rendered: rendered, concurrency: opts[:concurrency], timeout: opts[:timeout],
  queues: queues, tag: opts[:tag], labels: opts[:labels])
"#;

/// What Ruby makes of `text` in environment section `env` with `vars` set (and the others of
/// VARS unset).
fn ruby_reading(text: &str, env: &str, vars: &HashMap<String, String>) -> Value {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sidekiq.yml");
    std::fs::write(&path, text).unwrap();
    let mut cmd = Command::new("ruby");
    cmd.args(["-e", RUBY]).arg(&path).arg(env);
    for (k, _) in VARS {
        cmd.env_remove(k);
    }
    let out = cmd.envs(vars).output().expect("run ruby");
    assert_success(&out);
    serde_json::from_slice(&out.stdout).unwrap()
}

fn playguard_reading(text: &str, env: &str, vars: &HashMap<String, String>) -> Value {
    let rendered = playguard::test_support::erb_render_with(text, vars)
        .unwrap_or_else(|e| panic!("{e}\n{text}"));
    let c =
        playguard::config::parse_text(text, env, vars).unwrap_or_else(|e| panic!("{e}\n{text}"));
    json!({
        "rendered": rendered,
        "concurrency": c.concurrency,
        "timeout": c.timeout.map(|t| if t.fract() == 0.0 { json!(t as i64) } else { json!(t) }),
        "queues": c.queues,
        "tag": c.tag,
        "labels": c.labels,
    })
}

#[test]
fn shapes_read_as_ruby_reads_them() {
    if !ruby_can("require 'erb'; require 'yaml'; require 'json'", "ruby") {
        return;
    }
    let set: HashMap<String, String> = VARS
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    for text in SHAPES {
        for vars in [HashMap::new(), set.clone()] {
            for env in ["development", "production"] {
                let ruby = ruby_reading(text, env, &vars);
                let ours = playguard_reading(text, env, &vars);
                assert_eq!(ours, ruby, "{env}, vars {vars:?}:\n{text}");
            }
        }
    }
}

/// A missing variable behind `ENV.fetch` without a default, and Ruby outside the subset, both
/// stop the start with exit 2 and one line naming the file, the line and the expression.
#[test]
fn outside_the_subset_is_exit_2_naming_file_line_and_expression() {
    let p = Project::new();
    let cases = [
        (
            ":timeout: 8\n:concurrency: <%= Integer(ENV.fetch(\"X\", 5)) %>\n",
            2,
            "Integer(ENV.fetch(\"X\", 5))",
        ),
        (
            "\n\n\n<%- if ENV[\"PRO\"] -%>\n:concurrency: 3\n<%- end -%>\n",
            4,
            "if ENV[\"PRO\"]",
        ),
        (
            ":concurrency: <%= ENV.fetch(\"PLAYGUARD_TEST_UNSET_VAR\") %>\n",
            1,
            "ENV.fetch(\"PLAYGUARD_TEST_UNSET_VAR\")",
        ),
    ];
    for (text, line, expr) in cases {
        let path = p.write("config/sidekiq.yml", text);
        let out = Command::new(bin())
            .args(["run", "-r", "redis://127.0.0.1:1/0", "-C"])
            .arg(&path)
            .current_dir(p.path())
            .env_remove("PLAYGUARD_TEST_UNSET_VAR")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{text}\n{stderr}");
        let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{stderr}");
        for needle in [
            path.to_str().unwrap(),
            &format!("line {line}:"),
            &format!("`{expr}`"),
        ] {
            assert!(lines[0].contains(needle), "{needle} in {stderr}");
        }
    }
}

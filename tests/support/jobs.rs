//! Jobs: the scratch project a worker runs in (a temp dir with `jobs/` manifests and executable
//! job scripts), the job scripts several test files use, and the ledgers those scripts write,
//! read back. A script's cwd is the project directory, so its files are the project's.

use super::lines::{file_lines, read_or_empty};
use super::RedisServer;
use std::path::{Path, PathBuf};

/// Does nothing, exits 0.
pub const NOOP: &str = "#!/bin/sh\n";

/// Blocks until the file `release` appears in the project directory.
pub const BLOCK_UNTIL_RELEASE: &str = "#!/bin/sh\nwhile [ ! -e release ]; do sleep 0.05; done\n";

/// Appends `ran` to `ran.log`.
pub const RECORD_RAN: &str = "#!/bin/sh\necho ran >> ran.log\n";

/// Appends its job's jid to `ledger.txt`.
pub const RECORD_JID: &str = "#!/bin/sh\necho \"$PLAYGUARD_JID\" >> ledger.txt\n";

/// A phase that touches `<name>.started`, then waits for `<name>.go` (see [`Project::go`]);
/// `<name>` is the job's first argument.
pub const WAIT_FOR_GO: &str = "#!/bin/sh\n\
    name=$(printf '%s' \"$PLAYGUARD_ARGS\" | tr -d '[] \"' | cut -d, -f1)\n\
    touch \"$name.started\"\n\
    while [ ! -e \"$name.go\" ]; do sleep 0.02; done\n";

/// A phase that appends `start <marquee> <phase> <fence> <pid> <epoch>` to `ledger.log`,
/// sleeps `secs`, then appends the same with `end` (read back with [`phase_ledger`]).
pub fn phase_ledger_script(secs: f64) -> String {
    format!(
        "#!/bin/sh\nm=$(printf '%s' \"$PLAYGUARD_ARGS\" | tr -d '[]\"')\n\
         echo \"start $m $PLAYGUARD_PHASE $PLAYGUARD_FENCE $$ $(date +%s.%N)\" >> ledger.log\n\
         sleep {secs}\n\
         echo \"end $m $PLAYGUARD_PHASE $PLAYGUARD_FENCE $$ $(date +%s.%N)\" >> ledger.log\n"
    )
}

/// One line of a [`phase_ledger_script`]'s `ledger.log`.
#[derive(Debug, Clone)]
pub struct PhaseEntry {
    pub kind: String,
    pub marquee: String,
    pub phase: String,
    pub fence: i64,
    pub pid: i32,
    pub at: f64,
}

/// The whole entries of the project's `ledger.log` so far, in file order.
pub fn phase_ledger(p: &Project) -> Vec<PhaseEntry> {
    p.lines("ledger.log")
        .iter()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() == 6).then(|| PhaseEntry {
                kind: f[0].into(),
                marquee: f[1].into(),
                phase: f[2].into(),
                fence: f[3].parse().unwrap(),
                pid: f[4].parse().unwrap(),
                at: f[5].parse().unwrap(),
            })
        })
        .collect()
}

/// (start, end, fence) of each phase run of `marquee`, by start; a run with no `end` line
/// yet ends at infinity.
pub fn phase_intervals(entries: &[PhaseEntry], marquee: &str) -> Vec<(f64, f64, i64)> {
    let mut out = Vec::new();
    for s in entries
        .iter()
        .filter(|e| e.kind == "start" && e.marquee == marquee)
    {
        let end = entries
            .iter()
            .find(|e| e.kind == "end" && e.pid == s.pid)
            .map(|e| e.at)
            .unwrap_or(f64::INFINITY);
        out.push((s.at, end, s.fence));
    }
    out.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap());
    out
}

/// A scratch project directory with `jobs/` manifests and scripts.
pub struct Project {
    pub dir: tempfile::TempDir,
}

impl Project {
    pub fn new() -> Project {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("jobs/bin")).unwrap();
        Project { dir }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn write(&self, rel: &str, content: &str) -> PathBuf {
        let p = self.dir.path().join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, content).unwrap();
        p
    }

    /// A project whose `jobs/app.toml` maps each class to a script: (class, script name under
    /// jobs/bin, script body). Several classes may share one script (same name and body).
    pub fn with_jobs(jobs: &[(&str, &str, &str)]) -> Project {
        let p = Project::new();
        let mut manifest = String::new();
        for (class, script, body) in jobs {
            p.script(&format!("jobs/bin/{script}"), body);
            manifest += &format!("[[job]]\nclass = \"{class}\"\nrun = [\"jobs/bin/{script}\"]\n");
        }
        p.write("jobs/app.toml", &manifest);
        p
    }

    /// The content of the project file `rel` ("" while it does not exist).
    pub fn read(&self, rel: &str) -> String {
        read_or_empty(&self.path().join(rel))
    }

    /// The lines of the project file `rel` (none while it does not exist).
    pub fn lines(&self, rel: &str) -> Vec<String> {
        file_lines(&self.path().join(rel))
    }

    /// Let a [`WAIT_FOR_GO`] phase for `name` go on: `<name>.go`.
    pub fn go(&self, name: &str) {
        self.write(&format!("{name}.go"), "");
    }

    /// A project with one reconcile job, `MarqueeCycle`, locked on `<lock_prefix><args.0>`
    /// (ttl 30 s, fences from PostgreSQL, label `Marquee <args.0>`) in three phases: `fetch`
    /// ([`NOOP`]), `apply` ([`WAIT_FOR_GO`]: it waits for [`Project::go`]) and `publish` ([`NOOP`]).
    pub fn go_gated_cycle(lock_prefix: &str) -> Project {
        let p = Project::new();
        p.script("jobs/bin/noop", NOOP);
        p.script("jobs/bin/wait", WAIT_FOR_GO);
        p.write(
            "jobs/app.toml",
            &format!(
                r#"
[[job]]
class = "MarqueeCycle"
lock = {{ key = "{lock_prefix}{{args.0}}", ttl_secs = 30, label = "Marquee {{args.0}}", fence = "database" }}
[[job.phase]]
name = "fetch"
run = ["jobs/bin/noop"]
[[job.phase]]
name = "apply"
run = ["jobs/bin/wait"]
[[job.phase]]
name = "publish"
run = ["jobs/bin/noop"]
"#
            ),
        );
        p
    }

    /// Write an executable script.
    pub fn script(&self, rel: &str, content: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let p = self.write(rel, content);
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    }
}

/// LPUSH raw payloads onto `queue:default` (after SADD to `queues`), as the Sidekiq client's
/// push and push_bulk do.
pub fn push_to_default(redis: &RedisServer, payloads: impl redis::ToRedisArgs) {
    let _: () = redis::pipe()
        .cmd("SADD")
        .arg("queues")
        .arg("default")
        .ignore()
        .cmd("LPUSH")
        .arg("queue:default")
        .arg(payloads)
        .ignore()
        .query(&mut redis.conn())
        .unwrap();
}

/// The launchable-Marquee set the periodic tests fan out over.
pub const MARQUEE_SET: &str = "playguard:marquees:launchable";

/// A project whose one `[[periodic]]` entry, `dispatch`, pushes a PlayguardJob to the
/// `marquees` queue (which no test worker serves) for each member of [`MARQUEE_SET`] every
/// `every` seconds; `extra` adds lines to the entry.
pub fn dispatch_project(every: u64, extra: &str) -> Project {
    let p = Project::new();
    p.write(
        "jobs/periodic.toml",
        &format!(
            r#"
[[periodic]]
name = "dispatch"
every_secs = {every}
class = "PlayguardJob"
queue = "marquees"
for_each_member_of = "{MARQUEE_SET}"
{extra}"#
        ),
    );
    p
}

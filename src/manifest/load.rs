//! Reading a manifest folder: every `*.toml` file in name order, each entry checked
//! (`validate.rs`) before anything starts, and every command it names found. Touches no Redis
//! keys.

use super::validate::{
    err, failure_policy, find_program, validate_hook, validate_job, validate_periodic,
};
use super::{HookSpec, JobSpec, Manifest, ManifestError, PeriodicSpec};
use serde::Deserialize;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    job: Vec<JobSpec>,
    #[serde(default)]
    periodic: Vec<PeriodicSpec>,
    #[serde(default)]
    hook: Vec<HookSpec>,
}

impl Manifest {
    /// Load `dir/*.toml` in name order. A missing folder is an empty manifest (a Rust-only
    /// embedding needs none); anything unreadable or invalid is an error.
    pub fn load(dir: &Path) -> Result<Manifest, ManifestError> {
        let mut m = Manifest::default();
        if !dir.exists() {
            return Ok(m);
        }
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| err(dir, "folder", e.to_string()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "toml"))
            .collect();
        files.sort();
        let mut seen: HashMap<String, String> = HashMap::new();
        for path in files {
            let text =
                std::fs::read_to_string(&path).map_err(|e| err(&path, "file", e.to_string()))?;
            let f: File = toml::from_str(&text)
                .map_err(|e| err(&path, "syntax", e.to_string().trim_end().to_string()))?;
            for (i, mut j) in f.job.into_iter().enumerate() {
                j.file = path.display().to_string();
                let entry = format!("[[job]] #{} (class {:?})", i + 1, j.class);
                validate_job(&j).map_err(|msg| err(&path, &entry, msg))?;
                j.policy = failure_policy(&j).map_err(|msg| err(&path, &entry, msg))?;
                if let Some(prev) = seen.insert(j.class.clone(), path.display().to_string()) {
                    return Err(err(
                        &path,
                        &entry,
                        format!("class {:?} is already defined in {prev}", j.class),
                    ));
                }
                m.jobs.push(j);
            }
            for (i, mut p) in f.periodic.into_iter().enumerate() {
                let entry = format!("[[periodic]] #{} (name {:?})", i + 1, p.name);
                validate_periodic(&mut p).map_err(|msg| err(&path, &entry, msg))?;
                m.periodic.push(p);
            }
            for (i, mut h) in f.hook.into_iter().enumerate() {
                h.file = path.display().to_string();
                let entry = format!("[[hook]] #{} (on {:?})", i + 1, h.on);
                validate_hook(&h).map_err(|msg| err(&path, &entry, msg))?;
                m.hooks.push(h);
            }
        }
        Ok(m)
    }
}

impl Manifest {
    /// Every command a job or phase names must be there to run: a path (relative to the
    /// working directory) to an executable file, or a program found on PATH.
    pub fn check_commands(&self) -> Result<(), ManifestError> {
        for j in &self.jobs {
            let argvs: Vec<(&[String], String)> = match &j.run {
                Some(argv) => vec![(argv.as_slice(), "run".to_string())],
                None => j
                    .phases
                    .iter()
                    .map(|p| (p.run.as_slice(), format!("phase {:?}", p.name)))
                    .collect(),
            };
            let mut argvs = argvs;
            if let Some(argv) = &j.on_exhausted {
                argvs.push((argv.as_slice(), "on_exhausted".to_string()));
            }
            Self::check_programs(&j.file, &format!("[[job]] (class {:?})", j.class), argvs)?;
        }
        for h in &self.hooks {
            let argvs = vec![(h.run.as_slice(), "run".to_string())];
            Self::check_programs(&h.file, &format!("[[hook]] (on {:?})", h.on), argvs)?;
        }
        Ok(())
    }

    fn check_programs(
        file: &str,
        entry: &str,
        argvs: Vec<(&[String], String)>,
    ) -> Result<(), ManifestError> {
        for (argv, what) in argvs {
            let prog = argv.first().map(String::as_str).unwrap_or("");
            if let Err(why) = find_program(prog) {
                return Err(ManifestError {
                    file: file.to_string(),
                    entry: entry.to_string(),
                    message: format!("{what}: {why}"),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::manifest::{Manifest, ManifestError};

    fn load(text: &str) -> Result<Manifest, ManifestError> {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("a.toml"), text).unwrap();
        Manifest::load(d.path())
    }

    #[test]
    fn parses_phased_and_plain_jobs() {
        let m = load(
            r#"
[[job]]
class = "HardJob"
run = ["bin/x", "--flag"]
[[job]]
class = "PlayguardJob"
lock = { key = "playguard:marquee:{args.0}", ttl_secs = 3 }
on_lock_lost = "abort"
[[job.phase]]
name = "a"
run = ["bin/a"]
[[periodic]]
name = "d"
every_secs = 60
class = "PlayguardJob"
for_each_member_of = "s"
"#,
        )
        .unwrap();
        assert_eq!(m.jobs.len(), 2);
        assert_eq!(m.jobs[1].phases[0].name, "a");
        assert_eq!(m.periodic[0].queue, "default");
    }

    #[test]
    fn errors_name_file_and_entry() {
        let e = load("[[job]]\nclass = \"A\"\nrun = []\n").unwrap_err();
        let s = e.to_string();
        assert!(
            s.contains("a.toml") && s.contains("class \"A\"") && s.contains("run"),
            "{s}"
        );
        let e = load("[[job]]\nclass = \"A\"\nrnu = [\"x\"]\n").unwrap_err();
        assert!(e.to_string().contains("rnu"), "{e}");
        let e = load("[[job]]\nclass = \"A\"\nrun=[\"x\"]\nlock = { key = \"k:{arg.0}\" }\n")
            .unwrap_err();
        assert!(e.to_string().contains("placeholder"), "{e}");
        let e = load("[[job]]\nclass = \"P\"\n[[job.phase]]\nname = \"a\"\nrun = [\"x\"]\n")
            .unwrap_err();
        assert!(e.to_string().contains("need a `lock`"), "{e}");
    }

    #[test]
    fn hooks_and_report_args_parse_and_bad_ones_are_named() {
        let m = load(
            "[[job]]\nclass = \"A\"\nrun = [\"x\"]\nreport_args = true\n\
             [[hook]]\non = \"death\"\nrun = [\"bin/page\", \"--team\", \"ops\"]\ntimeout_secs = 5\n",
        )
        .unwrap();
        assert!(m.jobs[0].report_args);
        assert_eq!(m.hooks[0].on, "death");
        assert_eq!(m.hooks[0].run, ["bin/page", "--team", "ops"]);
        let e = load("[[hook]]\non = \"dead\"\nrun = [\"x\"]\n").unwrap_err();
        assert!(
            e.to_string().contains("[[hook]] #1") && e.to_string().contains("lock_lost"),
            "{e}"
        );
        let e = load("[[hook]]\non = \"failure\"\nrun = []\n").unwrap_err();
        assert!(e.to_string().contains("run"), "{e}");
        let e = load("[[hook]]\non = \"poison\"\nrun = [\"x\"]\ntimeout_secs = 0\n").unwrap_err();
        assert!(e.to_string().contains("timeout_secs"), "{e}");
    }
}

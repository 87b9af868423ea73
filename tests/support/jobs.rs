//! The scratch project a worker runs in: a temp dir with `jobs/` manifests and executable job
//! scripts.

use std::path::{Path, PathBuf};

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

    /// Write an executable script.
    pub fn script(&self, rel: &str, content: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let p = self.write(rel, content);
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    }
}

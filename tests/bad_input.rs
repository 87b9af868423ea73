//! Bad input never breaks the worker or loses a job: each kind of broken payload gets one clear
//! log line and is kept (in `dead` or `retry`), and the process keeps running. Also: the shipped
//! demo phases refuse Marquee ids that are not plain identifiers.
//! Each test owns its redis-server; waits are conditions with deadlines, never timings.

mod support;

use std::process::Command;
use support::*;

/// Every shipped demo phase refuses a Marquee id with a path in it, before touching any file.
#[test]
fn demo_phases_refuse_marquee_ids_that_are_not_plain_identifiers() {
    let t = tempfile::tempdir().unwrap();
    let demo = t.path().join("a/demo");
    // A checkout left by an earlier run of Marquee "x": the path below climbs out of it.
    std::fs::create_dir_all(demo.join("seed-x")).unwrap();
    std::fs::create_dir_all(demo.join("marquee-x")).unwrap();
    let victim = t.path().join("victim");
    std::fs::create_dir_all(&victim).unwrap();
    std::fs::write(victim.join("keep"), "precious").unwrap();
    let bin = project_dir().join("jobs/bin");
    let mut phases: Vec<_> = std::fs::read_dir(&bin)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap() != "lib.sh")
        .collect();
    phases.sort();
    assert!(phases.len() >= 6, "{phases:?}");
    for bad in [
        r#"["x/../../../victim"]"#,
        r#"["a b"]"#,
        r#"["1","2"]"#,
        r#"[""]"#,
        r#"["$(id)"]"#,
        "[]",
    ] {
        for phase in &phases {
            let out = Command::new(phase)
                .env("PLAYGUARD_ARGS", bad)
                .env("PLAYGUARD_DEMO_DIR", &demo)
                .current_dir(t.path())
                .output()
                .unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(
                !out.status.success(),
                "{} accepted {bad}: {stderr}",
                phase.display()
            );
            assert!(
                stderr.contains("Marquee id"),
                "{} gave no clear reason for {bad}: {stderr}",
                phase.display()
            );
            assert_eq!(
                std::fs::read_to_string(victim.join("keep")).ok().as_deref(),
                Some("precious"),
                "{} touched a folder outside the demo dir for {bad}",
                phase.display()
            );
        }
    }
    assert!(!t.path().join("a/victim").exists() && !t.path().join("victim/repo").exists());
    // A plain id still works.
    let out = Command::new(bin.join("pull-images"))
        .env("PLAYGUARD_ARGS", r#"["m-7_x"]"#)
        .env("PLAYGUARD_DEMO_DIR", &demo)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = Command::new(bin.join("pull-images"))
        .env("PLAYGUARD_ARGS", "[7]")
        .env("PLAYGUARD_DEMO_DIR", &demo)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

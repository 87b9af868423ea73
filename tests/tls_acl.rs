//! `rediss://` (TLS) with a private CA, an ACL user and password, and a database number: the
//! worker connects, runs a job and counts it. The test owns its TLS redis-server.
mod support;

use std::process::{Child, Command, Stdio};
use std::time::Duration;
use support::*;

struct TlsRedis {
    child: Child,
    port: u16,
    dir: tempfile::TempDir,
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl TlsRedis {
    fn cli(&self, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(["--tls", "--cacert", "ca.pem", "-p", &self.port.to_string()])
            .args([
                "--user",
                "worker",
                "--pass",
                "s3cret",
                "-n",
                "2",
                "--no-auth-warning",
            ])
            .args(args)
            .current_dir(self.dir.path())
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }
}

fn start() -> Option<TlsRedis> {
    let dir = tempfile::tempdir().unwrap();
    // A private CA and a server certificate it signed (rustls refuses a CA as the end entity).
    let script = "set -e
openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 -subj /CN=test-ca
openssl req -newkey rsa:2048 -nodes -keyout key.pem -out server.csr -subj /CN=127.0.0.1
printf 'subjectAltName=IP:127.0.0.1\\n' > ext.cnf
openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 2 -extfile ext.cnf";
    let ok = Command::new("sh")
        .args(["-c", script])
        .current_dir(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !ok {
        eprintln!("skipping: openssl cannot make a test certificate");
        return None;
    }
    let port = free_port();
    let child = Command::new("redis-server")
        .args([
            "--port",
            "0",
            "--tls-port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
        ])
        .args([
            "--tls-cert-file",
            "server.pem",
            "--tls-key-file",
            "key.pem",
            "--tls-ca-cert-file",
            "ca.pem",
        ])
        .args([
            "--tls-auth-clients",
            "no",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .args(["--user", "worker", "on", ">s3cret", "~*", "&*", "+@all"])
        .args(["--user", "default", "off"])
        .current_dir(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server");
    let r = TlsRedis { child, port, dir };
    wait_until("TLS redis answers", Duration::from_secs(10), || {
        r.cli(&["PING"]) == "PONG"
    });
    Some(r)
}

#[test]
fn tls_acl_and_database_number() {
    let Some(r) = start() else { return };
    let url = format!("rediss://worker:s3cret@127.0.0.1:{}/2", r.port);
    let p = Project::with_jobs(&[("TlsJob", "ok", RECORD_RAN)]);
    let ca = r.dir.path().join("ca.pem");
    let enq = Command::new(bin())
        .args(["enqueue", "-r", &url, "TlsJob"])
        .env("PLAYGUARD_REDIS_CA", &ca)
        .output()
        .unwrap();
    assert_success(&enq);
    let mut w = Worker::builder_url(&url)
        .jobs(p.path())
        .env("PLAYGUARD_REDIS_CA", &ca)
        .start();
    wait_until("job ran over TLS", Duration::from_secs(20), || {
        p.path().join("ran.log").exists()
    });
    wait_until("counted in db 2", Duration::from_secs(20), || {
        r.cli(&["GET", "stat:processed"]) == "1"
    });
    w.signal("TERM");
    assert_eq!(w.wait(), Some(0));
    // Without the CA the server's certificate is refused (no silent downgrade) ...
    let no_ca = Command::new(bin())
        .args(["check", "-r", &url])
        .current_dir(p.path())
        .output()
        .unwrap();
    assert!(!no_ca.status.success());
    // ... unless verification is switched off explicitly.
    let insecure = Command::new(bin())
        .args(["check", "-r", &format!("{url}#insecure")])
        .current_dir(p.path())
        .output()
        .unwrap();
    assert_success(&insecure);
    // A wrong password is a clear error.
    let bad = Command::new(bin())
        .args([
            "check",
            "-r",
            &format!("rediss://worker:nope@127.0.0.1:{}/2#insecure", r.port),
        ])
        .current_dir(p.path())
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("cannot reach Redis"));
}

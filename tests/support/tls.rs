//! Throwaway certificate authorities and server certificates made with `openssl` in a temp dir,
//! for the TLS tests (PostgreSQL's server certificate, the clients' root CA).

use std::path::{Path, PathBuf};
use std::process::Command;

/// `openssl` in `dir`; panics with its error output.
fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run openssl (apt-get install openssl)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A throwaway CA in `dir`: `NAME.key` and `NAME.crt` (P-256, valid two days).
pub fn make_ca(dir: &Path, name: &str) -> PathBuf {
    let (key, crt) = (format!("{name}.key"), format!("{name}.crt"));
    let subject = format!("/CN=playguard-test-{name}");
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &crt,
            "-days",
            "2",
            "-subj",
            &subject,
        ],
    );
    dir.join(crt)
}

/// `NAME.key` and `NAME.crt` in `dir`, signed by the CA `ca` (see [`make_ca`]), for the names
/// in `sans` (`"IP:127.0.0.1,DNS:localhost"`).
pub fn make_server_cert(dir: &Path, ca: &str, name: &str, sans: &str) -> PathBuf {
    let (key, csr, crt, ext) = (
        format!("{name}.key"),
        format!("{name}.csr"),
        format!("{name}.crt"),
        format!("{name}.ext"),
    );
    let (ca_crt, ca_key) = (format!("{ca}.crt"), format!("{ca}.key"));
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            "/CN=playguard-test-server",
        ],
    );
    std::fs::write(dir.join(&ext), format!("subjectAltName={sans}\n")).unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &ca_crt,
            "-CAkey",
            &ca_key,
            "-CAcreateserial",
            "-out",
            &crt,
            "-days",
            "2",
            "-extfile",
            &ext,
        ],
    );
    dir.join(crt)
}

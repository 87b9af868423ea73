//! TLS to the application's PostgreSQL, with `sslmode` and `sslrootcert` as libpq understands
//! them. tokio-postgres knows only disable/prefer/require and refuses `sslrootcert`, so both
//! are taken out of the database URL here (the rest is left as written) and turned into a
//! rustls connector. Touches no Redis keys and no tables.
//!
//! | sslmode           | TLS                                 | certificate checked            |
//! |-------------------|-------------------------------------|--------------------------------|
//! | `disable`         | never                               | -                              |
//! | `allow`, `prefer` | tried; plain if the server has none | chain, when a root CA is known |
//! | `require`         | always                              | chain, when a root CA is known |
//! | `verify-ca`       | always                              | chain (a root CA is needed)    |
//! | `verify-full`     | always                              | chain and host name (likewise) |
//!
//! The root CA is `sslrootcert` (a PEM file, or `system` for the public roots, which demands
//! `verify-full`), else `$PGSSLROOTCERT`, else `~/.postgresql/root.crt` when it exists.

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, WebPkiSupportedAlgorithms};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::ParsedCertificate;
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use std::path::PathBuf;
use std::sync::Arc;
use tokio_postgres::config::SslMode as PgSslMode;
use tokio_postgres_rustls::MakeRustlsConnect;

/// libpq's six modes (`allow` is tried as `prefer`: TLS first, plain when the server has none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    Disable,
    Allow,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl SslMode {
    fn parse(s: &str) -> Result<SslMode, String> {
        Ok(match s {
            "disable" => SslMode::Disable,
            "allow" => SslMode::Allow,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            other => {
                return Err(format!(
                    "invalid sslmode {other:?} (disable, allow, prefer, require, verify-ca or verify-full)"
                ))
            }
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Allow => "allow",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }

    /// What tokio-postgres is told: whether TLS may be skipped when the server has none.
    pub fn pg_mode(self) -> PgSslMode {
        match self {
            SslMode::Disable => PgSslMode::Disable,
            SslMode::Allow | SslMode::Prefer => PgSslMode::Prefer,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => PgSslMode::Require,
        }
    }
}

/// Where the certificates that may sign the server's come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Roots {
    /// None known: the certificate is not checked (`prefer`, `require`).
    Unknown,
    /// A PEM file of one or more CA certificates.
    File(PathBuf),
    /// The public roots (webpki-roots, Mozilla's list), for `sslrootcert=system`.
    System,
}

/// The TLS part of a database URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsSettings {
    pub mode: SslMode,
    pub roots: Roots,
}

/// libpq's other TLS settings (client certificates, revocation lists, protocol bounds).
const UNSUPPORTED: [&str; 11] = [
    "sslcert",
    "sslkey",
    "sslpassword",
    "sslcertmode",
    "sslcrl",
    "sslcrldir",
    "sslsni",
    "sslcompression",
    "ssl_min_protocol_version",
    "ssl_max_protocol_version",
    "requiressl",
];

/// Split `url` into what tokio-postgres parses (everything but `sslmode` and `sslrootcert`,
/// as written) and the TLS settings, with libpq's defaults and environment variables
/// (`PGSSLMODE`, `PGSSLROOTCERT`, `HOME`) read through `env`. Errors name no part of the URL.
pub fn split_url(
    url: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<(String, TlsSettings), String> {
    let mut keys = vec!["sslmode", "sslrootcert"];
    keys.extend(UNSUPPORTED);
    let (rest, mut params) = take_params(url, &keys);
    if let Some(k) = UNSUPPORTED.iter().find(|k| params.contains_key(**k)) {
        // tokio-postgres would say only "invalid connection string".
        return Err(format!(
            "{k} is not supported (of libpq's TLS settings playguard understands sslmode and sslrootcert)"
        ));
    }
    let sslmode = params.remove("sslmode").or_else(|| env("PGSSLMODE"));
    let rootcert = params
        .remove("sslrootcert")
        .or_else(|| env("PGSSLROOTCERT"))
        .filter(|s| !s.is_empty());
    let system = rootcert.as_deref() == Some("system");
    let mode = match sslmode.as_deref() {
        Some(m) => SslMode::parse(m)?,
        // libpq: the public roots vouch for any name, so with them only verify-full means much.
        None if system => SslMode::VerifyFull,
        None => SslMode::Prefer,
    };
    if system && mode != SslMode::VerifyFull {
        return Err(format!(
            "weak sslmode \"{}\" may not be used with sslrootcert=system (use \"verify-full\")",
            mode.as_str()
        ));
    }
    let roots = match rootcert {
        _ if mode == SslMode::Disable => Roots::Unknown,
        Some(_) if system => Roots::System,
        // A file named on purpose must be there (libpq would quietly skip a missing one).
        Some(path) => Roots::File(PathBuf::from(path)),
        None => match env("HOME").map(|h| PathBuf::from(h).join(".postgresql/root.crt")) {
            Some(p) if p.is_file() => Roots::File(p),
            _ => Roots::Unknown,
        },
    };
    if roots == Roots::Unknown && matches!(mode, SslMode::VerifyCa | SslMode::VerifyFull) {
        return Err(format!(
            "sslmode={} needs a root certificate: set sslrootcert=<CA file> (or PGSSLROOTCERT, or \
             ~/.postgresql/root.crt), use the public roots with sslrootcert=system, or choose \
             sslmode=require to skip checking the server's certificate",
            mode.as_str()
        ));
    }
    Ok((rest, TlsSettings { mode, roots }))
}

impl TlsSettings {
    /// The rustls connector for these settings; `None` for `disable`.
    pub fn connector(&self) -> Result<Option<MakeRustlsConnect>, String> {
        if self.mode == SslMode::Disable {
            return Ok(None);
        }
        let roots = match &self.roots {
            Roots::Unknown => None,
            Roots::System => Some(RootCertStore {
                roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
            }),
            Roots::File(path) => Some(read_roots(path)?),
        };
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = Verifier {
            algorithms: provider.signature_verification_algorithms,
            roots: roots.map(Arc::new),
            check_name: self.mode == SslMode::VerifyFull,
        };
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS set-up: {e}"))?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_no_client_auth();
        Ok(Some(MakeRustlsConnect::new(config)))
    }
}

fn read_roots(path: &std::path::Path) -> Result<RootCertStore, String> {
    let shown = path.display();
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<_, _>>())
        .map_err(|e| format!("cannot read root certificate file {shown} (sslrootcert): {e}"))?;
    let mut store = RootCertStore::empty();
    let (added, _ignored) = store.add_parsable_certificates(certs);
    if added == 0 {
        return Err(format!(
            "root certificate file {shown} (sslrootcert) holds no usable certificate"
        ));
    }
    Ok(store)
}

/// libpq's checks: with a root CA, the chain must lead to it, and for verify-full the
/// certificate must name the host; without one (prefer, require) nothing is checked. The
/// handshake signature is always checked, so the server still proves it holds the key.
#[derive(Debug)]
struct Verifier {
    algorithms: WebPkiSupportedAlgorithms,
    roots: Option<Arc<RootCertStore>>,
    check_name: bool,
}

/// The TLS 1.2 and 1.3 signature checks of a verifier: each hands its arguments to rustls'
/// function of the same name with the provider's algorithms (the trait wants both spelled out).
macro_rules! verify_signatures_with {
    ($($name:ident),*) => {$(
        fn $name(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            $name(message, cert, dss, &self.algorithms)
        }
    )*};
}

impl ServerCertVerifier for Verifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let Some(roots) = &self.roots else {
            return Ok(ServerCertVerified::assertion());
        };
        let cert = ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &cert,
            roots,
            intermediates,
            now,
            self.algorithms.all,
        )?;
        if self.check_name {
            rustls::client::verify_server_name(&cert, server_name)?;
        }
        Ok(ServerCertVerified::assertion())
    }

    verify_signatures_with!(verify_tls12_signature, verify_tls13_signature);

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

/// A few words on a certificate check that failed, for the error line (rustls' own words,
/// such as `UnknownIssuer`, do not say which setting is involved).
pub fn hint(e: &tokio_postgres::Error) -> Option<&'static str> {
    use rustls::CertificateError as C;
    let io = std::error::Error::source(e)?.downcast_ref::<std::io::Error>()?;
    match io.get_ref()?.downcast_ref::<rustls::Error>()? {
        rustls::Error::InvalidCertificate(C::UnknownIssuer) => {
            Some("the server's certificate is not signed by the root CA of sslrootcert")
        }
        rustls::Error::InvalidCertificate(
            C::NotValidForName | C::NotValidForNameContext { .. },
        ) => Some("sslmode=verify-full wants the host name of the URL in the server's certificate"),
        _ => None,
    }
}

/// `url` without the parameters named in `keys`, and their (decoded) values. A
/// `postgres://` URL's query string and a libpq `key=value` string are both understood; the
/// parameters kept are passed on unchanged.
fn take_params(url: &str, keys: &[&str]) -> (String, std::collections::HashMap<String, String>) {
    let mut taken = std::collections::HashMap::new();
    let is_url = url.starts_with("postgres://") || url.starts_with("postgresql://");
    if is_url {
        let Some((head, query)) = url.split_once('?') else {
            return (url.to_string(), taken);
        };
        let kept: Vec<&str> = query
            .split('&')
            .filter(|pair| {
                let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
                let k = percent_decode(k);
                if keys.contains(&k.as_str()) {
                    taken.insert(k, percent_decode(v));
                    false
                } else {
                    true
                }
            })
            .collect();
        let rest = if kept.is_empty() {
            head.to_string()
        } else {
            format!("{head}?{}", kept.join("&"))
        };
        return (rest, taken);
    }
    // key=value form; if it does not tokenize, tokio-postgres reports the error itself.
    let Some(pairs) = keyword_pairs(url) else {
        return (url.to_string(), taken);
    };
    let mut kept = Vec::new();
    for (k, v) in pairs {
        if keys.contains(&k.as_str()) {
            taken.insert(k, v);
        } else {
            let quoted = v.replace('\\', "\\\\").replace('\'', "\\'");
            kept.push(format!("{k}='{quoted}'"));
        }
    }
    (kept.join(" "), taken)
}

/// libpq's `key = value` list: values bare or in single quotes, `\` escaping the next char.
fn keyword_pairs(s: &str) -> Option<Vec<(String, String)>> {
    let mut pairs = Vec::new();
    let mut it = s.chars().peekable();
    loop {
        while it.next_if(|c| c.is_whitespace()).is_some() {}
        if it.peek().is_none() {
            return Some(pairs);
        }
        let mut key = String::new();
        while let Some(c) = it.next_if(|c| !c.is_whitespace() && *c != '=') {
            key.push(c);
        }
        while it.next_if(|c| c.is_whitespace()).is_some() {}
        if it.next() != Some('=') || key.is_empty() {
            return None;
        }
        while it.next_if(|c| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        if it.next_if_eq(&'\'').is_some() {
            loop {
                match it.next()? {
                    '\'' => break,
                    '\\' => value.push(it.next()?),
                    c => value.push(c),
                }
            }
        } else {
            while let Some(c) = it.next_if(|c| !c.is_whitespace()) {
                if c == '\\' {
                    value.push(it.next()?);
                } else {
                    value.push(c);
                }
            }
        }
        pairs.push((key, value));
    }
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    fn split(url: &str) -> Result<(String, TlsSettings), String> {
        split_url(url, &no_env)
    }

    #[test]
    fn libpq_modes_are_taken_out_of_the_url_and_the_rest_is_kept() {
        let (rest, s) = split("postgres://u:pw@h/d?sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem&application_name=x").unwrap();
        assert_eq!(rest, "postgres://u:pw@h/d?application_name=x");
        assert_eq!(s.mode, SslMode::VerifyFull);
        assert_eq!(s.roots, Roots::File("/etc/ca.pem".into()));
        let (rest, s) = split("postgres://u@h/d?sslmode=require").unwrap();
        assert_eq!(rest, "postgres://u@h/d");
        assert_eq!((s.mode, s.roots), (SslMode::Require, Roots::Unknown));
        assert_eq!(s.mode.pg_mode(), PgSslMode::Require);
        let (_, s) = split("postgres://h/d").unwrap();
        assert_eq!(s.mode, SslMode::Prefer);
        assert_eq!(
            split("postgres://h/d?sslmode=allow")
                .unwrap()
                .1
                .mode
                .pg_mode(),
            PgSslMode::Prefer
        );
        assert!(split("postgres://h/d?sslmode=sometimes").is_err());
        let e = split("postgres://h/d?sslmode=require&sslcert=c.pem").unwrap_err();
        assert!(e.contains("sslcert is not supported"), "{e}");
    }

    #[test]
    fn keyword_strings_are_understood_too() {
        let (rest, s) =
            split("host=h user=u password='p w\\'x' sslmode = verify-ca sslrootcert='/a b.pem'")
                .unwrap();
        assert_eq!(rest, "host='h' user='u' password='p w\\'x'");
        assert_eq!(s.mode, SslMode::VerifyCa);
        assert_eq!(s.roots, Roots::File("/a b.pem".into()));
        let c: tokio_postgres::Config = rest.parse().unwrap();
        assert_eq!(c.get_password(), Some(&b"p w'x"[..]));
    }

    #[test]
    fn verification_needs_a_root_and_system_roots_need_verify_full() {
        let e = split("postgres://h/d?sslmode=verify-full").unwrap_err();
        assert!(e.contains("sslrootcert"), "{e}");
        let (_, s) = split("postgres://h/d?sslrootcert=system").unwrap();
        assert_eq!((s.mode, s.roots), (SslMode::VerifyFull, Roots::System));
        let e = split("postgres://h/d?sslrootcert=system&sslmode=require").unwrap_err();
        assert!(e.contains("verify-full"), "{e}");
    }

    #[test]
    fn environment_fills_in_what_the_url_leaves_out() {
        let env = |k: &str| match k {
            "PGSSLMODE" => Some("verify-ca".to_string()),
            "PGSSLROOTCERT" => Some("/ca.pem".to_string()),
            _ => None,
        };
        let (_, s) = split_url("postgres://h/d", &env).unwrap();
        assert_eq!(
            (s.mode, s.roots),
            (SslMode::VerifyCa, Roots::File("/ca.pem".into()))
        );
        let (_, s) = split_url("postgres://h/d?sslmode=disable", &env).unwrap();
        assert_eq!(
            (s.mode, s.roots.clone()),
            (SslMode::Disable, Roots::Unknown)
        );
        assert!(s.connector().unwrap().is_none());
    }

    #[test]
    fn a_missing_root_file_is_a_clear_error() {
        let (_, s) =
            split("postgres://h/d?sslmode=require&sslrootcert=/nonexistent/ca.pem").unwrap();
        let e = s.connector().err().unwrap();
        assert!(
            e.contains("/nonexistent/ca.pem") && e.contains("sslrootcert"),
            "{e}"
        );
    }
}

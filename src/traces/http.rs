//! The OTLP exporter's HTTP client: the ureq agent the tree already has for Sentry (rustls,
//! ring), so the exporter needs neither reqwest nor hyper. It runs on the SDK's batch thread,
//! never on a job's. Touches no Redis keys.

use bytes::Bytes;
use http::{Request, Response};
use opentelemetry_http::{HttpClient, HttpError};
use std::time::Duration;

#[derive(Debug)]
pub(super) struct Ureq(ureq::Agent);

impl Ureq {
    /// `timeout` bounds a whole request: a collector that accepts and never answers holds the
    /// batch thread that long, and no job at all.
    pub(super) fn new(timeout: Duration) -> Ureq {
        let tls = ureq::tls::TlsConfig::builder()
            .provider(ureq::tls::TlsProvider::Rustls)
            .build();
        let agent = ureq::Agent::config_builder()
            .tls_config(tls)
            .timeout_global(Some(timeout))
            // The exporter reads the status itself (a 4xx/5xx is its error to report).
            .http_status_as_error(false)
            .build()
            .new_agent();
        Ureq(agent)
    }
}

#[async_trait::async_trait]
impl HttpClient for Ureq {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let (parts, body) = request.into_parts();
        let mut reply = self.0.run(Request::from_parts(parts, body.to_vec()))?;
        let body = reply.body_mut().read_to_vec()?;
        let mut out = Response::builder().status(reply.status());
        for (k, v) in reply.headers() {
            out = out.header(k, v);
        }
        Ok(out.body(Bytes::from(body))?)
    }
}

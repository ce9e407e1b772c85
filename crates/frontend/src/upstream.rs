//! The engines' side: `POST {base_url}/v1/completions` over pooled HTTP/1.1 connections,
//! and which failures are worth routing around.

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{HeaderName, HeaderValue, CONTENT_TYPE};
use hyper::{Request, Response};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use std::time::Duration;

/// How much of an engine's error body is kept for the message.
const MAX_ERROR_BODY: usize = 64 << 10;

#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// The worker registered no HTTP address, or one this frontend cannot call.
    #[error("{0}")]
    BadUrl(String),
    /// Nothing accepted the connection.
    #[error("cannot connect to {url}: {reason}")]
    Connect { url: String, reason: String },
    /// The connection broke before an answer.
    #[error("{url} failed before answering: {reason}")]
    Broken { url: String, reason: String },
    #[error("{url} answered nothing within {after:?}")]
    Timeout { url: String, after: Duration },
    /// The engine answered with an error status.
    #[error("{url} answered {status}: {body}")]
    Status {
        url: String,
        status: u16,
        body: String,
    },
}

impl UpstreamError {
    /// Worth another worker: the engine is down, broken or failing (5xx), not refusing
    /// the request itself (4xx).
    pub fn route_around(&self) -> bool {
        match self {
            Self::Status { status, .. } => *status >= 500,
            _ => true,
        }
    }
}

/// A pooled HTTP/1.1 client for the engines.
#[derive(Clone)]
pub struct Upstream {
    client: Client<HttpConnector, Full<Bytes>>,
    connect_timeout: Duration,
}

impl Upstream {
    pub fn new(connect_timeout: Duration) -> Self {
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        http.set_connect_timeout(Some(connect_timeout));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .build(http);
        Self {
            client,
            connect_timeout,
        }
    }

    /// Posts `body` to the engine's completions endpoint and waits (at most `timeout`) for
    /// the answer's head. A non-2xx answer is an error carrying the engine's message.
    pub async fn completions(
        &self,
        base_url: &str,
        headers: &[(HeaderName, HeaderValue)],
        body: Bytes,
        timeout: Duration,
    ) -> Result<Response<Incoming>, UpstreamError> {
        let url = completions_url(base_url)?;
        let mut req = Request::post(&url)
            .header(CONTENT_TYPE, "application/json")
            .body(Full::new(body))
            .map_err(|e| UpstreamError::BadUrl(format!("bad engine URL {url:?}: {e}")))?;
        for (k, v) in headers {
            req.headers_mut().insert(k.clone(), v.clone());
        }
        let res = match tokio::time::timeout(timeout, self.client.request(req)).await {
            Err(_) => {
                return Err(UpstreamError::Timeout {
                    url,
                    after: timeout,
                })
            }
            Ok(Err(e)) if e.is_connect() => {
                let reason = error_chain(&e);
                return Err(UpstreamError::Connect { url, reason });
            }
            Ok(Err(e)) => {
                let reason = error_chain(&e);
                return Err(UpstreamError::Broken { url, reason });
            }
            Ok(Ok(res)) => res,
        };
        if res.status().is_success() {
            return Ok(res);
        }
        let status = res.status().as_u16();
        let body = match tokio::time::timeout(
            self.connect_timeout,
            Limited::new(res.into_body(), MAX_ERROR_BODY).collect(),
        )
        .await
        {
            Ok(Ok(b)) => String::from_utf8_lossy(&b.to_bytes()).into_owned(),
            _ => String::new(),
        };
        Err(UpstreamError::Status { url, status, body })
    }
}

fn completions_url(base_url: &str) -> Result<String, UpstreamError> {
    if base_url.is_empty() {
        return Err(UpstreamError::BadUrl(
            "the worker registered no HTTP address (a mocker without --emulate, or a bridge \
             without --engine-url?)"
                .into(),
        ));
    }
    if !base_url.starts_with("http://") {
        return Err(UpstreamError::BadUrl(format!(
            "the worker's address {base_url:?} is not http:// (TLS to engines is not supported)"
        )));
    }
    let base = base_url.trim_end_matches('/');
    let base = base.strip_suffix("/v1").unwrap_or(base);
    Ok(format!("{base}/v1/completions"))
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        source = inner.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert_eq!(
            completions_url("http://10.0.0.5:8000").unwrap(),
            "http://10.0.0.5:8000/v1/completions"
        );
        assert_eq!(
            completions_url("http://h:1/v1/").unwrap(),
            "http://h:1/v1/completions"
        );
        assert!(completions_url("").is_err());
        assert!(completions_url("https://h").is_err());
    }

    #[test]
    fn only_engine_failures_are_routed_around() {
        let status = |status| UpstreamError::Status {
            url: "u".into(),
            status,
            body: String::new(),
        };
        assert!(status(500).route_around());
        assert!(status(503).route_around());
        assert!(!status(400).route_around());
        assert!(!status(404).route_around());
        let refused = UpstreamError::Connect {
            url: "u".into(),
            reason: "refused".into(),
        };
        assert!(refused.route_around());
    }

    #[tokio::test]
    async fn a_closed_port_is_a_connect_error() {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let up = Upstream::new(Duration::from_secs(1));
        let e = up
            .completions(
                &format!("http://127.0.0.1:{port}"),
                &[],
                Bytes::from_static(b"{}"),
                Duration::from_secs(2),
            )
            .await
            .unwrap_err();
        assert!(matches!(e, UpstreamError::Connect { .. }), "{e:?}");
    }
}

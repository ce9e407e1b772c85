//! The admin HTTP endpoint every long-running kvrouter process serves: `/healthz` (the
//! process runs), `/readyz` (it can do its job; the body says why not), `/metrics`
//! (OpenMetrics text), whatever `/debug/...` pages the process offers, and its JSON API
//! under `/v1/` (any method; the body is read here, within [`AdminView::max_body_bytes`],
//! before the view sees it).

mod http_server;

pub use http_server::{
    append_http_stats, read_body, BodyBudget, BodyError, BudgetHold, HttpLimits, HttpServer,
    HttpStats,
};

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
pub use hyper::Method;
use hyper::{Request, Response, StatusCode};
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;

/// A `/debug/...` page being produced: (HTTP status, JSON body).
pub type DebugPage = Pin<Box<dyn Future<Output = (u16, String)> + Send>>;

/// Where the JSON API lives: every path under it goes to [`AdminView::api`].
pub const API_PREFIX: &str = "/v1/";

/// The largest API request body a view accepts unless it says otherwise.
pub const DEFAULT_MAX_BODY_BYTES: usize = 64 * 1024;

/// One JSON API request, its body already read (and within the view's limit).
#[derive(Clone, Debug)]
pub struct ApiRequest {
    pub method: Method,
    /// The whole path, `/v1/...` included, not percent-decoded.
    pub path: String,
    /// The raw query string (empty when none).
    pub query: String,
    pub body: Bytes,
}

/// A JSON API answer: status, extra headers (the content type is always JSON), body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiResponse {
    pub status: u16,
    pub headers: Vec<(&'static str, String)>,
    pub body: String,
}

impl ApiResponse {
    pub fn json(status: u16, body: String) -> Self {
        Self {
            status,
            headers: Vec::new(),
            body,
        }
    }

    /// `{"error":{"kind":KIND,"message":MESSAGE}}` with `status`.
    pub fn error(status: u16, kind: &str, message: &str) -> Self {
        let body = serde_json::json!({ "error": { "kind": kind, "message": message } });
        Self::json(status, body.to_string())
    }

    pub fn with_header(mut self, name: &'static str, value: impl Into<String>) -> Self {
        self.headers.push((name, value.into()));
        self
    }
}

/// A JSON API answer being produced.
pub type ApiPage = Pin<Box<dyn Future<Output = ApiResponse> + Send>>;

/// What the admin endpoint shows.
pub trait AdminView: Send + Sync + 'static {
    /// Ready or not, and a one-line reason either way.
    fn readiness(&self) -> (bool, String);
    /// The metrics, rendered as OpenMetrics text.
    fn metrics(&self) -> String;

    /// A `/debug/...` page: `path` after `/debug/`, the raw query string; `None` when there is
    /// no such page. Answers (status, JSON body).
    fn debug(self: Arc<Self>, path: String, query: String) -> Option<DebugPage> {
        let _ = (path, query);
        None
    }

    /// A JSON API request (a path under [`API_PREFIX`]); `None` when there is no such
    /// endpoint (answered 404).
    fn api(self: Arc<Self>, req: ApiRequest) -> Option<ApiPage> {
        let _ = req;
        None
    }

    /// The largest API request body accepted; a longer one is answered 413 unread.
    fn max_body_bytes(&self) -> usize {
        DEFAULT_MAX_BODY_BYTES
    }
}

/// The value of `key` in a query string (`a=1&b=2`; no percent-decoding).
pub fn query_param<'a>(query: &'a str, key: &str) -> Option<&'a str> {
    query
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v)
}

/// Decodes `%XX` escapes (a `%` not followed by two hex digits stays as it is); `None` when
/// the result is not UTF-8.
pub fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |j: usize| b.get(j).and_then(|&c| (c as char).to_digit(16));
        match (b[i], hex(i + 1), hex(i + 2)) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (c, ..) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

fn respond(status: StatusCode, content_type: &str, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    if let Ok(v) = content_type.parse() {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    r
}

fn respond_api(r: ApiResponse) -> Response<Full<Bytes>> {
    let status = StatusCode::from_u16(r.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut resp = respond(status, "application/json", r.body);
    for (name, value) in r.headers {
        if let Ok(v) = value.parse() {
            resp.headers_mut().insert(name, v);
        }
    }
    resp
}

async fn handle_api(
    view: Arc<dyn AdminView>,
    req: Request<Incoming>,
    body_timeout: Duration,
) -> ApiResponse {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    let body = match read_body(req, view.max_body_bytes(), body_timeout).await {
        Ok(b) => b,
        Err(e) => {
            let kind = match e {
                BodyError::Read(_) => "malformed",
                _ => "invalid_request",
            };
            return ApiResponse::error(e.status(), kind, &e.to_string());
        }
    };
    let req = ApiRequest {
        method,
        path,
        query,
        body,
    };
    let what = format!("{} {}", req.method, req.path);
    match view.api(req) {
        Some(page) => page.await,
        None => ApiResponse::error(404, "invalid_request", &format!("no such endpoint: {what}")),
    }
}

async fn handle(
    view: Arc<dyn AdminView>,
    req: Request<Incoming>,
    body_timeout: Duration,
) -> Response<Full<Bytes>> {
    if req.uri().path().starts_with(API_PREFIX) {
        return respond_api(handle_api(view, req, body_timeout).await);
    }
    if let Some(page) = req.uri().path().strip_prefix("/debug/") {
        let query = req.uri().query().unwrap_or("").to_string();
        return match view.debug(page.to_string(), query) {
            Some(f) => {
                let (status, body) = f.await;
                let status = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
                respond(status, "application/json", body)
            }
            None => respond(
                StatusCode::NOT_FOUND,
                "text/plain",
                "no such debug page\n".into(),
            ),
        };
    }
    handle_plain(&*view, &req)
}

fn handle_plain(view: &dyn AdminView, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return respond(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "only GET\n".into(),
        );
    }
    match req.uri().path() {
        "/healthz" => respond(StatusCode::OK, "text/plain", "ok\n".into()),
        "/readyz" => {
            let (ready, why) = view.readiness();
            let status = if ready {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            respond(status, "text/plain", format!("{why}\n"))
        }
        "/metrics" => respond(
            StatusCode::OK,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            view.metrics(),
        ),
        _ => respond(
            StatusCode::NOT_FOUND,
            "text/plain",
            "not found: try /healthz, /readyz or /metrics\n".into(),
        ),
    }
}

/// Binds `addr` and serves within `limits` until the task is aborted, which also ends every
/// open connection. Returns the bound address (useful with port 0) and the listener's
/// connection counts (for the process's metrics).
pub async fn serve(
    addr: SocketAddr,
    limits: HttpLimits,
    view: Arc<dyn AdminView>,
) -> std::io::Result<(SocketAddr, Arc<HttpStats>, JoinHandle<()>)> {
    let body_timeout = limits.body_timeout;
    let server = HttpServer::bind(addr, limits, "admin", move |req| {
        handle(view.clone(), req, body_timeout)
    })
    .await?;
    Ok((
        server.addr,
        server.stats.clone(),
        tokio::spawn(server.run_until_aborted()),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// Echoes the API request; answers 503 with `Retry-After` on `/v1/busy`.
    struct Echo;

    impl AdminView for Echo {
        fn readiness(&self) -> (bool, String) {
            (true, "ready".into())
        }

        fn metrics(&self) -> String {
            String::new()
        }

        fn api(self: Arc<Self>, req: ApiRequest) -> Option<ApiPage> {
            match req.path.as_str() {
                "/v1/echo" => Some(Box::pin(async move {
                    let body = serde_json::json!({
                        "method": req.method.as_str(),
                        "query": req.query,
                        "body": String::from_utf8_lossy(&req.body),
                    });
                    ApiResponse::json(200, body.to_string())
                })),
                "/v1/busy" => Some(Box::pin(async {
                    ApiResponse::error(503, "overloaded", "busy").with_header("retry-after", "1")
                })),
                _ => None,
            }
        }

        fn max_body_bytes(&self) -> usize {
            16
        }
    }

    /// Sends raw bytes, returns the whole answer.
    async fn call(addr: SocketAddr, raw: String) -> String {
        tokio::task::spawn_blocking(move || {
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            s.write_all(raw.as_bytes()).unwrap();
            let mut out = String::new();
            let _ = s.read_to_string(&mut out);
            out
        })
        .await
        .unwrap()
    }

    fn post(path: &str, body: &str) -> String {
        format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
    }

    #[tokio::test]
    async fn api_paths_reach_the_view_within_the_body_limit() {
        let (addr, _, task) = serve(
            "127.0.0.1:0".parse().unwrap(),
            HttpLimits::default(),
            Arc::new(Echo),
        )
        .await
        .unwrap();
        let ok = call(addr, post("/v1/echo?a=1", "{\"x\":1}")).await;
        assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
        assert!(ok.contains("content-type: application/json"), "{ok}");
        assert!(ok.contains(r#""body":"{\"x\":1}""#) && ok.contains(r#""query":"a=1""#));
        assert!(ok.contains(r#""method":"POST""#), "{ok}");

        // Over the limit by its Content-Length: refused unread.
        let big = call(addr, post("/v1/echo", &"x".repeat(17))).await;
        assert!(big.starts_with("HTTP/1.1 413"), "{big}");
        assert!(
            big.contains(
                r#"{"error":{"kind":"invalid_request","message":"the request body is over 16 bytes"}}"#
            ),
            "{big}"
        );
        // Over the limit without a length (chunked): refused once the limit is passed.
        let chunked = format!(
            "POST /v1/echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n11\r\n{}\r\n0\r\n\r\n",
            "y".repeat(17)
        );
        let big = call(addr, chunked).await;
        assert!(big.starts_with("HTTP/1.1 413"), "{big}");
        // Exactly at the limit is fine.
        let at = call(addr, post("/v1/echo", &"z".repeat(16))).await;
        assert!(at.starts_with("HTTP/1.1 200"), "{at}");

        let none = call(addr, post("/v1/nope", "")).await;
        assert!(none.starts_with("HTTP/1.1 404"), "{none}");
        assert!(none.contains("no such endpoint: POST /v1/nope"), "{none}");
        let busy = call(addr, post("/v1/busy", "")).await;
        assert!(busy.starts_with("HTTP/1.1 503") && busy.contains("retry-after: 1"));

        // The rest is as before.
        let get = |p: &str| format!("GET {p} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        assert!(call(addr, get("/healthz"))
            .await
            .starts_with("HTTP/1.1 200"));
        assert!(call(addr, post("/healthz", ""))
            .await
            .starts_with("HTTP/1.1 405"));
        assert!(call(addr, get("/debug/x"))
            .await
            .starts_with("HTTP/1.1 404"));
        task.abort();
    }

    #[tokio::test]
    async fn aborting_the_listener_ends_open_connections() {
        let (addr, _, task) = serve(
            "127.0.0.1:0".parse().unwrap(),
            HttpLimits::default(),
            Arc::new(Echo),
        )
        .await
        .unwrap();
        // A keep-alive connection, idle after one answer.
        let reader = tokio::task::spawn_blocking(move || {
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                .unwrap();
            let mut out = Vec::new();
            let _ = s.read_to_end(&mut out); // returns once the server closes it
            String::from_utf8_lossy(&out).to_string()
        });
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        task.abort();
        let out = tokio::time::timeout(std::time::Duration::from_secs(5), reader)
            .await
            .expect("the connection is closed with the listener")
            .unwrap();
        assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    }

    #[test]
    fn percent_decoding() {
        assert_eq!(
            percent_decode("Qwen%2FQwen3-0.6B").unwrap(),
            "Qwen/Qwen3-0.6B"
        );
        assert_eq!(percent_decode("a%2fb%20c").unwrap(), "a/b c");
        assert_eq!(percent_decode("100%").unwrap(), "100%");
        assert_eq!(percent_decode("%zz%4").unwrap(), "%zz%4");
        assert_eq!(percent_decode("%e2%9c%93").unwrap(), "✓");
        assert!(percent_decode("%ff").is_none(), "not UTF-8");
    }
}

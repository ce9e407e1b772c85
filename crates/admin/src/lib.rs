//! The admin HTTP endpoint every long-running kvrouter process serves: `/healthz` (the
//! process runs), `/readyz` (it can do its job; the body says why not), `/metrics`
//! (OpenMetrics text), whatever `/debug/...` pages the process offers, and its JSON API
//! under `/v1/` (any method; the body is read here, within [`AdminView::max_body_bytes`],
//! before the view sees it).
//!
//! With credentials configured ([`HttpLimits::auth`]), a call to `/v1/...` needs the scope
//! the view names for it ([`AdminView::api_scope`]), `/debug/...` the `debug` scope, and
//! `/metrics` the `metrics` scope when the operator guards it; `/healthz` and `/readyz` stay
//! open (probes). The check comes before the body is read.

pub mod auth;
mod http_server;
pub mod phase_timing;
pub mod secret;
pub mod tls;

pub use auth::{HttpAuth, Refusal, Scope, Scopes};
pub use tls::{ServerTls, TlsFiles};

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

/// The debug page of the phase-timing switch ([`AdminView::phase_switch`]).
pub const PHASE_TIMING_PAGE: &str = "phase-timing";

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
    /// The `traceparent` header, as sent (the API parses it; a malformed one is ignored).
    pub traceparent: Option<String>,
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

    /// The process's phase-timing switch, served at `/debug/phase-timing` (`?set=on|off`)
    /// when it has one.
    fn phase_switch(&self) -> Option<&phase_timing::PhaseSwitch> {
        None
    }

    /// A JSON API request (a path under [`API_PREFIX`]); `None` when there is no such
    /// endpoint (answered 404). Asked only for paths [`AdminView::api_scope`] names a scope
    /// for.
    fn api(self: Arc<Self>, req: ApiRequest) -> Option<ApiPage> {
        let _ = req;
        None
    }

    /// The scope a caller needs for an API path; `None` when the path is no endpoint (a
    /// known caller gets 404, and [`AdminView::api`] is not asked). A view that serves an
    /// API names a scope for each of its paths.
    fn api_scope(&self, path: &str) -> Option<Scope> {
        let _ = path;
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

/// The typed JSON answer to a refused call, counted and logged (never with the token).
fn refuse(stats: &HttpStats, why: Refusal, path: &str) -> ApiResponse {
    stats.refused_call(why);
    tracing::debug!(
        path,
        reason = why.reason(),
        "HTTP call refused for its credentials"
    );
    ApiResponse::error(why.status(), why.kind(), &why.message(path))
        .with_header("www-authenticate", why.www_authenticate())
}

async fn handle_api(
    view: Arc<dyn AdminView>,
    req: Request<Incoming>,
    body_timeout: Duration,
    auth: &HttpAuth,
    stats: &HttpStats,
) -> ApiResponse {
    let path = req.uri().path();
    let need = view.api_scope(path);
    if let Err(why) = auth.check(&req, need) {
        return refuse(stats, why, path);
    }
    if need.is_none() {
        let what = format!("{} {path}", req.method());
        return ApiResponse::error(404, "invalid_request", &format!("no such endpoint: {what}"));
    }
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    let traceparent = (req.headers().get("traceparent"))
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
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
        traceparent,
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
    auth: HttpAuth,
    stats: Arc<HttpStats>,
) -> Response<Full<Bytes>> {
    let path = req.uri().path();
    if path.starts_with(API_PREFIX) {
        return respond_api(handle_api(view, req, body_timeout, &auth, &stats).await);
    }
    let need = if path.starts_with("/debug/") {
        Some(Scope::Debug)
    } else if path == "/metrics" && auth.guards_metrics() {
        Some(Scope::Metrics)
    } else {
        None
    };
    if let Some(scope) = need {
        if let Err(why) = auth.check(&req, Some(scope)) {
            return respond_api(refuse(&stats, why, path));
        }
    }
    if let Some(page) = req.uri().path().strip_prefix("/debug/") {
        let query = req.uri().query().unwrap_or("").to_string();
        if let (PHASE_TIMING_PAGE, Some(switch)) = (page, view.phase_switch()) {
            let (status, body) = switch.debug_page(&query);
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
            return respond(status, "application/json", body);
        }
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
    let auth = limits.auth.clone();
    let stats = Arc::new(HttpStats::for_limits(&limits));
    let counts = stats.clone();
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let server = HttpServer::start_with_stats(listener, limits, "admin", stats, move |req| {
        handle(
            view.clone(),
            req,
            body_timeout,
            auth.clone(),
            counts.clone(),
        )
    })?;
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
                "/v1/busy" | "/v1/lease" => Some(Box::pin(async {
                    ApiResponse::error(503, "overloaded", "busy").with_header("retry-after", "1")
                })),
                _ => None,
            }
        }

        fn api_scope(&self, path: &str) -> Option<Scope> {
            match path {
                "/v1/echo" | "/v1/busy" => Some(Scope::Route),
                "/v1/lease" => Some(Scope::Lease),
                _ => None,
            }
        }

        fn debug(self: Arc<Self>, path: String, _query: String) -> Option<DebugPage> {
            (path == "page").then(|| Box::pin(async { (200u16, "{\"page\":1}".to_string()) }) as _)
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

    const ROUTE: &str = "route-token-0123456789";
    const OPS: &str = "ops-token-abcdefghijkl";

    /// A view with a phase-timing switch.
    struct Switched(phase_timing::PhaseSwitch);

    impl AdminView for Switched {
        fn readiness(&self) -> (bool, String) {
            (true, "ready".into())
        }

        fn metrics(&self) -> String {
            String::new()
        }

        fn phase_switch(&self) -> Option<&phase_timing::PhaseSwitch> {
            Some(&self.0)
        }
    }

    /// The switch is a debug page: the `debug` scope flips it; a view without one has none.
    #[tokio::test]
    async fn the_phase_timing_switch_is_a_guarded_debug_page() {
        let tokens =
            auth::parse_tokens_file(&format!("{ROUTE} route\n{OPS} debug\n"), "tokens").unwrap();
        let limits = HttpLimits {
            auth: HttpAuth::new(tokens, Scopes::NONE, false).unwrap(),
            ..HttpLimits::default()
        };
        let view = Arc::new(Switched(Default::default()));
        let (addr, _stats, task) = serve("127.0.0.1:0".parse().unwrap(), limits, view.clone())
            .await
            .unwrap();
        let off = "/debug/phase-timing?set=off";
        assert!(call(addr, get_with(off, None))
            .await
            .starts_with("HTTP/1.1 401"));
        assert!(call(addr, get_with(off, Some(ROUTE)))
            .await
            .starts_with("HTTP/1.1 403"));
        assert!(view.0.is_on(), "refused calls change nothing");
        let r = call(addr, get_with(off, Some(OPS))).await;
        assert!(
            r.starts_with("HTTP/1.1 200") && r.ends_with(r#"{"phase_timing":false}"#),
            "{r}"
        );
        assert!(!view.0.is_on());
        let r = call(addr, get_with("/debug/phase-timing?set=2", Some(OPS))).await;
        assert!(r.starts_with("HTTP/1.1 400"), "{r}");
        task.abort();

        let (addr, _stats, task) = serve(
            "127.0.0.1:0".parse().unwrap(),
            HttpLimits::default(),
            Arc::new(Echo),
        )
        .await
        .unwrap();
        let r = call(addr, get_with("/debug/phase-timing?set=off", None)).await;
        assert!(r.starts_with("HTTP/1.1 404"), "{r}");
        task.abort();
    }

    fn get_with(path: &str, token: Option<&str>) -> String {
        let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
        format!("GET {path} HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n")
    }

    fn post_with(path: &str, token: &str, body: &str) -> String {
        format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
    }

    #[tokio::test]
    async fn tokens_guard_the_api_debug_pages_and_metrics_on_request() {
        let tokens =
            auth::parse_tokens_file(&format!("{ROUTE} route\n{OPS} debug,metrics\n"), "tokens")
                .unwrap();
        let limits = HttpLimits {
            auth: HttpAuth::new(tokens, Scopes::NONE, true).unwrap(),
            ..HttpLimits::default()
        };
        let (addr, stats, task) = serve("127.0.0.1:0".parse().unwrap(), limits, Arc::new(Echo))
            .await
            .unwrap();

        // No token: 401 with the challenge, a typed error, before the body is read (a body
        // over the limit is not even looked at).
        let none = call(addr, post("/v1/echo", &"x".repeat(100))).await;
        assert!(none.starts_with("HTTP/1.1 401"), "{none}");
        assert!(
            none.contains(r#"www-authenticate: Bearer realm="kvrouter""#),
            "{none}"
        );
        assert!(
            none.contains(r#"{"error":{"kind":"unauthenticated","message":"/v1/echo needs an `Authorization: Bearer TOKEN` header"}}"#),
            "{none}"
        );
        let wrong = call(addr, post_with("/v1/echo", &format!("{ROUTE}x"), "{}")).await;
        assert!(wrong.starts_with("HTTP/1.1 401"), "{wrong}");
        assert!(wrong.contains(r#"error="invalid_token""#), "{wrong}");
        assert!(!wrong.contains(ROUTE), "the token is never echoed: {wrong}");

        // The route token: its endpoints, nothing else.
        let ok = call(addr, post_with("/v1/echo", ROUTE, "{}")).await;
        assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
        let lease = call(addr, post_with("/v1/lease", ROUTE, "{}")).await;
        assert!(lease.starts_with("HTTP/1.1 403"), "{lease}");
        assert!(lease.contains(r#""kind":"forbidden""#), "{lease}");
        assert!(
            lease.contains(r#"error="insufficient_scope", scope="lease""#),
            "{lease}"
        );
        for page in ["/debug/page", "/debug/none", "/metrics"] {
            let r = call(addr, get_with(page, Some(ROUTE))).await;
            assert!(r.starts_with("HTTP/1.1 403"), "{page}: {r}");
        }
        // A known caller sees a 404 for a path that is no endpoint; a stranger does not.
        let nope = call(addr, post_with("/v1/nope", ROUTE, "")).await;
        assert!(nope.starts_with("HTTP/1.1 404"), "{nope}");
        let nope = call(addr, post("/v1/nope", "")).await;
        assert!(nope.starts_with("HTTP/1.1 401"), "{nope}");

        // The ops token: debug pages and metrics.
        let page = call(addr, get_with("/debug/page", Some(OPS))).await;
        assert!(page.starts_with("HTTP/1.1 200") && page.ends_with(r#"{"page":1}"#));
        let metrics = call(addr, get_with("/metrics", Some(OPS))).await;
        assert!(metrics.starts_with("HTTP/1.1 200"), "{metrics}");
        assert!(call(addr, get_with("/debug/page", None))
            .await
            .starts_with("HTTP/1.1 401"));

        // Probes stay open.
        for open in ["/healthz", "/readyz"] {
            let r = call(addr, get_with(open, None)).await;
            assert!(r.starts_with("HTTP/1.1 200"), "{open}: {r}");
        }

        // Counted by reason.
        let text = append_http_stats("# EOF\n".into(), "kvrouter", &[(addr, stats)]);
        for (reason, n) in [
            ("missing", 3),
            ("malformed", 0),
            ("invalid_token", 1),
            ("insufficient_scope", 4),
        ] {
            let line = format!(
                "kvrouter_http_auth_refused_total{{listener=\"{addr}\",reason=\"{reason}\"}} {n}\n"
            );
            assert!(text.contains(&line), "{line} in {text}");
        }
        assert!(text.ends_with("# EOF\n"), "{text}");
        task.abort();
    }

    #[tokio::test]
    async fn without_credentials_every_door_is_open_and_uncounted() {
        let (addr, stats, task) = serve(
            "127.0.0.1:0".parse().unwrap(),
            HttpLimits::default(),
            Arc::new(Echo),
        )
        .await
        .unwrap();
        for (req, status) in [
            (get_with("/debug/page", None), "200"),
            (post("/v1/lease", ""), "503"),
            (get_with("/metrics", None), "200"),
            (get_with("/v1/echo", Some("whatever")), "200"),
        ] {
            let r = call(addr, req.clone()).await;
            assert!(r.starts_with(&format!("HTTP/1.1 {status}")), "{req}: {r}");
        }
        let text = append_http_stats("# EOF\n".into(), "kvrouter", &[(addr, stats)]);
        assert!(
            !text.contains("auth_refused") && !text.contains("tls_"),
            "{text}"
        );
        task.abort();
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

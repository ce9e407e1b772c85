//! The admin HTTP endpoint every long-running kvrouter process serves: `/healthz` (the
//! process runs), `/readyz` (it can do its job; the body says why not), `/metrics`
//! (OpenMetrics text) and whatever `/debug/...` pages the process offers.

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// A `/debug/...` page being produced: (HTTP status, JSON body).
pub type DebugPage = Pin<Box<dyn Future<Output = (u16, String)> + Send>>;

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
}

/// The value of `key` in a query string (`a=1&b=2`; no percent-decoding).
pub fn query_param<'a>(query: &'a str, key: &str) -> Option<&'a str> {
    query
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v)
}

fn respond(status: StatusCode, content_type: &str, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    if let Ok(v) = content_type.parse() {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    r
}

async fn handle(view: Arc<dyn AdminView>, req: Request<Incoming>) -> Response<Full<Bytes>> {
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

/// Binds `addr` and serves until the task is aborted. Returns the bound address (useful
/// with port 0).
pub async fn serve(
    addr: SocketAddr,
    view: Arc<dyn AdminView>,
) -> std::io::Result<(SocketAddr, JoinHandle<()>)> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let task = tokio::spawn(async move {
        loop {
            let (stream, _) = match listener.accept().await {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "admin listener accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            };
            let view = view.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req| {
                    let view = view.clone();
                    async move { Ok::<_, std::convert::Infallible>(handle(view, req).await) }
                });
                if let Err(e) = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await
                {
                    tracing::debug!(error = %e, "admin connection ended with an error");
                }
            });
        }
    });
    Ok((local, task))
}

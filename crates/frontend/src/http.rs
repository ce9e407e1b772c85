//! The frontend's HTTP server: the OpenAI endpoints, `/v1/models`, `/health`, `/readyz`
//! and `/metrics`, with the kvrouter headers on routed answers to callers granted them.

use crate::frontend::{Frontend, Routed};
use crate::metrics::RequestLabels;
use crate::relay::Relay;
use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use kvrouter_admin::HttpServer;
use kvrouter_openai::auth::{Grants, Refusal};
use kvrouter_openai::{self as openai, ApiError, ClientRequest, DoorClock, DoorPhase, Endpoint};
use kvrouter_otlp::SpanKind;
use kvrouter_protocol::{TraceContext, TRACEPARENT};
use serde_json::{json, Value};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;
use tracing::Instrument;

pub type Body = BoxBody<Bytes, Infallible>;

fn full(status: u16, content_type: &'static str, body: impl Into<Bytes>) -> Response<Body> {
    let mut r = Response::new(Full::new(body.into()).boxed());
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

fn json_response(status: u16, v: &Value) -> Response<Body> {
    full(status, "application/json", v.to_string())
}

pub fn error_response(e: &ApiError) -> Response<Body> {
    let mut r = full(e.status, "application/json", e.to_bytes());
    if let Some(s) = e.retry_after {
        r.headers_mut()
            .insert(hyper::header::RETRY_AFTER, HeaderValue::from(s));
    }
    r
}

impl Frontend {
    async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Response<Body> {
        let path = req.uri().path().to_string();
        let method = req.method().clone();
        let mut grants = Grants::default();
        if path.starts_with("/v1/") {
            let authorization = req
                .headers()
                .get(hyper::header::AUTHORIZATION)
                .map(HeaderValue::as_bytes);
            match self.config.access.check(authorization) {
                Ok(g) => grants = g,
                Err(r) => {
                    self.metrics.refused(r);
                    tracing::debug!(reason = r.reason(), path, "refused: no valid API key");
                    let mut res = error_response(&ApiError::unauthorized());
                    res.headers_mut().insert(
                        hyper::header::WWW_AUTHENTICATE,
                        HeaderValue::from_static("Bearer"),
                    );
                    return res;
                }
            }
        }
        match (&method, path.as_str()) {
            (&Method::POST, "/v1/completions") => {
                self.openai(Endpoint::Completions, req, grants).await
            }
            (&Method::POST, "/v1/chat/completions") => {
                self.openai(Endpoint::Chat, req, grants).await
            }
            (&Method::GET, "/v1/models") => json_response(200, &self.models_page()),
            (&Method::GET, "/health" | "/healthz") => full(200, "text/plain", "ok\n"),
            (&Method::GET, "/readyz") => {
                let (ready, why) = self.readiness();
                full(
                    if ready { 200 } else { 503 },
                    "text/plain",
                    format!("{why}\n"),
                )
            }
            (&Method::GET, "/metrics") => {
                let listeners = self.http_stats.lock().clone();
                let text = kvrouter_admin::append_http_stats(
                    self.metrics.render(),
                    "kvrouter_frontend",
                    &listeners,
                );
                full(
                    200,
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    text,
                )
            }
            (_, "/v1/completions" | "/v1/chat/completions" | "/v1/models") => {
                let mut e = ApiError::invalid(None, format!("{method} is not allowed on {path}"));
                e.status = 405;
                error_response(&e)
            }
            _ => error_response(&ApiError::not_found(format!(
                "no route {path}: try /v1/completions, /v1/chat/completions or /v1/models"
            ))),
        }
    }

    /// Ready when the bus is up: routing needs nothing else of the frontend.
    fn readiness(&self) -> (bool, String) {
        if self.router.bus().is_connected() {
            (
                true,
                format!("ready: {} requests in flight", self.in_flight()),
            )
        } else {
            (false, "not connected to NATS".into())
        }
    }

    fn models_page(&self) -> Value {
        let data: Vec<Value> = self
            .model_names()
            .into_iter()
            .map(|(id, m)| {
                json!({"id": id, "object": "model", "created": 0, "owned_by": "kvrouter",
                       "root": m.name(), "max_model_len": m.prompt_limit().tokens})
            })
            .collect();
        json!({"object": "list", "data": data})
    }

    /// `/v1/completions` and `/v1/chat/completions`.
    ///
    /// The client's `x-request-id` (or one made for it) names the request in logs and is
    /// echoed back; it never names the request to the router or the engine. Those know it
    /// by a route id of the frontend's own (a v4 UUID): a client that knows or guesses
    /// another's `x-request-id` can neither collide with its booking nor end it, and two
    /// requests may share one.
    async fn openai(
        self: Arc<Self>,
        endpoint: Endpoint,
        req: Request<Incoming>,
        grants: Grants,
    ) -> Response<Body> {
        let started = Instant::now();
        let request_id = req
            .headers()
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            // Bounded: it is logged and echoed.
            .filter(|v| !v.is_empty() && v.len() <= kvrouter_protocol::limits::MAX_REQUEST_ID_BYTES)
            .map_or_else(kvrouter_client::new_request_id, str::to_string);
        let route_id = kvrouter_client::new_request_id();
        let span = tracing::info_span!(
            "request",
            request_id = %request_id,
            route_id = %route_id,
            endpoint = endpoint.as_str()
        );
        let (model, mut res) = self
            .clone()
            .answer(endpoint, req, grants, &route_id, started)
            .instrument(span)
            .await
            .unwrap_or_else(|(model, e)| (model, error_response(&e)));
        if let Ok(v) = HeaderValue::from_str(&request_id) {
            res.headers_mut().insert("x-request-id", v);
        }
        self.metrics
            .requests
            .get_or_create(&RequestLabels {
                model,
                endpoint: endpoint.as_str(),
                status: res.status().as_u16(),
            })
            .inc();
        res
    }

    async fn answer(
        self: Arc<Self>,
        endpoint: Endpoint,
        req: Request<Incoming>,
        grants: Grants,
        route_id: &str,
        started: Instant,
    ) -> Result<(String, Response<Body>), (String, ApiError)> {
        // The client's trace (a malformed one is dropped): the request's span joins it, or
        // with tracing off it is passed on as it came.
        let trace = req
            .headers()
            .get(TRACEPARENT)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| TraceContext::parse(v).ok());
        let mut span = (self.tracer).span("kvrouter.frontend.request", SpanKind::Server, trace);
        span.set("kvrouter.endpoint", endpoint.as_str());
        // A place among the in-flight requests only for a whole, well-formed request: a
        // client that sends its body slowly holds a connection, never a permit.
        let creq = self
            .read_request(endpoint, req, grants)
            .await
            .map_err(|e| {
                span.fail(e.message.clone());
                if e.status == 403 {
                    self.metrics.refused(Refusal::RoutingExtension);
                    tracing::debug!("refused: the kvrouter extension is not granted");
                }
                (String::new(), e)
            })?;
        // Always on: the frontend's answers take milliseconds, its phases a few clock reads.
        let mut clock = DoorClock::started_at(Some(started));
        clock.lap(DoorPhase::Parse);
        let model = self.label_for(&creq.model);
        span.set("kvrouter.stream", creq.stream);
        let in_flight = self.admit().map_err(|e| {
            span.fail(e.message.clone());
            (model.clone(), e)
        })?;
        let Routed {
            lease,
            answer,
            model: served,
            prediction,
            engine_span,
        } = self
            .route_and_send(&creq, route_id, &mut span, &mut clock)
            .await
            .map_err(|e| {
                span.fail(e.message.clone());
                (model.clone(), e)
            })?;
        let d = &lease.decision;
        // Which worker and replica served, and how much of the prompt was cached there: a
        // map of the fleet and a probe of other tenants' prompts, for granted callers only.
        let headers = [
            (
                "x-kvrouter-worker",
                format!("{}:{}", d.worker_id, d.dp_rank),
            ),
            ("x-kvrouter-overlap-blocks", d.overlap_blocks.to_string()),
            ("x-kvrouter-replica", d.replica_id.clone()),
        ];
        tracing::debug!(worker = %headers[0].1, overlap_blocks = d.overlap_blocks, "routed");
        let chat = endpoint == Endpoint::Chat;
        let relay = Relay::new(
            answer.into_body(),
            lease,
            self.clone(),
            served.name(),
            started,
            in_flight,
        )
        .timed(clock, prediction)
        .traced(span, engine_span);
        let mut res = if creq.stream {
            let body = StreamBody::new(relay.into_sse_body(
                chat,
                creq.include_usage,
                !grants.overlap_header,
            ));
            let mut r = Response::new(BodyExt::boxed(body));
            let h = r.headers_mut();
            h.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
            h.insert(
                hyper::header::CACHE_CONTROL,
                HeaderValue::from_static("no-cache"),
            );
            r
        } else {
            match relay.gather(chat, !grants.overlap_header).await {
                Ok(v) => json_response(200, &v),
                Err(e) => error_response(&e),
            }
        };
        if grants.overlap_header {
            for (k, v) in headers {
                if let Ok(v) = HeaderValue::from_str(&v) {
                    res.headers_mut().insert(k, v);
                }
            }
        }
        Ok((served.name().to_string(), res))
    }
}

/// Bodies up to this size parse on the async thread; larger ones on the blocking pool.
const INLINE_PARSE_BYTES: usize = 1 << 20;

impl Frontend {
    /// The request, read within the size limit, the body timeout and the frontend's body
    /// budget, and parsed.
    async fn read_request(
        &self,
        endpoint: Endpoint,
        req: Request<Incoming>,
        grants: Grants,
    ) -> Result<ClientRequest, ApiError> {
        let (body, _hold) = self
            .body_budget
            .read_body(
                req,
                self.config.max_body_bytes,
                self.config.http_limits.body_timeout,
            )
            .await
            .map_err(|e| {
                let mut err = match e {
                    kvrouter_admin::BodyError::Busy(_) => ApiError::overloaded(e.to_string()),
                    _ => ApiError::invalid(None, e.to_string()),
                };
                err.status = e.status();
                err
            })?;
        if body.len() <= INLINE_PARSE_BYTES {
            return openai::parse(endpoint, &body, grants);
        }
        let _slot = self
            .parse_slots
            .acquire()
            .await
            .map_err(|_| ApiError::internal("the frontend is stopping"))?;
        tokio::task::spawn_blocking(move || openai::parse(endpoint, &body, grants))
            .await
            .map_err(|e| ApiError::internal(format!("parse task failed: {e}")))?
    }
}

/// The frontend serving on a listener, until [`FrontendServer::shutdown_within`].
pub struct FrontendServer {
    pub addr: SocketAddr,
    frontend: Arc<Frontend>,
    server: HttpServer,
}

impl FrontendServer {
    /// Binds `addr` and serves, within the configured connection limits.
    pub async fn start(addr: SocketAddr, frontend: Frontend) -> std::io::Result<Self> {
        let limits = frontend.config.http_limits.clone();
        let frontend = Arc::new(frontend);
        let f = frontend.clone();
        let server =
            HttpServer::bind(addr, limits, "frontend", move |req| f.clone().handle(req)).await?;
        *frontend.http_stats.lock() = vec![(server.addr, server.stats.clone())];
        Ok(Self {
            addr: server.addr,
            frontend,
            server,
        })
    }

    pub fn frontend(&self) -> &Arc<Frontend> {
        &self.frontend
    }

    /// Stops accepting, lets requests in flight finish for at most `drain`, then cuts the
    /// rest (their routes are freed) and waits briefly for the frees to go out.
    pub async fn shutdown_within(self, drain: std::time::Duration) {
        self.server.stop_accepting();
        let deadline = tokio::time::Instant::now() + drain;
        while self.frontend.in_flight() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        let left = self.frontend.in_flight();
        if left > 0 {
            tracing::warn!(
                requests = left,
                "drain timeout: cutting requests still in flight"
            );
        }
        self.server.close_connections();
        let m = &self.frontend.metrics.leases;
        let settle = tokio::time::Instant::now() + std::time::Duration::from_millis(500);
        while m.freed.get() < m.taken.get() && tokio::time::Instant::now() < settle {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        // Let the spawned frees reach the bus.
        let _ = (self.frontend.router.bus())
            .flush_within(std::time::Duration::from_secs(1))
            .await;
        let exporter = self.frontend.exporter.lock().take();
        if let Some(e) = exporter {
            e.shutdown(std::time::Duration::from_secs(2)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overload_carries_retry_after() {
        let r = error_response(&ApiError::overloaded("full"));
        assert_eq!(r.status(), 503);
        assert_eq!(r.headers()[hyper::header::RETRY_AFTER], "1");
    }
}

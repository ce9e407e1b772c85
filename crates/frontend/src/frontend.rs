//! One request's way through the frontend: check, tokenize, route, send to the chosen
//! engine (routing again around an engine that fails before answering).

use crate::config::{FrontendConfig, RankConvention};
use crate::metrics::FrontendMetrics;
use crate::upstream::{Upstream, UpstreamError};
use bytes::Bytes;
use hyper::body::Incoming;
use hyper::header::{HeaderName, HeaderValue};
use hyper::Response;
use kvrouter_admin::HttpStats;
use kvrouter_client::{ClientError, KvRouterClient, LeaseCounts, RouteLease};
use kvrouter_openai::body::with_token_prompt;
use kvrouter_openai::door_metrics::CachePrediction;
use kvrouter_openai::{ApiError, ClientRequest, DoorClock, DoorPhase, ModelFiles, Models};
use kvrouter_otlp::{Span, SpanKind, Tracer};
use kvrouter_protocol::{ErrorKind, TraceContext, WorkerId, TRACEPARENT};
use serde_json::Value;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

pub struct Frontend {
    pub(crate) models: Models,
    pub(crate) router: KvRouterClient,
    pub(crate) upstream: Upstream,
    pub(crate) config: FrontendConfig,
    permits: Arc<Semaphore>,
    pub(crate) metrics: FrontendMetrics,
    leases: Arc<LeaseCounts>,
    /// Request body bytes being read or parsed, over all connections.
    pub(crate) body_budget: kvrouter_admin::BodyBudget,
    /// Large bodies parse on the blocking pool, this many at once (the cores): parsing is
    /// CPU work, and a parse's JSON values can take several times its body's bytes.
    pub(crate) parse_slots: Arc<Semaphore>,
    /// The client listener's connection counts, once it listens.
    pub(crate) http_stats: parking_lot::Mutex<Vec<(std::net::SocketAddr, Arc<HttpStats>)>>,
    /// Starts request spans (off without `--otlp-traces-endpoint`).
    pub(crate) tracer: Tracer,
    /// Sends the spans still queued at shutdown.
    pub(crate) exporter: parking_lot::Mutex<Option<kvrouter_otlp::Exporter>>,
}

/// A request's place among the in-flight ones; gives it back (and the gauge) on drop.
pub struct InFlight {
    _permit: OwnedSemaphorePermit,
    gauge: prometheus_client::metrics::gauge::Gauge,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

/// A request routed and answered by an engine: the answer's head has arrived.
pub struct Routed {
    pub lease: RouteLease,
    pub answer: Response<Incoming>,
    pub model: Arc<ModelFiles>,
    /// The cached prefix the router predicted, to hold against the engine's report.
    pub prediction: CachePrediction,
    /// The engine call: its span lasts until the answer ends.
    pub engine_span: Span,
}

impl Frontend {
    pub fn new(
        models: Vec<ModelFiles>,
        loras: HashMap<String, String>,
        router: KvRouterClient,
        config: FrontendConfig,
    ) -> Result<Self, String> {
        let models = Models::new(models, loras, config.max_body_bytes)?;
        let leases = Arc::new(LeaseCounts::default());
        let metrics = FrontendMetrics::new(leases.clone());
        // With an endpoint, the exporter's task starts here (on the caller's runtime).
        let (tracer, exporter) = config.traces.start(
            kvrouter_otlp::ServiceInfo {
                name: "kvrouter-frontend".into(),
                instance_id: kvrouter_client::new_request_id(),
            },
            metrics.traces.clone(),
        );
        Ok(Self {
            models,
            router,
            upstream: Upstream::new(config.connect_timeout),
            permits: Arc::new(Semaphore::new(config.max_inflight)),
            body_budget: kvrouter_admin::BodyBudget::new(config.max_buffered_body_bytes),
            metrics,
            tracer,
            exporter: parking_lot::Mutex::new(exporter),
            leases,
            config,
            http_stats: Default::default(),
            parse_slots: Arc::new(Semaphore::new(
                std::thread::available_parallelism().map_or(2, |n| n.get()),
            )),
        })
    }

    /// Takes a place among the in-flight requests, or says the frontend is full.
    pub fn admit(&self) -> Result<InFlight, ApiError> {
        let permit = self.permits.clone().try_acquire_owned().map_err(|_| {
            ApiError::overloaded(format!(
                "the frontend is answering {} requests already (--max-inflight)",
                self.config.max_inflight
            ))
        })?;
        self.metrics.inflight.inc();
        Ok(InFlight {
            _permit: permit,
            gauge: self.metrics.inflight.clone(),
        })
    }

    pub fn in_flight(&self) -> usize {
        self.config.max_inflight - self.permits.available_permits()
    }

    /// Model names as clients may ask for them: served models, then LoRA adapters.
    pub fn model_names(&self) -> Vec<(&str, &ModelFiles)> {
        self.models.names()
    }

    /// The metric label for a model as a client named it.
    pub(crate) fn label_for(&self, name: &str) -> String {
        self.models.label_for(name)
    }

    /// Checks, tokenizes and routes the request, and sends it to the chosen engine,
    /// routing again (that worker excluded) when an engine fails before answering.
    /// `route_id` names it to the router and the engine: the frontend's own, never the
    /// client's `x-request-id`. `clock` times its phases up to the engine's answer. Each
    /// route call and engine call is a span under `request` (the route's context travels on
    /// the bus, the engine call's as the engine's `traceparent`).
    pub async fn route_and_send(
        &self,
        req: &ClientRequest,
        route_id: &str,
        request: &mut Span,
        clock: &mut DoorClock,
    ) -> Result<Routed, ApiError> {
        let started = Instant::now();
        let understood = self.models.understand(req, clock).await?;
        let model = understood.model.clone();
        request.set("kvrouter.model", model.name().to_string());
        request.set("kvrouter.prompt_tokens", understood.tokens.len());
        let labels = FrontendMetrics::model(model.name());
        self.metrics
            .input_tokens
            .get_or_create(&labels)
            .inc_by(understood.tokens.len() as u64);
        let mut route = understood.route_request(req, route_id)?;
        let mut body = req.rest.clone();
        body.insert("model".into(), req.model.clone().into());
        body.insert("stream".into(), true.into());
        body.insert(
            "stream_options".into(),
            serde_json::json!({"include_usage": true}),
        );
        if let Some(salt) = &req.cache_salt {
            body.insert("cache_salt".into(), salt.clone().into());
        }
        let deadline = started + self.config.request_timeout;
        let mut last_failure: Option<(WorkerId, UpstreamError)> = None;
        for attempt in 0..=self.config.route_retries {
            if attempt > 0 {
                // A fresh id: the failed one may not be freed on its replica yet.
                route.request_id = format!("{route_id}/retry{attempt}");
            }
            let mut route_span =
                (self.tracer).span("kvrouter.route_call", SpanKind::Client, request.context());
            route.trace = route_span.context();
            let decision = match self.router.route(&route).await {
                Ok(d) => d,
                Err(ClientError::Router(e))
                    if e.kind == ErrorKind::NoAllowedWorkers && last_failure.is_some() =>
                {
                    route_span.fail(e.kind.to_string());
                    break; // every worker it may use has failed it
                }
                Err(e) => {
                    route_span.fail(e.kind().to_string());
                    return Err(ApiError::from_route(e.kind(), e.to_string()));
                }
            };
            route_span.set("kvrouter.attempt", attempt);
            route_span.set("kvrouter.replica_id", decision.replica_id.clone());
            route_span.set("kvrouter.worker_id", decision.worker_id);
            route_span.set("kvrouter.dp_rank", decision.dp_rank);
            route_span.set("kvrouter.overlap_blocks.device", decision.overlap_blocks);
            route_span.end();
            clock.lap(DoorPhase::Route);
            let prediction = CachePrediction::of(&decision, route.tokens.len());
            let lease = RouteLease::new(
                self.router.clone(),
                model.name().to_string(),
                route.request_id.clone(),
                decision,
                self.leases.clone(),
            );
            let d = &lease.decision;
            if self.config.ranks == RankConvention::Sglang {
                body.insert("data_parallel_rank".into(), d.dp_rank.into());
            }
            let mut engine_span =
                (self.tracer).span("kvrouter.engine_call", SpanKind::Client, request.context());
            engine_span.set("kvrouter.worker_id", d.worker_id);
            engine_span.set("kvrouter.dp_rank", d.dp_rank);
            engine_span.set("kvrouter.attempt", attempt);
            // The engine knows the request by the id the router booked it under; its own
            // spans (vLLM, SGLang with tracing on) nest under the engine call.
            let headers =
                self.upstream_headers(&route.request_id, d.dp_rank, engine_span.context());
            let payload = Bytes::from(with_token_prompt(&body, &req.passthrough, &route.tokens));
            let timeout = deadline.saturating_duration_since(Instant::now());
            match self
                .upstream
                .completions(&d.base_url, &headers, payload, timeout)
                .await
            {
                Ok(answer) => {
                    return Ok(Routed {
                        lease,
                        answer,
                        model,
                        prediction,
                        engine_span,
                    })
                }
                Err(e) if e.route_around() => {
                    tracing::warn!(
                        route_id = %route.request_id,
                        worker_id = d.worker_id,
                        dp_rank = d.dp_rank,
                        error = %e,
                        "engine failed the request before answering; routing around it"
                    );
                    engine_span.fail(e.to_string());
                    let worker = d.worker_id;
                    lease.free();
                    if !route.excluded_workers.contains(&worker) {
                        route.excluded_workers.push(worker);
                    }
                    last_failure = Some((worker, e));
                    // The failed attempt is no phase: the next route is timed alone.
                    clock.skip();
                    if attempt < self.config.route_retries {
                        self.metrics.retries.get_or_create(&labels).inc();
                    }
                }
                Err(UpstreamError::Status { status, body, .. }) => {
                    engine_span.fail(format!("HTTP {status}"));
                    lease.free();
                    return Err(engine_refusal(status, &body));
                }
                Err(e) => {
                    engine_span.fail(e.to_string());
                    lease.free();
                    return Err(ApiError::upstream(e.to_string()));
                }
            }
        }
        let (worker, e) = last_failure.expect("the loop ends early only after a failure");
        Err(match e {
            UpstreamError::Timeout { .. } => ApiError::timeout(format!(
                "the engine of worker {worker} did not answer in time: {e}"
            )),
            _ => ApiError::upstream(format!(
                "the engines failed the request ({} tried); last, worker {worker}: {e}",
                route.excluded_workers.len()
            )),
        })
    }

    fn upstream_headers(
        &self,
        request_id: &str,
        dp_rank: u32,
        trace: Option<TraceContext>,
    ) -> Vec<(HeaderName, HeaderValue)> {
        let mut h = vec![(
            HeaderName::from_static("x-data-parallel-rank"),
            HeaderValue::from(dp_rank),
        )];
        if let Ok(v) = HeaderValue::from_str(request_id) {
            h.push((HeaderName::from_static("x-request-id"), v));
        }
        // The engine's own spans (vLLM and SGLang with tracing on) join the client's trace.
        if let Some(Ok(v)) = trace.map(|t| HeaderValue::from_str(&t.to_string())) {
            h.push((HeaderName::from_static(TRACEPARENT), v));
        }
        h
    }
}

/// An engine's 4xx, passed on: its own OpenAI-style error when it sent one.
fn engine_refusal(status: u16, body: &str) -> ApiError {
    let parsed: Option<Value> = serde_json::from_str(body).ok();
    let message = parsed
        .as_ref()
        .and_then(|v| v.pointer("/error/message").or_else(|| v.get("message")))
        .and_then(Value::as_str)
        .map(str::to_string)
        .unwrap_or_else(|| body.chars().take(500).collect());
    let mut e = ApiError::invalid(None, format!("the engine refused the request: {message}"));
    e.status = status;
    if status == 404 {
        e.kind = "not_found_error";
    }
    e
}

//! What the frontend counts, on its `/metrics` (names in the style of Dynamo's frontend:
//! requests by status, time to first token, inter-token latency, end-to-end duration).

use kvrouter_admin::phase_timing::{phase_family, PhaseFamily, PhaseHistograms};
use kvrouter_client::LeaseCounts;
use kvrouter_openai::auth::Refusal;
use kvrouter_openai::door_metrics::CacheMetrics;
use kvrouter_openai::DoorClock;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::Arc;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub model: String,
    pub endpoint: &'static str,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabel {
    pub model: String,
}

fn seconds_buckets() -> impl Iterator<Item = f64> {
    // 100 µs .. ~100 s.
    prometheus_client::metrics::histogram::exponential_buckets(0.0001, 2.5, 16)
}

fn histogram_family() -> Family<ModelLabel, Histogram> {
    Family::new_with_constructor(|| Histogram::new(seconds_buckets()))
}

pub struct FrontendMetrics {
    registry: Registry,
    pub requests: Family<RequestLabels, Counter>,
    pub ttft: Family<ModelLabel, Histogram>,
    pub inter_token: Family<ModelLabel, Histogram>,
    pub duration: Family<ModelLabel, Histogram>,
    /// Where a request's time goes in the frontend, by phase.
    pub phases: PhaseFamily,
    /// Predicted against reported cache hits.
    pub cache: CacheMetrics,
    pub retries: Family<ModelLabel, Counter>,
    pub inflight: Gauge,
    pub input_tokens: Family<ModelLabel, Counter>,
    pub auth_refused: Family<ReasonLabel, Counter>,
    pub leases: Arc<LeaseCounts>,
    /// Request spans exported, dropped, failed exports (`otlp_*`).
    pub traces: kvrouter_otlp::TraceMetrics,
}

impl FrontendMetrics {
    pub fn new(leases: Arc<LeaseCounts>) -> Self {
        let mut registry = Registry::with_prefix("kvrouter_frontend");
        let m = Self {
            requests: Family::default(),
            ttft: histogram_family(),
            inter_token: histogram_family(),
            duration: histogram_family(),
            phases: phase_family(),
            cache: CacheMetrics::default(),
            retries: Family::default(),
            inflight: Gauge::default(),
            input_tokens: Family::default(),
            auth_refused: Family::default(),
            leases,
            traces: kvrouter_otlp::TraceMetrics::default(),
            registry: Registry::default(),
        };
        m.traces.register(&mut registry);
        registry.register(
            "requests",
            "Requests answered, by model, endpoint and HTTP status",
            m.requests.clone(),
        );
        registry.register(
            "time_to_first_token_seconds",
            "From request arrival to the first generated token",
            m.ttft.clone(),
        );
        registry.register(
            "inter_token_latency_seconds",
            "Between streamed chunks of one answer",
            m.inter_token.clone(),
        );
        registry.register(
            "request_duration_seconds",
            "From request arrival to the answer's end",
            m.duration.clone(),
        );
        registry.register(
            "phase_seconds",
            "Where a request's time goes in the frontend, by phase: parse, template, tokenize, route (the router round trip), engine_first_byte",
            m.phases.clone(),
        );
        registry.register(
            "cache_predicted_tokens",
            "Prompt tokens the router predicted cached on the chosen worker, for answers whose engine reported its own count",
            m.cache.predicted_tokens.clone(),
        );
        registry.register(
            "cache_reported_tokens",
            "Prompt tokens the engine reported cached (usage.prompt_tokens_details.cached_tokens)",
            m.cache.reported_tokens.clone(),
        );
        registry.register(
            "cache_prediction_error_tokens",
            "Reported minus predicted cached prompt tokens, per answer",
            m.cache.error_tokens.clone(),
        );
        registry.register(
            "cache_mispredictions",
            "Answers whose reported cached tokens were off the prediction by more than a block (over: fewer cached than predicted)",
            m.cache.mispredictions.clone(),
        );
        registry.register(
            "cache_reports_missing",
            "Answers without a cached-token count (vLLM needs --enable-prompt-tokens-details, SGLang --enable-cache-report)",
            m.cache.reports_missing.clone(),
        );
        registry.register(
            "route_retries",
            "Requests routed again around a failed engine",
            m.retries.clone(),
        );
        registry.register(
            "inflight_requests",
            "Requests being answered",
            m.inflight.clone(),
        );
        registry.register(
            "input_tokens",
            "Prompt tokens routed",
            m.input_tokens.clone(),
        );
        registry.register(
            "auth_refused",
            "Calls refused: no API key, a wrong one, or the kvrouter extension not granted",
            m.auth_refused.clone(),
        );
        // Every reason shows from the start (at 0), for alerts on its rate.
        for r in Refusal::ALL {
            let _ = m
                .auth_refused
                .get_or_create(&ReasonLabel { reason: r.reason() });
        }
        registry.register(
            "routes_taken",
            "Route decisions holding router load",
            m.leases.taken.clone(),
        );
        registry.register(
            "routes_freed",
            "Route decisions freed (equal to routes_taken at rest)",
            m.leases.freed.clone(),
        );
        Self { registry, ..m }
    }

    pub fn refused(&self, r: Refusal) {
        self.auth_refused
            .get_or_create(&ReasonLabel { reason: r.reason() })
            .inc();
    }

    /// Observes a request's phases under its served model's name.
    pub fn record_phases(&self, model: &str, clock: &DoorClock) {
        if clock.is_on() {
            PhaseHistograms::new(&self.phases, model).record(clock);
        }
    }

    pub fn model(model: &str) -> ModelLabel {
        ModelLabel {
            model: model.to_string(),
        }
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::warn!(error = %e, "cannot render metrics");
        }
        out
    }
}

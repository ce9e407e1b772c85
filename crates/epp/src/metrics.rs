//! What the endpoint picker counts, on its admin listener's `/metrics` (the Inference
//! Extension's convention is port 9090), and its `/readyz`.

use kvrouter_admin::phase_timing::{phase_family, PhaseFamily, PhaseHistograms, PhaseSwitch};
use kvrouter_admin::AdminView;
use kvrouter_client::LeaseCounts;
use kvrouter_openai::door_metrics::CacheMetrics;
use kvrouter_openai::DoorClock;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    /// `picked`, or `refused` (an immediate answer with `status`).
    pub outcome: &'static str,
    pub status: u16,
}

pub struct EppMetrics {
    registry: Registry,
    pub exchanges: Family<OutcomeLabels, Counter>,
    pub open: Gauge,
    /// Request body bytes held now (until each request is routed).
    pub buffered_bytes: Gauge,
    pub pick_seconds: Histogram,
    /// Where a request's time goes in the picker, by phase.
    pub phases: PhaseFamily,
    pub phase_switch: PhaseSwitch,
    /// Predicted against reported cache hits.
    pub cache: CacheMetrics,
    /// Answers the gateway got from another endpoint than the pick (a fallback).
    pub served_elsewhere: Counter,
    pub leases: Arc<LeaseCounts>,
    /// A router replica answered the last readiness probe.
    pub ready: AtomicBool,
    /// Pick spans exported, dropped, failed exports (`otlp_*`).
    pub traces: kvrouter_otlp::TraceMetrics,
}

impl EppMetrics {
    pub fn new(leases: Arc<LeaseCounts>) -> Self {
        let mut registry = Registry::with_prefix("kvrouter_epp");
        let exchanges = Family::<OutcomeLabels, Counter>::default();
        let open = Gauge::default();
        // 100 µs .. ~100 s.
        let pick_seconds = Histogram::new(
            prometheus_client::metrics::histogram::exponential_buckets(0.0001, 2.5, 16),
        );
        registry.register(
            "exchanges",
            "Requests the gateway asked about: picked, or refused with an HTTP status",
            exchanges.clone(),
        );
        registry.register("exchanges_open", "Exchanges open now", open.clone());
        let buffered_bytes = Gauge::default();
        registry.register(
            "request_bytes_buffered",
            "Request body bytes held until their requests are routed (at most --max-buffered-bytes)",
            buffered_bytes.clone(),
        );
        registry.register(
            "pick_seconds",
            "From the request's last body byte to the pick (parse, tokenize, route)",
            pick_seconds.clone(),
        );
        let phases = phase_family();
        registry.register(
            "phase_seconds",
            "Where a request's time goes in the endpoint picker, by phase: parse, template, tokenize, route (the router round trip), engine_first_byte (the pick answered until the answer's first bytes)",
            phases.clone(),
        );
        let cache = CacheMetrics::default();
        registry.register(
            "cache_predicted_tokens",
            "Prompt tokens the router predicted cached on the worker that served, for answers whose engine reported its own count",
            cache.predicted_tokens.clone(),
        );
        registry.register(
            "cache_reported_tokens",
            "Prompt tokens the engine reported cached (usage.prompt_tokens_details.cached_tokens)",
            cache.reported_tokens.clone(),
        );
        registry.register(
            "cache_prediction_error_tokens",
            "Reported minus predicted cached prompt tokens, per answer",
            cache.error_tokens.clone(),
        );
        registry.register(
            "cache_mispredictions",
            "Answers whose reported cached tokens were off the prediction by more than a block (over: fewer cached than predicted)",
            cache.mispredictions.clone(),
        );
        registry.register(
            "cache_reports_missing",
            "Answers without a cached-token count (the engine's flag is off, or a streamed request did not ask stream_options.include_usage)",
            cache.reports_missing.clone(),
        );
        let served_elsewhere = Counter::default();
        registry.register(
            "served_elsewhere",
            "Requests the gateway served at another endpoint than the pick (a fallback); their booking moves there",
            served_elsewhere.clone(),
        );
        registry.register(
            "routes_taken",
            "Route decisions holding router load",
            leases.taken.clone(),
        );
        registry.register(
            "routes_freed",
            "Route decisions freed (equal to routes_taken at rest)",
            leases.freed.clone(),
        );
        let traces = kvrouter_otlp::TraceMetrics::default();
        traces.register(&mut registry);
        Self {
            registry,
            traces,
            exchanges,
            open,
            buffered_bytes,
            pick_seconds,
            phases,
            phase_switch: PhaseSwitch::default(),
            cache,
            served_elsewhere,
            leases,
            ready: AtomicBool::new(false),
        }
    }

    pub fn picked(&self) {
        self.exchanges
            .get_or_create(&OutcomeLabels {
                outcome: "picked",
                status: 200,
            })
            .inc();
    }

    /// Observes a request's phases under its served model's name.
    pub fn record_phases(&self, model: &str, clock: &DoorClock) {
        if clock.is_on() {
            PhaseHistograms::new(&self.phases, model).record(clock);
        }
    }

    pub fn refused(&self, status: u16) {
        self.exchanges
            .get_or_create(&OutcomeLabels {
                outcome: "refused",
                status,
            })
            .inc();
    }
}

impl AdminView for EppMetrics {
    fn readiness(&self) -> (bool, String) {
        if self.ready.load(Ordering::Relaxed) {
            (true, "ready: a router replica answers".into())
        } else {
            (false, "no router replica answers".into())
        }
    }

    fn phase_switch(&self) -> Option<&PhaseSwitch> {
        Some(&self.phase_switch)
    }

    fn metrics(&self) -> String {
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::warn!(error = %e, "cannot render metrics");
        }
        out
    }
}

//! What a bridge counts, on its admin `/metrics`.

use crate::worker_mirror::Skip;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RankLabel {
    pub dp_rank: u32,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LoadLabel {
    pub dp_rank: u32,
    pub kind: &'static str,
}

pub struct BridgeMetrics {
    registry: Registry,
    /// Engine batches received, per rank.
    pub batches: Family<RankLabel, Counter>,
    /// KV events forwarded to the router, per rank.
    pub events_forwarded: Family<RankLabel, Counter>,
    /// Engine events not forwarded, by reason.
    pub events_skipped: Family<ReasonLabel, Counter>,
    /// Frames or payloads that could not be read, by kind.
    pub malformed: Family<ReasonLabel, Counter>,
    /// Gaps in a rank's sequence numbers, and how each ended.
    pub gaps: Family<RankLabel, Counter>,
    pub gaps_replayed: Family<RankLabel, Counter>,
    /// Batches applied from the replay buffer right after connecting (what the engine
    /// published while the bridge was not listening), per rank.
    pub caught_up: Family<RankLabel, Counter>,
    /// Ranks cleared towards the router because batches were lost for good.
    pub ranks_cleared: Family<RankLabel, Counter>,
    pub engine_restarts: Counter,
    /// 1 while the rank's ZMQ publisher is connected.
    pub zmq_connected: Family<RankLabel, Gauge>,
    /// 1 while the engine's health check passes.
    pub engine_healthy: Gauge,
    /// The engine's own load figures, per rank: running, waiting, cache_usage_permille.
    pub engine_load: Family<LoadLabel, Gauge>,
    /// Seconds since the rank's last batch (since the bridge started if none came),
    /// updated at each metrics scrape.
    pub since_last_batch: Family<RankLabel, Gauge>,
    /// 1 while the engine runs requests on the rank but no batch came for
    /// `--events-silent-secs`.
    pub events_silent: Family<RankLabel, Gauge>,
}

impl BridgeMetrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("kvrouter_bridge");
        let m = Self {
            batches: Family::default(),
            events_forwarded: Family::default(),
            events_skipped: Family::default(),
            malformed: Family::default(),
            gaps: Family::default(),
            gaps_replayed: Family::default(),
            caught_up: Family::default(),
            ranks_cleared: Family::default(),
            engine_restarts: Counter::default(),
            zmq_connected: Family::default(),
            engine_healthy: Gauge::default(),
            engine_load: Family::default(),
            since_last_batch: Family::default(),
            events_silent: Family::default(),
            registry: Registry::default(),
        };
        registry.register(
            "batches",
            "Engine KV event batches received",
            m.batches.clone(),
        );
        registry.register(
            "events_forwarded",
            "KV events forwarded to the router",
            m.events_forwarded.clone(),
        );
        registry.register(
            "events_skipped",
            "Engine KV events not forwarded, by reason",
            m.events_skipped.clone(),
        );
        registry.register(
            "malformed",
            "ZMQ frames or payloads that could not be read, by kind",
            m.malformed.clone(),
        );
        registry.register("gaps", "Gaps in a rank's sequence numbers", m.gaps.clone());
        registry.register(
            "gaps_replayed",
            "Gaps filled from the engine's replay buffer",
            m.gaps_replayed.clone(),
        );
        registry.register(
            "batches_caught_up",
            "Engine batches applied from its replay buffer right after connecting",
            m.caught_up.clone(),
        );
        registry.register(
            "ranks_cleared",
            "Ranks cleared towards the router after batches were lost for good",
            m.ranks_cleared.clone(),
        );
        registry.register(
            "engine_restarts",
            "Engine restarts seen (sequence numbers going back)",
            m.engine_restarts.clone(),
        );
        registry.register(
            "zmq_connected",
            "1 while the rank's ZMQ publisher is connected",
            m.zmq_connected.clone(),
        );
        registry.register(
            "engine_healthy",
            "1 while the engine's health check passes",
            m.engine_healthy.clone(),
        );
        registry.register(
            "engine_load",
            "The engine's own load figures per rank (running, waiting, cache_usage_permille)",
            m.engine_load.clone(),
        );
        registry.register(
            "seconds_since_last_batch",
            "Seconds since the rank's last engine batch (since the bridge started if none came), at the last metrics scrape",
            m.since_last_batch.clone(),
        );
        registry.register(
            "events_silent",
            "1 while the engine runs requests on the rank but no KV event batch came for --events-silent-secs (events going elsewhere: check the endpoint, topic and ports)",
            m.events_silent.clone(),
        );
        for s in Skip::ALL {
            let _ = m
                .events_skipped
                .get_or_create(&ReasonLabel { reason: s.as_str() });
        }
        Self { registry, ..m }
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::error!(error = %e, "cannot render metrics");
        }
        out
    }
}

impl Default for BridgeMetrics {
    fn default() -> Self {
        Self::new()
    }
}

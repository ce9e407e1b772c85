//! Prometheus metrics of a replica (served on the admin address at `/metrics`).

use crate::route_phases::RoutePhase;
use kvrouter_admin::phase_timing::{phase_family, PhaseFamily, PhaseHistograms, PhaseSwitch};
use kvrouter_protocol::{ErrorKind, WorkerKey};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabels {
    pub model: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TierLabels {
    pub model: String,
    /// `device`, `host`, `disk` or `shared`.
    pub tier: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub model: String,
    pub kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub model: String,
    pub reason: &'static str,
}

impl ReasonLabels {
    pub fn new(model: &str, reason: &'static str) -> Self {
        Self {
            model: model.to_string(),
            reason,
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndpointLabels {
    pub model: String,
    /// `mark_prefill`, `free`, `add_output_block` or `abandon`.
    pub endpoint: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KeyLabels {
    pub model: String,
    pub worker: String,
    pub dp_rank: String,
}

impl KeyLabels {
    pub fn new(model: &str, key: WorkerKey) -> Self {
        Self {
            model: model.to_string(),
            worker: key.worker_id.to_string(),
            dp_rank: key.dp_rank.to_string(),
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SubjectLabels {
    pub subject: &'static str,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn latency_histogram() -> Histogram {
    // 1 µs .. ~0.5 s
    Histogram::new(exponential_buckets(1e-6, 2.0, 20))
}

fn overlap_histogram() -> Histogram {
    Histogram::new([
        0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0,
    ])
}

/// The `model` label of a request for a model this replica does not serve: labels come only
/// from configured names, so no caller can grow `/metrics` by naming models.
pub const OTHER_MODEL: &str = "_other";

/// Every metric a replica exports.
pub struct Metrics {
    registry: Registry,
    /// The models this replica serves: the only `model` labels besides [`OTHER_MODEL`] and
    /// `""` (a request whose model is not known yet, e.g. undecodable).
    served: std::collections::HashSet<String>,
    pub routes: Family<ModelLabels, Counter>,
    pub route_errors: Family<ErrorLabels, Counter>,
    pub overlap_blocks: HistogramFamily<ModelLabels>,
    /// Routes whose chosen rank had cached blocks in a tier, and how many blocks, by tier.
    pub tier_hits: Family<TierLabels, Counter>,
    pub tier_hit_blocks: Family<TierLabels, Counter>,
    pub decision_seconds: HistogramFamily<ModelLabels>,
    /// Where a route's time goes, by phase (`route_phases`); its handles per served model.
    pub route_phases: PhaseFamily,
    phase_histograms: std::collections::HashMap<String, PhaseHistograms<RoutePhase>>,
    /// Whether route phases are timed (`/debug/phase-timing`).
    pub phase_switch: PhaseSwitch,
    /// Route spans exported, dropped, failed exports (`otlp_*`).
    pub traces: kvrouter_otlp::TraceMetrics,
    pub events_applied: Family<ModelLabels, Counter>,
    pub events_stale: Family<ModelLabels, Counter>,
    pub event_gaps: Family<ModelLabels, Counter>,
    pub recoveries: Family<ModelLabels, Counter>,
    pub recovery_failures: Family<ModelLabels, Counter>,
    pub workers: Family<ModelLabels, Gauge>,
    pub worker_ranks: Family<ModelLabels, Gauge>,
    pub unsynced_ranks: Family<ModelLabels, Gauge>,
    pub refused_workers: Family<ModelLabels, Counter>,
    pub queued_requests: Family<ModelLabels, Gauge>,
    /// `--replica-sync`: live peer replicas, and peers dropped as silent past their lease.
    pub sync_peers: Family<ModelLabels, Gauge>,
    pub sync_peers_lost: Family<ModelLabels, Counter>,
    /// Peers' sync batches lost (gaps in their sequence numbers), each followed by a fetch
    /// of that peer's active sequences.
    pub sync_batches_lost: Family<ModelLabels, Counter>,
    /// Peers' sync changes (or sequence numbers) not applied, by why.
    pub sync_refused: Family<ReasonLabels, Counter>,
    pub routes_abandoned: Family<ModelLabels, Counter>,
    /// Updates of active requests refused because the caller did not present the
    /// request's route lease.
    pub lease_refused: Family<EndpointLabels, Counter>,
    pub index_blocks: Family<ModelLabels, Gauge>,
    /// Approximate mode (`--no-kv-events`): route decisions recorded in the index.
    pub approx_records: Family<ModelLabels, Counter>,
    pub approx_record_failures: Family<ModelLabels, Counter>,
    /// `--use-remote-indexer`: overlap queries answered by a serving indexer, and routes that
    /// fell back to load alone because none answered.
    pub remote_indexer_queries: Family<ModelLabels, Counter>,
    pub remote_indexer_fallbacks: Family<ModelLabels, Counter>,
    /// Of those fallbacks, lookups not even asked because the breaker was open; and whether it
    /// is open (1) or closed (0).
    pub remote_indexer_skipped: Family<ModelLabels, Counter>,
    pub remote_indexer_breaker_open: Family<ModelLabels, Gauge>,
    /// `--serve-indexer`: queries answered, queries refused (not synced yet, bad request), and
    /// published decisions recorded.
    pub served_indexer_queries: Family<ModelLabels, Counter>,
    pub served_indexer_refusals: Family<ModelLabels, Counter>,
    pub served_indexer_records: Family<ModelLabels, Counter>,
    pub active_blocks: Family<KeyLabels, Gauge>,
    pub prefill_tokens: Family<KeyLabels, Gauge>,
    pub active_requests: Family<KeyLabels, Gauge>,
    /// What a worker rank's engine last reported itself (load reports): KV blocks in use and
    /// waiting requests.
    pub reported_active_blocks: Family<KeyLabels, Gauge>,
    pub reported_waiting_requests: Family<KeyLabels, Gauge>,
    /// Whether a rank's KV events reach the router: routes sent to it and events applied
    /// from it (their ratio: events per routed request), the age of its last event, and 1
    /// while it is routed to without publishing (`--events-silent-secs`).
    pub rank_routes: Family<KeyLabels, Counter>,
    pub rank_events: Family<KeyLabels, Counter>,
    pub since_last_event: Family<KeyLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    pub events_silent: Family<KeyLabels, Gauge>,
    /// Disaggregated prefill/decode: routes made, transfer reports that changed nothing
    /// (unknown request, wrong worker or tp rank, duplicate), transfers overdue or dropped,
    /// transfers pending.
    pub disagg_routes: Family<ModelLabels, Counter>,
    pub transfer_reports_dropped: Family<ReasonLabels, Counter>,
    pub transfers_overdue: Family<ModelLabels, Counter>,
    pub transfers_pending: Family<ModelLabels, Gauge>,
    /// Messages that could not be decoded, by subject kind (route, registration ...).
    pub undecodable: Family<SubjectLabels, Counter>,
    /// Worker messages dropped because their payload names another worker than their
    /// subject, by subject kind.
    pub misattributed: Family<SubjectLabels, Counter>,
    /// The bus connection: 1 while connected; times it was lost.
    pub bus_connected: Gauge,
    pub bus_disconnects: Counter,
    /// The bus's own loss count already added to `bus_disconnects`.
    pub bus_disconnects_counted: std::sync::atomic::AtomicU64,
    /// Registrations of a new instance under a worker id whose instance was still live.
    pub instance_takeovers: Family<ModelLabels, Counter>,
    /// Ranks left out of routing because their state cannot be fetched.
    pub unroutable_ranks: Family<ModelLabels, Gauge>,
    /// `--use-remote-indexer`: serving indexers that announced themselves synced.
    pub indexer_announcements: Family<ModelLabels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Metrics of a replica that serves no model (every model label is [`OTHER_MODEL`]).
    pub fn new() -> Self {
        Self::for_models(std::iter::empty::<String>())
    }

    /// Metrics of a replica serving `models`: a request naming any other model is counted
    /// under [`OTHER_MODEL`].
    pub fn for_models<S: Into<String>>(models: impl IntoIterator<Item = S>) -> Self {
        let mut registry = Registry::with_prefix("kvrouter");
        let served: std::collections::HashSet<String> =
            models.into_iter().map(Into::into).collect();
        macro_rules! reg {
            ($name:literal, $help:literal, $metric:expr) => {{
                let m = $metric;
                registry.register($name, $help, m.clone());
                m
            }};
        }
        Self {
            routes: reg!("routes", "Route decisions made", Family::default()),
            route_errors: reg!(
                "route_errors",
                "Requests answered with an error, by kind",
                Family::default()
            ),
            overlap_blocks: reg!(
                "route_overlap_blocks",
                "Cached prefix blocks on the chosen worker rank",
                HistogramFamily::new_with_constructor(overlap_histogram as fn() -> Histogram)
            ),
            tier_hits: reg!(
                "route_tier_hits",
                "Routes whose chosen worker rank held cached prefix blocks in a tier (device, host, disk, shared)",
                Family::default()
            ),
            tier_hit_blocks: reg!(
                "route_tier_hit_blocks",
                "Cached prefix blocks of routed requests on the chosen worker rank, by tier",
                Family::default()
            ),
            decision_seconds: reg!(
                "route_decision_seconds",
                "Time from receiving a route request to sending its answer",
                HistogramFamily::new_with_constructor(latency_histogram as fn() -> Histogram)
            ),
            route_phases: reg!(
                "route_phase_seconds",
                "Where a route's time goes on the replica, by phase: decode, hash, index_local or index_remote, schedule, queue, encode",
                phase_family()
            ),
            phase_histograms: Default::default(),
            phase_switch: PhaseSwitch::default(),
            traces: {
                let t = kvrouter_otlp::TraceMetrics::default();
                t.register(&mut registry);
                t
            },
            events_applied: reg!(
                "kv_events_applied",
                "KV events applied to the index",
                Family::default()
            ),
            events_stale: reg!(
                "kv_events_stale",
                "Duplicate or out-of-date KV events dropped",
                Family::default()
            ),
            event_gaps: reg!(
                "kv_event_gaps",
                "Event-id gaps detected (events lost)",
                Family::default()
            ),
            recoveries: reg!(
                "state_recoveries",
                "Worker rank states fetched and loaded",
                Family::default()
            ),
            recovery_failures: reg!(
                "state_recovery_failures",
                "Failed worker rank state fetches (retried)",
                Family::default()
            ),
            workers: reg!("workers", "Live workers", Family::default()),
            worker_ranks: reg!("worker_ranks", "Live worker ranks", Family::default()),
            unsynced_ranks: reg!(
                "unsynced_ranks",
                "Worker ranks whose state is still being fetched",
                Family::default()
            ),
            refused_workers: reg!(
                "refused_registrations",
                "Worker instances refused (e.g. block size mismatch; counted again each minute one keeps announcing itself)",
                Family::default()
            ),
            queued_requests: reg!(
                "queued_requests",
                "Route requests waiting for a worker that is not busy",
                Family::default()
            ),
            sync_peers: reg!(
                "replica_sync_peers",
                "Live peer replicas this replica shares active sequences with (--replica-sync)",
                Family::default()
            ),
            sync_peers_lost: reg!(
                "replica_sync_peers_lost",
                "Peer replicas dropped, with their active sequences, after going silent past the lease (--replica-sync)",
                Family::default()
            ),
            sync_batches_lost: reg!(
                "replica_sync_batches_lost",
                "Peers' replica-sync batches lost (gaps in their sequence numbers); each gap fetches that peer's active sequences again (--replica-sync)",
                Family::default()
            ),
            sync_refused: reg!(
                "replica_sync_refused",
                "Peers' replica-sync changes not applied: buffer_full (the catch-up buffer overflowed), id_too_long, not_its_own (a change to a request the peer did not route), sequence_jump (a sequence number too far ahead to believe; counted per batch)",
                Family::default()
            ),
            routes_abandoned: reg!(
                "replica_routes_abandoned",
                "Route bookings dropped, or late copies of route calls turned away, because the caller abandoned the call after asking another replica (a timeout or a lost answer)",
                Family::default()
            ),
            lease_refused: reg!(
                "replica_lease_refused",
                "Updates of active requests (mark_prefill, free, add_output_block, abandon) refused because the caller did not present the request's route lease",
                Family::default()
            ),
            index_blocks: reg!(
                "index_blocks",
                "Distinct prefix blocks in the index",
                Family::default()
            ),
            approx_records: reg!(
                "approx_decisions_recorded",
                "Route decisions recorded in the index (approximate mode)",
                Family::default()
            ),
            approx_record_failures: reg!(
                "approx_record_failures",
                "Route decisions the index could not record (approximate mode)",
                Family::default()
            ),
            remote_indexer_queries: reg!(
                "remote_indexer_queries",
                "Overlap queries answered by a serving indexer (--use-remote-indexer)",
                Family::default()
            ),
            remote_indexer_fallbacks: reg!(
                "remote_indexer_fallbacks",
                "Overlap queries no serving indexer answered: routed on load alone (--use-remote-indexer)",
                Family::default()
            ),
            remote_indexer_skipped: reg!(
                "remote_indexer_skipped",
                "Overlap queries not asked because the remote-indexer breaker was open: routed on load alone (also counted in remote_indexer_fallbacks)",
                Family::default()
            ),
            remote_indexer_breaker_open: reg!(
                "remote_indexer_breaker_open",
                "1 while the remote-indexer breaker is open (serving indexers failing: lookups skipped), else 0",
                Family::default()
            ),
            served_indexer_queries: reg!(
                "served_indexer_queries",
                "Overlap queries this serving indexer answered (--serve-indexer)",
                Family::default()
            ),
            served_indexer_refusals: reg!(
                "served_indexer_refusals",
                "Overlap queries this serving indexer refused: not synced, or malformed (--serve-indexer)",
                Family::default()
            ),
            served_indexer_records: reg!(
                "served_indexer_records",
                "Published route decisions this serving indexer recorded (--serve-indexer --no-kv-events)",
                Family::default()
            ),
            active_blocks: reg!(
                "worker_active_blocks",
                "KV blocks of active requests routed to a worker rank",
                Family::default()
            ),
            prefill_tokens: reg!(
                "worker_prefill_tokens",
                "Prompt tokens routed to a worker rank and not yet prefilled",
                Family::default()
            ),
            active_requests: reg!(
                "worker_active_requests",
                "Requests routed to a worker rank and not yet freed",
                Family::default()
            ),
            reported_active_blocks: reg!(
                "worker_reported_active_blocks",
                "KV blocks in use on a worker rank, as its engine last reported",
                Family::default()
            ),
            reported_waiting_requests: reg!(
                "worker_reported_waiting_requests",
                "Requests waiting on a worker rank, as its engine last reported",
                Family::default()
            ),
            rank_routes: reg!(
                "worker_routes",
                "Booked routes to a worker rank whose prompt has a full block (each should bring KV events from it)",
                Family::default()
            ),
            rank_events: reg!(
                "worker_kv_events",
                "KV events applied from a worker rank",
                Family::default()
            ),
            since_last_event: reg!(
                "worker_seconds_since_last_event",
                "Seconds since a worker rank's last KV event (since it joined if none came)",
                Family::default()
            ),
            events_silent: reg!(
                "worker_events_silent",
                "1 while a worker rank is sent requests but publishes no KV events for --events-silent-secs (events going elsewhere: check its engine's endpoint, topic and its bridge)",
                Family::default()
            ),
            disagg_routes: reg!(
                "disagg_routes",
                "Disaggregated route decisions made (a prefill and a decode worker rank)",
                Family::default()
            ),
            transfer_reports_dropped: reg!(
                "transfer_reports_dropped",
                "KV transfer reports that changed nothing, by reason: not_pending (no pending transfer of that id on this replica: routed by another replica, since every replica hears every report, or already complete or expired), wrong_rank (not the request's worker rank or tp rank), duplicate",
                Family::default()
            ),
            transfers_overdue: reg!(
                "transfers_overdue",
                "KV transfer sides still incomplete after the timeout (each counted once, and again if dropped)",
                Family::default()
            ),
            transfers_pending: reg!(
                "transfers_pending",
                "Disaggregated requests waiting for KV transfer reports",
                Family::default()
            ),
            undecodable: reg!(
                "undecodable_messages",
                "Bus messages that could not be decoded (dropped, or answered malformed), by subject kind",
                Family::default()
            ),
            misattributed: reg!(
                "misattributed_messages",
                "Messages dropped because they name another party than their subject does (a worker speaking for another; a sync batch naming another replica or changing its requests), by subject kind",
                Family::default()
            ),
            bus_connected: reg!(
                "bus_connected",
                "1 while the bus (NATS) connection is up",
                Gauge::default()
            ),
            bus_disconnects: reg!(
                "bus_disconnects",
                "Times the bus connection was seen lost",
                Counter::default()
            ),
            bus_disconnects_counted: Default::default(),
            instance_takeovers: reg!(
                "worker_instance_takeovers",
                "Registrations of a new worker instance under an id whose instance was still live (a restart, or a misconfigured duplicate)",
                Family::default()
            ),
            unroutable_ranks: reg!(
                "unroutable_ranks",
                "Worker ranks left out of routing because their state cannot be fetched",
                Family::default()
            ),
            indexer_announcements: reg!(
                "remote_indexer_announcements",
                "Serving indexers that announced themselves synced (the breaker closes at once)",
                Family::default()
            ),
            registry,
            served,
        }
        .with_phase_histograms()
    }

    fn with_phase_histograms(mut self) -> Self {
        self.phase_histograms = self
            .served
            .iter()
            .map(|m| (m.clone(), PhaseHistograms::new(&self.route_phases, m)))
            .collect();
        self
    }

    /// A served model's route phase histograms.
    pub fn route_phases(&self, model: &str) -> Option<&PhaseHistograms<RoutePhase>> {
        self.phase_histograms.get(model)
    }

    /// The `model` label for a name a caller sent: itself when served (or empty),
    /// [`OTHER_MODEL`] otherwise.
    pub fn model_label<'a>(&self, model: &'a str) -> &'a str {
        if model.is_empty() || self.served.contains(model) {
            model
        } else {
            OTHER_MODEL
        }
    }

    pub fn misattributed(&self, subject: &'static str) {
        self.misattributed
            .get_or_create(&SubjectLabels { subject })
            .inc();
    }

    pub fn undecodable(&self, subject: &'static str) {
        self.undecodable
            .get_or_create(&SubjectLabels { subject })
            .inc();
    }

    pub fn model(model: &str) -> ModelLabels {
        ModelLabels {
            model: model.to_string(),
        }
    }

    pub fn error(&self, model: &str, kind: ErrorKind) {
        self.route_errors
            .get_or_create(&ErrorLabels {
                model: self.model_label(model).to_string(),
                kind: kind.as_str().to_string(),
            })
            .inc();
    }

    /// Drops the per-rank series of a rank that left.
    pub fn forget_key(&self, model: &str, key: WorkerKey) {
        let labels = KeyLabels::new(model, key);
        self.active_blocks.remove(&labels);
        self.prefill_tokens.remove(&labels);
        self.active_requests.remove(&labels);
        self.reported_active_blocks.remove(&labels);
        self.reported_waiting_requests.remove(&labels);
        self.rank_routes.remove(&labels);
        self.rank_events.remove(&labels);
        self.since_last_event.remove(&labels);
        self.events_silent.remove(&labels);
    }

    /// The Prometheus text exposition (OpenMetrics).
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_for_unserved_models_share_one_label() {
        let m = Metrics::for_models(["m"]);
        m.error("m", ErrorKind::EmptyPrompt);
        m.error("", ErrorKind::Malformed);
        let before = m.render().len();
        for i in 0..1000 {
            m.error(
                &format!("random-{i}-{}", "x".repeat(1000)),
                ErrorKind::UnknownModel,
            );
        }
        let text = m.render();
        assert!(text
            .contains(r#"kvrouter_route_errors_total{model="_other",kind="unknown_model"} 1000"#));
        assert!(text.contains(r#"kvrouter_route_errors_total{model="m",kind="empty_prompt"} 1"#));
        assert!(text.contains(r#"kvrouter_route_errors_total{model="",kind="malformed"} 1"#));
        assert!(text.len() < before + 200, "{} -> {}", before, text.len());
        assert_eq!(Metrics::new().model_label("m"), OTHER_MODEL);
    }

    #[test]
    fn departed_series_disappear() {
        let m = Metrics::for_models(["m"]);
        let key = WorkerKey::new(42, 3);
        m.active_blocks
            .get_or_create(&KeyLabels::new("m", key))
            .set(7);
        m.error("m", ErrorKind::EmptyPrompt);
        let text = m.render();
        assert!(
            text.contains(r#"kvrouter_worker_active_blocks{model="m",worker="42",dp_rank="3"} 7"#)
        );
        assert!(text.contains(r#"kvrouter_route_errors_total{model="m",kind="empty_prompt"} 1"#));
        m.forget_key("m", key);
        assert!(!m.render().contains(r#"worker="42""#));
    }
}

//! Watching the engine over HTTP: its health decides whether its ranks are live, its
//! Prometheus metrics become the load reports.

use crate::endpoints::HttpUrl;
use crate::engine_load::parse_engine_metrics;
use crate::event_silence::{EventSilence, SilenceChange};
use crate::http_get::http_get;
use crate::metrics::{BridgeMetrics, LoadLabel, RankLabel};
use crate::mirror_task::MirrorCmd;
use kvrouter_bus::Bus;
use kvrouter_protocol::{EngineKind, ModelSubjects, RankLoad};
use kvrouter_worker::{announce, WorkerInfo};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch};

/// What the engine watchers need.
pub struct EngineWatch {
    pub kind: EngineKind,
    pub health_url: HttpUrl,
    pub health_interval: Duration,
    pub metrics_url: HttpUrl,
    pub metrics_interval: Duration,
    /// How long one health check or scrape may take.
    pub timeout: Duration,
    /// Busy this long without a batch: the rank's events are reported silent.
    pub events_silent_after: Duration,
    /// Where the events should come from, for the silence warning.
    pub zmq: String,
    pub zmq_bind: bool,
    pub topic: String,
    pub info: Arc<WorkerInfo>,
    pub bus: Bus,
    pub subjects: ModelSubjects,
    pub metrics: Arc<BridgeMetrics>,
    /// Bumped when the engine is healthy again after failing: the ZMQ readers connect afresh.
    pub reconnect: watch::Sender<u64>,
    /// Told first when the engine is back, so a new instance precedes its new events.
    pub mirror: mpsc::Sender<MirrorCmd>,
}

impl EngineWatch {
    /// Polls the health URL; every rank is live exactly while it answers 2xx. A change is
    /// announced at once, so a dead engine stops being routable within one interval plus
    /// the timeout.
    pub async fn health(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        let (url, interval, timeout) = (&self.health_url, self.health_interval, self.timeout);
        let (info, bus, subjects, metrics) = (&self.info, &self.bus, &self.subjects, &self.metrics);
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut healthy: Option<bool> = None;
        // Until the engine first answers, failing checks are its start (a bridge usually
        // starts long before the engine has loaded its weights), not a restart.
        let mut ever_up = false;
        loop {
            tokio::select! {
                _ = shutdown.wait_for(|s| *s) => return,
                _ = tick.tick() => {}
            }
            let (up, why) = match http_get(url, timeout).await {
                Ok((status, _)) if (200..300).contains(&status) => (true, String::new()),
                Ok((status, _)) => (false, format!("answered HTTP {status}")),
                Err(e) => (false, e.to_string()),
            };
            if healthy == Some(up) {
                continue;
            }
            let before = healthy.replace(up);
            metrics.engine_healthy.set(i64::from(up));
            if up && before == Some(false) && ever_up {
                let _ = self.mirror.send(MirrorCmd::EngineBack).await;
                self.reconnect.send_modify(|n| *n += 1);
            }
            ever_up |= up;
            if up {
                tracing::info!(url = %url.path, authority = %url.authority, "engine healthy: its ranks are live");
            } else {
                tracing::warn!(url = %url.path, authority = %url.authority, error = %why, "engine unhealthy: its ranks are not live until it answers again");
            }
            let mut changed = false;
            for i in 0..info.dp_size as usize {
                changed |= info.set_live(i, up);
            }
            if changed {
                announce(bus, subjects, info).await;
            }
        }
    }

    /// Scrapes the engine's metrics into the worker's load reports: waiting requests as
    /// they are, KV cache usage as blocks of `capacity_blocks`. A rank without its own
    /// series takes the unlabelled one.
    pub async fn load(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        let (url, kind, interval, timeout) = (
            &self.metrics_url,
            self.kind,
            self.metrics_interval,
            self.timeout,
        );
        let (info, metrics) = (&self.info, &self.metrics);
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failing = false;
        let mut silence = EventSilence::new(
            info.dp_size as usize,
            self.events_silent_after,
            Instant::now(),
        );
        loop {
            tokio::select! {
                _ = shutdown.wait_for(|s| *s) => return,
                _ = tick.tick() => {}
            }
            let body = match http_get(url, timeout).await {
                Ok((200, body)) => body,
                other => {
                    if !failing {
                        let why = match other {
                            Ok((status, _)) => format!("HTTP {status}"),
                            Err(e) => e.to_string(),
                        };
                        tracing::warn!(authority = %url.authority, path = %url.path, error = %why, "cannot scrape the engine's metrics; load reports keep the last figures");
                    }
                    failing = true;
                    continue;
                }
            };
            if failing {
                tracing::info!(authority = %url.authority, "engine metrics scraped again");
                failing = false;
            }
            let loads = parse_engine_metrics(kind, &String::from_utf8_lossy(&body));
            for i in 0..info.dp_size {
                let rank = info.dp_start_rank + i;
                let Some(l) = loads.get(&Some(rank)).or_else(|| loads.get(&None)) else {
                    continue;
                };
                let usage = l.cache_usage.unwrap_or(0.0);
                info.set_load(
                    i as usize,
                    RankLoad {
                        dp_rank: rank,
                        active_blocks: (usage * info.capacity_blocks as f64).round() as u64,
                        waiting_requests: l.waiting.round() as u64,
                    },
                );
                for (kind, v) in [
                    ("running", l.running),
                    ("waiting", l.waiting),
                    ("cache_usage_permille", usage * 1000.0),
                ] {
                    metrics
                        .engine_load
                        .get_or_create(&LoadLabel {
                            dp_rank: rank,
                            kind,
                        })
                        .set(v.round() as i64);
                }
                self.watch_silence(&mut silence, i as usize, rank, l.running > 0.0);
            }
        }
    }

    /// Feeds one scrape of `rank` to the silence watch; says so when it turns silent or
    /// its events come back.
    fn watch_silence(&self, silence: &mut EventSilence, slot: usize, rank: u32, busy: bool) {
        let metrics = &self.metrics;
        let label = RankLabel { dp_rank: rank };
        let batches = metrics.batches.get_or_create(&label).get();
        let now = Instant::now();
        let change = silence.scrape(slot, batches, busy, now);
        metrics
            .since_last_batch
            .get_or_create(&label)
            .set(silence.since_last_batch(slot, now).as_secs() as i64);
        metrics
            .events_silent
            .get_or_create(&label)
            .set(i64::from(silence.is_silent(slot)));
        match change {
            Some(SilenceChange::Silent { for_secs }) => {
                let connected = metrics.zmq_connected.get_or_create(&label).get() > 0;
                let likely = match (connected, self.zmq_bind) {
                    (false, false) => "the bridge is not connected to the engine's publisher: the engine must bind where the bridge connects (vLLM and SGLang bind only tcp://*, tcp://:: and ipc:// endpoints and connect to any other: give the engine tcp://*:PORT, or both sides tcp://127.0.0.1:PORT with --zmq-bind)",
                    (false, true) => "no publisher connected to the bridge's bound endpoint: the engine must connect to it (a tcp://127.0.0.1:PORT endpoint, the same port plus its rank); a tcp://* engine endpoint binds instead",
                    (true, _) => "connected, but nothing arrives: check --topic against the engine's topic, the port of each rank (the engine adds its global data-parallel rank to the port: --dp-start-rank), and that the engine publishes (enable_kv_cache_events)",
                };
                tracing::warn!(dp_rank = rank, endpoint = %self.zmq, topic = %self.topic, silent_secs = for_secs, "the engine runs requests but no KV event came from it: routing has no cache affinity for this rank; {likely}");
            }
            Some(SilenceChange::Resumed) => {
                tracing::info!(dp_rank = rank, "KV events arrive again");
            }
            None => {}
        }
    }
}

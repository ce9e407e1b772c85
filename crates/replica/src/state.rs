//! What a replica's tasks share without an actor hop: per-model read views and readiness.

use crate::approx::DecisionRecorder;
use crate::metrics::Metrics;
use crate::remote_indexer::RemoteIndexer;
use crate::scheduler_actor::{PeerInbox, SchedulerMsg};
use crate::serve::InFlight;
use crate::status::ModelStatus;
use crate::worker_tracker::TrackerMsg;
use kvrouter_bus::Bus;
use kvrouter_indexer::{IndexReader, OverlapScores, ShardedIndex};
use kvrouter_protocol::{LocalBlockHash, ModelSubjects, Subjects};
use prometheus_client::metrics::gauge::Gauge;
use ractor::ActorRef;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// One model as the endpoints see it.
pub struct ModelShared {
    pub name: String,
    pub subjects: ModelSubjects,
    pub status: Arc<ModelStatus>,
    pub index: IndexReader,
    /// The index's shard actors, for what readers cannot do (a rank's dump).
    pub sharded: Arc<ShardedIndex>,
    /// `Some` in approximate mode: route decisions that update state feed the index.
    pub recorder: Option<DecisionRecorder>,
    /// `Some` with `--use-remote-indexer`: overlaps come from a serving indexer.
    pub remote_index: Option<Arc<RemoteIndexer>>,
    pub scheduler: ActorRef<SchedulerMsg>,
    /// With replica sync: where peers' batches wait for the scheduler actor.
    pub peer_inbox: Option<Arc<PeerInbox>>,
    pub tracker: ActorRef<TrackerMsg>,
    /// Which ranks are routed to without publishing KV events (the tracker checks it).
    pub silence: Arc<parking_lot::Mutex<crate::rank_silence::RankSilence>>,
    /// `Some` when ranks are watched: a silent rank's booked routes feed the index (as in
    /// approximate mode, for that rank alone) until its events flow again.
    pub fallback: Option<DecisionRecorder>,
}

impl ModelShared {
    /// The overlaps of a request: from the local index, or from a serving indexer with
    /// `--use-remote-indexer` (empty when none answers).
    pub async fn find_overlaps(&self, local: &[LocalBlockHash]) -> OverlapScores {
        match &self.remote_index {
            Some(remote) => {
                let block_size = self.status.block_size().unwrap_or(0);
                remote.find_matches(block_size, local).await
            }
            None => self.index.find_matches(local),
        }
    }
}

pub struct ReplicaShared {
    pub replica_id: String,
    pub bus: Bus,
    /// The namespace's subjects (the JSON API forwards updates to other replicas).
    pub subjects: Subjects,
    /// `--max-prompt-tokens`: the longest prompt any endpoint accepts.
    pub max_prompt_tokens: usize,
    /// Requests being answered, bus and HTTP alike: the shutdown drains them.
    pub(crate) inflight: Arc<InFlight>,
    pub metrics: Arc<Metrics>,
    /// The admin and JSON API listeners' connection counts, once they listen.
    pub http_stats: parking_lot::Mutex<Vec<(SocketAddr, Arc<kvrouter_admin::HttpStats>)>>,
    pub models: HashMap<String, Arc<ModelShared>>,
    pub draining: AtomicBool,
    /// Replica sync is on, and whether the catch-up from a peer has landed.
    pub replica_sync: bool,
    pub sync_caught_up: AtomicBool,
    /// Book routes that come without a lease (`--allow-unleased`).
    pub allow_unleased: bool,
    /// The router queue-group endpoints are subscribed (the route gate).
    pub routes_open: AtomicBool,
    /// Whether the process just woke from a stall (routes read then are turned away).
    pub stall: crate::stall::StallWatch,
    /// Starts route spans (off without `--otlp-traces-endpoint`).
    pub tracer: kvrouter_otlp::Tracer,
    /// The routing policy, as route spans name it.
    pub policy: &'static str,
}

impl ReplicaShared {
    /// Ready once connected, every known rank of every model is synced, and the replica
    /// takes routes.
    pub fn readiness(&self) -> (bool, String) {
        if self.draining.load(Ordering::Relaxed) {
            return (false, "draining: shutting down".into());
        }
        if !self.bus.is_connected() {
            return (false, "not connected to the bus".into());
        }
        let mut waiting = self.models_waiting();
        if self.replica_sync && !self.sync_caught_up.load(Ordering::Relaxed) {
            waiting.push("replica sync: catching up from a peer".into());
        }
        if waiting.is_empty() && !self.routes_open.load(Ordering::Relaxed) {
            waiting.push("route endpoints not subscribed yet".into());
        }
        if waiting.is_empty() {
            let mut notes: Vec<String> = self
                .models
                .values()
                .filter_map(|m| {
                    m.status
                        .unroutable_summary(5)
                        .map(|s| format!("{}: {s}", m.name))
                })
                .collect();
            notes.sort();
            if notes.is_empty() {
                (true, "ready".into())
            } else {
                (true, format!("ready; {}", notes.join("; ")))
            }
        } else {
            waiting.sort();
            (false, format!("not ready: {}", waiting.join("; ")))
        }
    }

    /// What keeps models from being routable: workers still being discovered, ranks still
    /// syncing, an approximate index still loading. Empty when every model is routable.
    pub fn models_waiting(&self) -> Vec<String> {
        let mut waiting = Vec::new();
        for m in self.models.values() {
            let st = &m.status;
            if let Err(why) = st.ready() {
                waiting.push(format!("{}: {why}", m.name));
            }
        }
        waiting
    }

    /// The bus connection gauge and loss count, from the bus itself (at scrape time too, so a
    /// reconnect quicker than the watcher's poll is still counted).
    pub fn refresh_bus_metrics(&self) {
        let m = &self.metrics;
        m.bus_connected.set(i64::from(self.bus.is_connected()));
        let lost = self.bus.disconnects();
        let counted = m.bus_disconnects_counted.swap(lost, Ordering::Relaxed);
        if lost > counted {
            m.bus_disconnects.inc_by(lost - counted);
        }
    }

    /// Gauges computed at scrape time.
    pub fn refresh_gauges(&self) {
        self.refresh_bus_metrics();
        for m in self.models.values() {
            let labels = Metrics::model(&m.name);
            let blocks: &Gauge = &self.metrics.index_blocks.get_or_create(&labels);
            blocks.set(m.index.stats().live_blocks as i64);
        }
    }
}

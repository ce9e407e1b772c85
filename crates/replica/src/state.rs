//! What a replica's tasks share without an actor hop: per-model read views and readiness.

use crate::approx::DecisionRecorder;
use crate::fleet::FleetMsg;
use crate::metrics::Metrics;
use crate::scheduler_actor::{PeerInbox, SchedulerMsg};
use kvrouter_bus::Bus;
use kvrouter_indexer::IndexReader;
use kvrouter_protocol::ModelSubjects;
use prometheus_client::metrics::gauge::Gauge;
use ractor::ActorRef;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;

/// Counts the fleet actor publishes for readiness and the endpoints.
#[derive(Default)]
pub struct ModelStatus {
    /// 0 until the first worker registers (or `--block-size` sets it).
    pub block_size: AtomicU32,
    pub ranks: AtomicUsize,
    pub unsynced: AtomicUsize,
    /// The first roll call ("who is there") has had time to be answered.
    pub discovered: AtomicBool,
    /// A serving indexer in approximate mode is loading a peer's entries (see
    /// `served_indexer::spawn_approx`): it must not answer from a half-loaded index.
    pub index_catching_up: AtomicBool,
    /// Each registered worker's role and data-parallel layout (disaggregation).
    pub layouts: crate::disagg::Layouts,
}

impl ModelStatus {
    pub fn block_size(&self) -> Option<u32> {
        match self.block_size.load(Ordering::Relaxed) {
            0 => None,
            b => Some(b),
        }
    }
}

/// One model as the endpoints see it.
pub struct ModelShared {
    pub name: String,
    pub subjects: ModelSubjects,
    pub status: Arc<ModelStatus>,
    pub index: IndexReader,
    /// `Some` in approximate mode: route decisions that update state feed the index.
    pub recorder: Option<DecisionRecorder>,
    /// `Some` with `--use-remote-indexer`: overlaps come from a serving indexer.
    pub remote_index: Option<Arc<crate::remote_indexer::RemoteIndexer>>,
    pub scheduler: ActorRef<SchedulerMsg>,
    /// With replica sync: where peers' batches wait for the scheduler actor.
    pub peer_inbox: Option<Arc<PeerInbox>>,
    pub fleet: ActorRef<FleetMsg>,
}

pub struct ReplicaShared {
    pub replica_id: String,
    pub bus: Bus,
    pub metrics: Arc<Metrics>,
    pub models: HashMap<String, Arc<ModelShared>>,
    pub draining: AtomicBool,
    /// Replica sync is on, and whether the catch-up from a peer has landed.
    pub replica_sync: bool,
    pub sync_caught_up: AtomicBool,
    /// The router queue-group endpoints are subscribed ([`crate::route_gate`]).
    pub routes_open: AtomicBool,
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
            (true, "ready".into())
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
            if !st.discovered.load(Ordering::Relaxed) {
                waiting.push(format!("{}: discovering workers", m.name));
                continue;
            }
            let unsynced = st.unsynced.load(Ordering::Relaxed);
            if unsynced > 0 {
                waiting.push(format!(
                    "{}: {unsynced} of {} ranks still syncing",
                    m.name,
                    st.ranks.load(Ordering::Relaxed)
                ));
            }
            if st.index_catching_up.load(Ordering::Relaxed) {
                waiting.push(format!(
                    "{}: loading the approximate index from a peer serving indexer",
                    m.name
                ));
            }
        }
        waiting
    }

    /// Gauges computed at scrape time.
    pub fn refresh_gauges(&self) {
        for m in self.models.values() {
            let labels = Metrics::model(&m.name);
            let blocks: &Gauge = &self.metrics.index_blocks.get_or_create(&labels);
            blocks.set(m.index.stats().live_blocks as i64);
        }
    }
}

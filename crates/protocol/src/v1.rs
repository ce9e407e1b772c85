//! Format version 1, the previous version: the types version 2 changed, as version 1 encodes
//! them, and how they convert.
//!
//! FROZEN: these types are what version-1 peers send and read. Never change them (fields,
//! their order, their types, enum variants); a test pins their bytes. The current types they
//! borrow (`WorkerRole`, ...) encode as in version 1, as every type not listed here does.

use crate::messages::*;
use crate::types::{DpRank, KvEvent, WorkerId};
use crate::wire::{unchanged_since_previous, Wire};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// [`crate::Registration`] in version 1: no `engine`, no `base_url`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    pub worker_id: WorkerId,
    pub instance_id: Uuid,
    pub model: String,
    pub role: WorkerRole,
    pub block_size: u32,
    pub dp_size: u32,
    pub dp_start_rank: DpRank,
    pub live_ranks: Vec<DpRank>,
    pub tp_size: u32,
    pub capacity_blocks: u64,
    pub heartbeat_interval_ms: u32,
}

/// A version-1 worker is a kvrouter mocker (the only worker that spoke version 1): engine
/// `Mocker`, no engine HTTP address.
impl Wire for crate::messages::Registration {
    type Previous = Registration;

    fn from_previous(p: Registration) -> Self {
        Self {
            worker_id: p.worker_id,
            instance_id: p.instance_id,
            model: p.model,
            role: p.role,
            block_size: p.block_size,
            dp_size: p.dp_size,
            dp_start_rank: p.dp_start_rank,
            live_ranks: p.live_ranks,
            tp_size: p.tp_size,
            capacity_blocks: p.capacity_blocks,
            heartbeat_interval_ms: p.heartbeat_interval_ms,
            engine: EngineKind::Mocker,
            base_url: String::new(),
        }
    }

    fn to_previous(&self) -> Registration {
        Registration {
            worker_id: self.worker_id,
            instance_id: self.instance_id,
            model: self.model.clone(),
            role: self.role,
            block_size: self.block_size,
            dp_size: self.dp_size,
            dp_start_rank: self.dp_start_rank,
            live_ranks: self.live_ranks.clone(),
            tp_size: self.tp_size,
            capacity_blocks: self.capacity_blocks,
            heartbeat_interval_ms: self.heartbeat_interval_ms,
        }
    }
}

// Every message encoded the same in versions 1 and 2.
unchanged_since_previous!(
    KvEvent,
    RankLiveness,
    Heartbeat,
    Deregistration,
    WhoIsThere,
    KvEventBatch,
    LoadReport,
    StateQuery,
    StateChunk,
    RouteRequest,
    RouteDecision,
    DisaggRouteRequest,
    DisaggDecision,
    TransferReport,
    OverlapRequest,
    OverlapScoresReply,
    PotentialLoad,
    RequestUpdate,
    SyncBatch,
    SyncStateRequest,
    IndexerQuery,
    IndexerRecord,
    IndexerDumpRequest,
    IndexerDumpChunk,
    GenerateRequest,
    GenerateEvent,
    // New in version 2, on a subject of its own that no version-1 peer subscribes to.
    IndexerAnnouncement,
);

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

/// [`crate::RouteRequest`] in version 1: no `extras`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteRequest {
    pub model: String,
    pub request_id: String,
    pub tokens: Vec<u32>,
    pub lora: Option<String>,
    pub allowed_workers: Option<Vec<WorkerId>>,
    pub pin: Option<Pin>,
    pub update_states: bool,
}

/// A version-1 request has no extra keys: its blocks hash on their tokens (and LoRA) alone.
impl Wire for crate::messages::RouteRequest {
    type Previous = RouteRequest;

    fn from_previous(p: RouteRequest) -> Self {
        Self {
            model: p.model,
            request_id: p.request_id,
            tokens: p.tokens,
            lora: p.lora,
            allowed_workers: p.allowed_workers,
            pin: p.pin,
            update_states: p.update_states,
            extras: None,
        }
    }

    fn to_previous(&self) -> RouteRequest {
        RouteRequest {
            model: self.model.clone(),
            request_id: self.request_id.clone(),
            tokens: self.tokens.clone(),
            lora: self.lora.clone(),
            allowed_workers: self.allowed_workers.clone(),
            pin: self.pin,
            update_states: self.update_states,
        }
    }
}

/// [`crate::RouteDecision`] in version 1: no `base_url`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteDecision {
    pub worker_id: WorkerId,
    pub dp_rank: DpRank,
    pub overlap_blocks: u32,
    pub replica_id: String,
}

/// A version-1 decision names no HTTP address (version-1 workers had none).
impl Wire for crate::messages::RouteDecision {
    type Previous = RouteDecision;

    fn from_previous(p: RouteDecision) -> Self {
        Self {
            worker_id: p.worker_id,
            dp_rank: p.dp_rank,
            overlap_blocks: p.overlap_blocks,
            replica_id: p.replica_id,
            base_url: String::new(),
        }
    }

    fn to_previous(&self) -> RouteDecision {
        RouteDecision {
            worker_id: self.worker_id,
            dp_rank: self.dp_rank,
            overlap_blocks: self.overlap_blocks,
            replica_id: self.replica_id.clone(),
        }
    }
}

/// [`crate::DisaggDecision`] in version 1: its decisions in version 1.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DisaggDecision {
    pub prefill: RouteDecision,
    pub decode: RouteDecision,
    pub replica_id: String,
}

impl Wire for crate::messages::DisaggDecision {
    type Previous = DisaggDecision;

    fn from_previous(p: DisaggDecision) -> Self {
        Self {
            prefill: Wire::from_previous(p.prefill),
            decode: Wire::from_previous(p.decode),
            replica_id: p.replica_id,
        }
    }

    fn to_previous(&self) -> DisaggDecision {
        DisaggDecision {
            prefill: self.prefill.to_previous(),
            decode: self.decode.to_previous(),
            replica_id: self.replica_id.clone(),
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
    DisaggRouteRequest,
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

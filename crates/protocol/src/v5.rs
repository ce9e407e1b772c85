//! Format version 5, the previous version: the types version 6 changed, as version 5 encodes
//! them, and how they convert. Version 6 added route leases: `lease` on `RouteRequest`,
//! `DisaggRouteRequest`, `RouteDecision` (so `DisaggDecision`), `RequestUpdate`,
//! `OutputBlock` and `Abandon`. A version-5 peer's booking is unleased ([`Lease::NONE`]):
//! replicas refuse it unless started with `--allow-unleased` (a rolling upgrade), and any
//! caller may then end it, as before leases existed.
//!
//! FROZEN: these types are what version-5 peers send and read. Never change them (fields,
//! their order, their types, enum variants); a test pins their bytes. The current types they
//! borrow (`Pin`, `RouteOverrides`, ...) encode as in version 5, as every type not listed
//! here does.

use crate::lease::Lease;
use crate::messages::*;
use crate::types::{DpRank, PromptExtras, TierBlocks, WorkerId};
use crate::wire::{unchanged_since_previous, Wire};
use serde::{Deserialize, Serialize};

/// [`crate::RouteRequest`] in version 5.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RouteRequest {
    pub model: String,
    pub request_id: String,
    pub tokens: Vec<u32>,
    pub lora: Option<String>,
    pub allowed_workers: Option<Vec<WorkerId>>,
    pub pin: Option<Pin>,
    pub update_states: bool,
    pub extras: Option<PromptExtras>,
    pub excluded_workers: Vec<WorkerId>,
    pub overrides: Option<RouteOverrides>,
    pub priority_jump: f64,
    pub expected_output_tokens: Option<u32>,
    pub call_id: u64,
}

/// A version-5 request books without a lease.
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
            extras: p.extras,
            excluded_workers: p.excluded_workers,
            overrides: p.overrides,
            priority_jump: p.priority_jump,
            expected_output_tokens: p.expected_output_tokens,
            call_id: p.call_id,
            lease: Lease::NONE,
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
            extras: self.extras.clone(),
            excluded_workers: self.excluded_workers.clone(),
            overrides: self.overrides,
            priority_jump: self.priority_jump,
            expected_output_tokens: self.expected_output_tokens,
            call_id: self.call_id,
        }
    }
}

/// [`crate::DisaggRouteRequest`] in version 5.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DisaggRouteRequest {
    pub model: String,
    pub request_id: String,
    pub tokens: Vec<u32>,
    pub lora: Option<String>,
    pub allowed_workers: Option<Vec<WorkerId>>,
    pub update_states: bool,
}

impl Wire for crate::messages::DisaggRouteRequest {
    type Previous = DisaggRouteRequest;

    fn from_previous(p: DisaggRouteRequest) -> Self {
        Self {
            model: p.model,
            request_id: p.request_id,
            tokens: p.tokens,
            lora: p.lora,
            allowed_workers: p.allowed_workers,
            update_states: p.update_states,
            lease: Lease::NONE,
        }
    }

    fn to_previous(&self) -> DisaggRouteRequest {
        DisaggRouteRequest {
            model: self.model.clone(),
            request_id: self.request_id.clone(),
            tokens: self.tokens.clone(),
            lora: self.lora.clone(),
            allowed_workers: self.allowed_workers.clone(),
            update_states: self.update_states,
        }
    }
}

/// [`crate::RouteDecision`] in version 5: no lease.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteDecision {
    pub worker_id: WorkerId,
    pub dp_rank: DpRank,
    pub overlap_blocks: u32,
    pub replica_id: String,
    pub base_url: String,
    pub tier_overlap_blocks: TierBlocks,
    pub block_size: u32,
}

impl Wire for crate::messages::RouteDecision {
    type Previous = RouteDecision;

    fn from_previous(p: RouteDecision) -> Self {
        Self {
            worker_id: p.worker_id,
            dp_rank: p.dp_rank,
            overlap_blocks: p.overlap_blocks,
            replica_id: p.replica_id,
            base_url: p.base_url,
            tier_overlap_blocks: p.tier_overlap_blocks,
            block_size: p.block_size,
            lease: Lease::NONE,
        }
    }

    fn to_previous(&self) -> RouteDecision {
        RouteDecision {
            worker_id: self.worker_id,
            dp_rank: self.dp_rank,
            overlap_blocks: self.overlap_blocks,
            replica_id: self.replica_id.clone(),
            base_url: self.base_url.clone(),
            tier_overlap_blocks: self.tier_overlap_blocks,
            block_size: self.block_size,
        }
    }
}

/// [`crate::DisaggDecision`] in version 5.
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

/// [`crate::RequestUpdate`] in version 5.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestUpdate {
    pub model: String,
    pub request_id: String,
}

impl Wire for crate::messages::RequestUpdate {
    type Previous = RequestUpdate;

    fn from_previous(p: RequestUpdate) -> Self {
        Self {
            model: p.model,
            request_id: p.request_id,
            lease: Lease::NONE,
        }
    }

    fn to_previous(&self) -> RequestUpdate {
        RequestUpdate {
            model: self.model.clone(),
            request_id: self.request_id.clone(),
        }
    }
}

/// [`crate::OutputBlock`] in version 5.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OutputBlock {
    pub model: String,
    pub request_id: String,
    pub decay_fraction: Option<f64>,
}

impl Wire for crate::messages::OutputBlock {
    type Previous = OutputBlock;

    fn from_previous(p: OutputBlock) -> Self {
        Self {
            model: p.model,
            request_id: p.request_id,
            decay_fraction: p.decay_fraction,
            lease: Lease::NONE,
        }
    }

    fn to_previous(&self) -> OutputBlock {
        OutputBlock {
            model: self.model.clone(),
            request_id: self.request_id.clone(),
            decay_fraction: self.decay_fraction,
        }
    }
}

/// [`crate::Abandon`] in version 5.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Abandon {
    pub model: String,
    pub request_id: String,
    pub call_id: u64,
    pub kept_by: Option<String>,
}

impl Wire for crate::messages::Abandon {
    type Previous = Abandon;

    fn from_previous(p: Abandon) -> Self {
        Self {
            model: p.model,
            request_id: p.request_id,
            call_id: p.call_id,
            kept_by: p.kept_by,
            lease: Lease::NONE,
        }
    }

    fn to_previous(&self) -> Abandon {
        Abandon {
            model: self.model.clone(),
            request_id: self.request_id.clone(),
            call_id: self.call_id,
            kept_by: self.kept_by.clone(),
        }
    }
}

// Every message encoded the same in versions 5 and 6.
unchanged_since_previous!(
    SeqChange,
    SyncBatch,
    crate::types::KvEvent,
    KvEventBatch,
    StateChunk,
    OverlapScoresReply,
    GenerateEvent,
    EventMarks,
    Registration,
    RankLiveness,
    Heartbeat,
    Deregistration,
    WhoIsThere,
    LoadReport,
    StateQuery,
    TransferReport,
    OverlapRequest,
    PotentialLoad,
    SyncStateRequest,
    IndexerQuery,
    IndexerRecord,
    IndexerDumpRequest,
    IndexerDumpChunk,
    GenerateRequest,
    IndexerAnnouncement,
);

//! Format version 6, the previous version: the types version 7 changed, as version 6 encodes
//! them, and how they convert. Version 7 added fallbacks: `fallbacks` (how many are wanted)
//! on `RouteRequest`, and the next-best workers on `RouteDecision` (so `DisaggDecision`). A
//! version-6 caller asks for none; a version-6 replica gives none.
//!
//! FROZEN: these types are what version-6 peers send and read. Never change them (fields,
//! their order, their types, enum variants); a test pins their bytes. The current types they
//! borrow (`Pin`, `RouteOverrides`, `Lease`, ...) encode as in version 6, as every type not
//! listed here does.

use crate::lease::Lease;
use crate::messages::*;
use crate::types::{DpRank, PromptExtras, TierBlocks, WorkerId};
use crate::wire::{unchanged_since_previous, Wire};
use serde::{Deserialize, Serialize};

/// [`crate::RouteRequest`] in version 6.
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
    pub lease: Lease,
}

/// A version-6 request asks for no fallbacks.
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
            lease: p.lease,
            fallbacks: 0,
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
            lease: self.lease,
        }
    }
}

/// [`crate::RouteDecision`] in version 6: no fallbacks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteDecision {
    pub worker_id: WorkerId,
    pub dp_rank: DpRank,
    pub overlap_blocks: u32,
    pub replica_id: String,
    pub base_url: String,
    pub tier_overlap_blocks: TierBlocks,
    pub block_size: u32,
    pub lease: Lease,
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
            lease: p.lease,
            fallbacks: Vec::new(),
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
            lease: self.lease,
        }
    }
}

/// [`crate::DisaggDecision`] in version 6.
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

// Every message encoded the same in versions 6 and 7.
unchanged_since_previous!(
    DisaggRouteRequest,
    RequestUpdate,
    OutputBlock,
    Abandon,
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

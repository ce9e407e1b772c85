//! Format version 4, the previous version: the types version 5 changed, as version 4 encodes
//! them, and how they convert. Version 5 added `RouteRequest::priority_jump`,
//! `expected_output_tokens` and `call_id`, the output blocks of `SeqChange` (`Add::output_blocks`, the
//! `Output` change), the sender's instance and sequence number on `SyncBatch` and the block
//! size on `RouteDecision` (so on `DisaggDecision`); the new `OutputBlock` and `Abandon`
//! messages are never sent to a version-4 peer.
//!
//! FROZEN: these types are what version-4 peers send and read. Never change them (fields,
//! their order, their types, enum variants); a test pins their bytes. The current types they
//! borrow (`Pin`, `RouteOverrides`, ...) encode as in version 4, as every type not listed
//! here does.

use crate::messages::*;
use crate::types::{DpRank, PromptExtras, SequenceHash, TierBlocks, WorkerId, WorkerKey};
use crate::wire::{unchanged_since_previous, Wire};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// [`crate::RouteRequest`] in version 4.
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
}

/// A version-4 request jumps no queue, expects no output and has no call id.
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
            priority_jump: 0.0,
            expected_output_tokens: None,
            call_id: 0,
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
        }
    }
}

/// [`crate::RouteDecision`] in version 4: no block size.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteDecision {
    pub worker_id: WorkerId,
    pub dp_rank: DpRank,
    pub overlap_blocks: u32,
    pub replica_id: String,
    pub base_url: String,
    pub tier_overlap_blocks: TierBlocks,
}

/// A version-4 decision has block size 0: its caller reports no output blocks.
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
            block_size: 0,
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
        }
    }
}

/// [`crate::DisaggDecision`] in version 4.
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

/// [`crate::SeqChange`] in version 4: no output blocks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SeqChange {
    Add {
        request_id: String,
        key: WorkerKey,
        sequence_hashes: Vec<SequenceHash>,
        prefill_tokens: u64,
    },
    Prefilled {
        request_id: String,
    },
    Free {
        request_id: String,
    },
}

/// [`crate::SyncBatch`] in version 4: not sequenced.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyncBatch {
    pub replica_id: String,
    pub model: String,
    pub changes: Vec<SeqChange>,
}

/// A version-4 batch is unsequenced (`seq` 0, nil instance); a version-4 peer hears of no
/// output blocks (its decode load counts the prompt only, as it always did).
impl Wire for crate::messages::SyncBatch {
    type Previous = SyncBatch;

    fn from_previous(p: SyncBatch) -> Self {
        let changes = p
            .changes
            .into_iter()
            .map(|c| match c {
                SeqChange::Add {
                    request_id,
                    key,
                    sequence_hashes,
                    prefill_tokens,
                } => crate::messages::SeqChange::Add {
                    request_id,
                    key,
                    sequence_hashes,
                    prefill_tokens,
                    output_blocks: 0,
                },
                SeqChange::Prefilled { request_id } => {
                    crate::messages::SeqChange::Prefilled { request_id }
                }
                SeqChange::Free { request_id } => crate::messages::SeqChange::Free { request_id },
            })
            .collect();
        Self {
            replica_id: p.replica_id,
            model: p.model,
            changes,
            instance_id: Uuid::nil(),
            seq: 0,
        }
    }

    fn to_previous(&self) -> SyncBatch {
        let changes = self
            .changes
            .iter()
            .filter_map(|c| match c {
                crate::messages::SeqChange::Add {
                    request_id,
                    key,
                    sequence_hashes,
                    prefill_tokens,
                    ..
                } => Some(SeqChange::Add {
                    request_id: request_id.clone(),
                    key: *key,
                    sequence_hashes: sequence_hashes.clone(),
                    prefill_tokens: *prefill_tokens,
                }),
                crate::messages::SeqChange::Prefilled { request_id } => {
                    Some(SeqChange::Prefilled {
                        request_id: request_id.clone(),
                    })
                }
                crate::messages::SeqChange::Free { request_id } => Some(SeqChange::Free {
                    request_id: request_id.clone(),
                }),
                crate::messages::SeqChange::Output { .. } => None,
            })
            .collect();
        SyncBatch {
            replica_id: self.replica_id.clone(),
            model: self.model.clone(),
            changes,
        }
    }
}

// Every message encoded the same in versions 4 and 5 (`OutputBlock` and `Abandon` are new
// in 5: they go to subjects a version-4 replica never subscribes to).
unchanged_since_previous!(
    OutputBlock,
    Abandon,
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
    DisaggRouteRequest,
    TransferReport,
    OverlapRequest,
    PotentialLoad,
    RequestUpdate,
    SyncStateRequest,
    IndexerQuery,
    IndexerRecord,
    IndexerDumpRequest,
    IndexerDumpChunk,
    GenerateRequest,
    IndexerAnnouncement,
);

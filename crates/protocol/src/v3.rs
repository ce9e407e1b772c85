//! Format version 3, the previous version: the types version 4 changed, as version 3 encodes
//! them, and how they convert. Version 4 added tiers: `KvEvent::tier`, the tier weights of
//! `RouteOverrides`, `RouteDecision::tier_overlap_blocks` and the tier fields of
//! `OverlapScoresReply`, `GenerateEvent::PrefillDone::tier_cached_blocks`; the messages
//! that carry those types changed with them.
//!
//! FROZEN: these types are what version-3 peers send and read. Never change them (fields,
//! their order, their types, enum variants); a test pins their bytes. The current types they
//! borrow (`Pin`, `KvEventData`, ...) encode as in version 3, as every type not listed here
//! does.

use crate::messages::*;
use crate::types::{DpRank, EventId};
use crate::types::{KvEventData, PromptExtras, Tier, TierBlocks, WorkerId, WorkerKey};
use crate::wire::{unchanged_since_previous, Wire};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// [`crate::KvEvent`] in version 3: device blocks only.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvEvent {
    pub key: WorkerKey,
    pub event_id: EventId,
    pub data: KvEventData,
}

/// A version-3 event is a device event. A lower-tier event goes to a version-3 peer as an
/// empty `Removed` with the same id: it keeps the peer's event-id sequence whole (no gap, no
/// recovery) and changes nothing it knows of.
impl Wire for crate::types::KvEvent {
    type Previous = KvEvent;

    fn from_previous(p: KvEvent) -> Self {
        Self {
            key: p.key,
            event_id: p.event_id,
            tier: Tier::Device,
            data: p.data,
        }
    }

    fn to_previous(&self) -> KvEvent {
        let data = match (self.tier, &self.data) {
            (Tier::Device, d) | (_, d @ KvEventData::Cleared) => d.clone(),
            _ => KvEventData::Removed {
                engine_hashes: Vec::new(),
            },
        };
        KvEvent {
            key: self.key,
            event_id: self.event_id,
            data,
        }
    }
}

/// [`crate::KvEventBatch`] in version 3.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvEventBatch {
    pub worker_id: WorkerId,
    pub instance_id: Uuid,
    pub events: Vec<KvEvent>,
}

impl Wire for crate::messages::KvEventBatch {
    type Previous = KvEventBatch;

    fn from_previous(p: KvEventBatch) -> Self {
        Self {
            worker_id: p.worker_id,
            instance_id: p.instance_id,
            events: Wire::from_previous(p.events),
        }
    }

    fn to_previous(&self) -> KvEventBatch {
        KvEventBatch {
            worker_id: self.worker_id,
            instance_id: self.instance_id,
            events: self.events.to_previous(),
        }
    }
}

/// [`crate::StateChunk`] in version 3.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateChunk {
    pub key: WorkerKey,
    pub instance_id: Uuid,
    pub last_event_id: Option<EventId>,
    pub events: Vec<KvEvent>,
}

impl Wire for crate::messages::StateChunk {
    type Previous = StateChunk;

    fn from_previous(p: StateChunk) -> Self {
        Self {
            key: p.key,
            instance_id: p.instance_id,
            last_event_id: p.last_event_id,
            events: Wire::from_previous(p.events),
        }
    }

    fn to_previous(&self) -> StateChunk {
        StateChunk {
            key: self.key,
            instance_id: self.instance_id,
            last_event_id: self.last_event_id,
            events: self.events.to_previous(),
        }
    }
}

/// [`crate::RouteOverrides`] in version 3: no tier weights.
#[derive(Copy, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RouteOverrides {
    pub overlap_credit: Option<f64>,
    pub temperature: Option<f64>,
}

/// [`crate::RouteRequest`] in version 3: its overrides carry no tier weights.
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

/// A version-3 request takes the replica's tier weights.
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
            overrides: p.overrides.map(|o| crate::messages::RouteOverrides {
                overlap_credit: o.overlap_credit,
                temperature: o.temperature,
                ..Default::default()
            }),
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
            overrides: self.overrides.map(|o| RouteOverrides {
                overlap_credit: o.overlap_credit,
                temperature: o.temperature,
            }),
        }
    }
}

/// [`crate::RouteDecision`] in version 3: no tier split.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteDecision {
    pub worker_id: WorkerId,
    pub dp_rank: DpRank,
    pub overlap_blocks: u32,
    pub replica_id: String,
    pub base_url: String,
}

/// A version-3 decision's overlap is all on the device.
impl Wire for crate::messages::RouteDecision {
    type Previous = RouteDecision;

    fn from_previous(p: RouteDecision) -> Self {
        Self {
            worker_id: p.worker_id,
            dp_rank: p.dp_rank,
            overlap_blocks: p.overlap_blocks,
            replica_id: p.replica_id,
            base_url: p.base_url,
            tier_overlap_blocks: TierBlocks {
                device: p.overlap_blocks,
                ..TierBlocks::default()
            },
        }
    }

    fn to_previous(&self) -> RouteDecision {
        RouteDecision {
            worker_id: self.worker_id,
            dp_rank: self.dp_rank,
            overlap_blocks: self.overlap_blocks,
            replica_id: self.replica_id.clone(),
            base_url: self.base_url.clone(),
        }
    }
}

/// [`crate::DisaggDecision`] in version 3.
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

/// [`crate::OverlapScoresReply`] in version 3: device overlaps only.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OverlapScoresReply {
    pub block_size: u32,
    pub scores: Vec<(WorkerKey, u32)>,
}

impl Wire for crate::messages::OverlapScoresReply {
    type Previous = OverlapScoresReply;

    fn from_previous(p: OverlapScoresReply) -> Self {
        Self {
            block_size: p.block_size,
            scores: p.scores,
            tier_overlap_blocks: Vec::new(),
            shared_blocks: 0,
        }
    }

    fn to_previous(&self) -> OverlapScoresReply {
        OverlapScoresReply {
            block_size: self.block_size,
            scores: self.scores.clone(),
        }
    }
}

/// [`crate::GenerateEvent`] in version 3: no blocks by tier.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum GenerateEvent {
    PrefillDone {
        ttft_us: u64,
        cached_blocks: u32,
        prompt_blocks: u32,
    },
    Tokens {
        itl_us: Vec<u32>,
    },
    Done {
        output_tokens: u32,
        e2e_us: u64,
    },
    Error(ErrorReply),
}

/// A version-3 engine reports its reused blocks as device blocks.
impl Wire for crate::messages::GenerateEvent {
    type Previous = GenerateEvent;

    fn from_previous(p: GenerateEvent) -> Self {
        match p {
            GenerateEvent::PrefillDone {
                ttft_us,
                cached_blocks,
                prompt_blocks,
            } => Self::PrefillDone {
                ttft_us,
                cached_blocks,
                prompt_blocks,
                tier_cached_blocks: TierBlocks::on_device(cached_blocks),
            },
            GenerateEvent::Tokens { itl_us } => Self::Tokens { itl_us },
            GenerateEvent::Done {
                output_tokens,
                e2e_us,
            } => Self::Done {
                output_tokens,
                e2e_us,
            },
            GenerateEvent::Error(e) => Self::Error(e),
        }
    }

    fn to_previous(&self) -> GenerateEvent {
        match self {
            Self::PrefillDone {
                ttft_us,
                cached_blocks,
                prompt_blocks,
                ..
            } => GenerateEvent::PrefillDone {
                ttft_us: *ttft_us,
                cached_blocks: *cached_blocks,
                prompt_blocks: *prompt_blocks,
            },
            Self::Tokens { itl_us } => GenerateEvent::Tokens {
                itl_us: itl_us.clone(),
            },
            Self::Done {
                output_tokens,
                e2e_us,
            } => GenerateEvent::Done {
                output_tokens: *output_tokens,
                e2e_us: *e2e_us,
            },
            Self::Error(e) => GenerateEvent::Error(e.clone()),
        }
    }
}

// Every message encoded the same in versions 3 and 4 (`EventMarks` is new in 4: a version-3
// peer never sends it and never subscribes to it).
unchanged_since_previous!(
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
    SyncBatch,
    SyncStateRequest,
    IndexerQuery,
    IndexerRecord,
    IndexerDumpRequest,
    IndexerDumpChunk,
    GenerateRequest,
    IndexerAnnouncement,
);

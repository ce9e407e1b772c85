//! Format version 7, the previous version: the types version 8 changed, as version 7 encodes
//! them, and how they convert. Version 8 added a W3C trace context: `trace` (the caller's
//! span) on `RouteRequest` and `DisaggRouteRequest`. A version-7 caller's routes carry no
//! trace; a request written as version 7 drops it.
//!
//! FROZEN: these types are what version-7 peers send and read. Never change them (fields,
//! their order, their types, enum variants); a test pins their bytes. The current types they
//! borrow (`Pin`, `RouteOverrides`, `Lease`, ...) encode as in version 7, as every type not
//! listed here does.

use crate::lease::Lease;
use crate::messages::*;
use crate::types::{PromptExtras, WorkerId};
use crate::wire::{unchanged_since_previous, Wire};
use serde::{Deserialize, Serialize};

/// [`crate::RouteRequest`] in version 7: no trace.
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
    pub fallbacks: u8,
}

/// A version-7 request is not traced.
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
            fallbacks: p.fallbacks,
            trace: None,
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
            fallbacks: self.fallbacks,
        }
    }
}

/// [`crate::DisaggRouteRequest`] in version 7: no trace.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DisaggRouteRequest {
    pub model: String,
    pub request_id: String,
    pub tokens: Vec<u32>,
    pub lora: Option<String>,
    pub allowed_workers: Option<Vec<WorkerId>>,
    pub update_states: bool,
    pub lease: Lease,
}

/// A version-7 request is not traced.
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
            lease: p.lease,
            trace: None,
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
            lease: self.lease,
        }
    }
}

// Every message encoded the same in versions 7 and 8.
unchanged_since_previous!(
    RouteDecision,
    DisaggDecision,
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

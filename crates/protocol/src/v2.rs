//! Format version 2, the previous version: the types version 3 changed, as version 2 encodes
//! them, and how they convert.
//!
//! FROZEN: these types are what version-2 peers send and read. Never change them (fields,
//! their order, their types, enum variants); a test pins their bytes. The current types they
//! borrow (`Pin`, `PromptExtras`, ...) encode as in version 2, as every type not listed here
//! does.

use crate::messages::*;
use crate::types::{KvEvent, PromptExtras, WorkerId};
use crate::wire::{unchanged_since_previous, Wire};
use serde::{Deserialize, Serialize};

/// [`crate::RouteRequest`] in version 2: no `excluded_workers`, no `overrides`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteRequest {
    pub model: String,
    pub request_id: String,
    pub tokens: Vec<u32>,
    pub lora: Option<String>,
    pub allowed_workers: Option<Vec<WorkerId>>,
    pub pin: Option<Pin>,
    pub update_states: bool,
    pub extras: Option<PromptExtras>,
}

/// A version-2 request excludes no worker and takes the replica's cost settings.
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
            excluded_workers: Vec::new(),
            overrides: None,
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
        }
    }
}

// Every message encoded the same in versions 2 and 3.
unchanged_since_previous!(
    Registration,
    RouteDecision,
    DisaggDecision,
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
    IndexerAnnouncement,
);

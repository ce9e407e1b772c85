//! The messages workers, replicas and clients exchange on the bus.
//!
//! Every payload is encoded with the codec (`encode`, `decode`). Replies to requests are
//! [`Reply<T>`]: the value or an [`ErrorReply`] with a machine-readable [`ErrorKind`].
//! docs/protocol.md lists which subject carries which message.

use crate::chunk::chunk_by_budget;
use crate::lease::Lease;
use crate::trace_context::TraceContext;
use crate::types::{DpRank, EventId, KvEvent, PromptExtras, TierBlocks, WorkerId, WorkerKey};
use serde::{Deserialize, Serialize};
use std::fmt;
use uuid::Uuid;

/// What a worker does in a disaggregated fleet.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum WorkerRole {
    #[default]
    Aggregated,
    Prefill,
    Decode,
}

impl WorkerRole {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Aggregated => "aggregated",
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        }
    }
}

impl fmt::Display for WorkerRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for WorkerRole {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "aggregated" => Ok(Self::Aggregated),
            "prefill" => Ok(Self::Prefill),
            "decode" => Ok(Self::Decode),
            other => Err(format!(
                "unknown role {other:?}: expected aggregated, prefill or decode"
            )),
        }
    }
}

/// Which inference engine serves a worker.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum EngineKind {
    /// The kvrouter mocker (simulated engine, no HTTP address).
    Mocker,
    Vllm,
    Sglang,
}

impl EngineKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Mocker => "mocker",
            Self::Vllm => "vllm",
            Self::Sglang => "sglang",
        }
    }
}

impl fmt::Display for EngineKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for EngineKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "mocker" => Ok(Self::Mocker),
            "vllm" => Ok(Self::Vllm),
            "sglang" => Ok(Self::Sglang),
            other => Err(format!(
                "unknown engine {other:?}: expected mocker, vllm or sglang"
            )),
        }
    }
}

/// A message a worker publishes about itself, on its own subjects
/// ([`crate::ModelSubjects::worker`]): the worker it speaks for, which must be the subject's.
pub trait FromWorker {
    fn worker_id(&self) -> WorkerId;
}

macro_rules! from_worker {
    ($($t:ty),*) => {$(
        impl FromWorker for $t {
            fn worker_id(&self) -> WorkerId {
                self.worker_id
            }
        }
    )*};
}

from_worker!(
    Registration,
    Heartbeat,
    Deregistration,
    KvEventBatch,
    LoadReport,
    TransferReport,
    EventMarks
);

/// A worker announcing itself: on start, on every "who is there", and again when asked.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    pub worker_id: WorkerId,
    /// New on every start of the worker process.
    pub instance_id: Uuid,
    pub model: String,
    pub role: WorkerRole,
    pub block_size: u32,
    pub dp_size: u32,
    pub dp_start_rank: DpRank,
    /// Ranks currently serving (a subset of `dp_start_rank .. dp_start_rank + dp_size`).
    pub live_ranks: Vec<DpRank>,
    pub tp_size: u32,
    /// KV cache capacity of each rank, in blocks.
    pub capacity_blocks: u64,
    /// How often heartbeats come; a replica's lease should span several.
    pub heartbeat_interval_ms: u32,
    /// New in format version 2.
    pub engine: EngineKind,
    /// Where a frontend sends this worker's requests over HTTP (e.g. `http://10.0.0.5:8000`);
    /// empty when the engine has no HTTP endpoint (the mocker). New in format version 2.
    pub base_url: String,
}

/// Largest `dp_size` and `tp_size` a replica accepts in a [`Registration`]: the router keeps
/// per-rank state, so a peer must not make it allocate for billions of ranks.
pub const MAX_PARALLEL_SIZE: u32 = 4096;

impl Registration {
    /// Every rank the worker was started with.
    pub fn ranks(&self) -> std::ops::Range<DpRank> {
        self.dp_start_rank..self.dp_start_rank.saturating_add(self.dp_size)
    }
}

/// Test hook of the mocker (`NS.model.MODEL.worker.WORKER.rank_live`): takes one rank of a
/// worker out of service (`live: false`) or back in. Answered `Reply<()>` when sent as a
/// request.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankLiveness {
    pub dp_rank: DpRank,
    pub live: bool,
}

/// Periodic proof of life; `live_ranks` dropping a rank takes that rank out of routing.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    pub worker_id: WorkerId,
    pub instance_id: Uuid,
    pub live_ranks: Vec<DpRank>,
}

/// A worker leaving on purpose (shutdown).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Deregistration {
    pub worker_id: WorkerId,
    pub instance_id: Uuid,
}

/// A replica asking every worker of a model to register again, at once.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WhoIsThere {
    pub replica_id: String,
}

/// KV events of one worker instance, in event-id order per rank.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvEventBatch {
    pub worker_id: WorkerId,
    pub instance_id: Uuid,
    pub events: Vec<KvEvent>,
}

/// Load of one rank as its engine sees it.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankLoad {
    pub dp_rank: DpRank,
    /// Blocks referenced by running requests.
    pub active_blocks: u64,
    pub waiting_requests: u64,
}

/// Load of every rank of one worker.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadReport {
    pub worker_id: WorkerId,
    pub instance_id: Uuid,
    pub ranks: Vec<RankLoad>,
}

/// The last event id a worker instance gave each of its ranks (those with any event),
/// published about once a second: a replica whose index of a rank is behind it lost the
/// rank's latest events, which no later event shows while the rank is quiet, and fetches the
/// rank's state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventMarks {
    pub worker_id: WorkerId,
    pub instance_id: Uuid,
    pub ranks: Vec<RankMark>,
}

/// The last event id of one rank.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankMark {
    pub dp_rank: DpRank,
    pub last_event_id: EventId,
}

/// Asks a worker for one rank's current cache (answered as a stream of [`StateChunk`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateQuery {
    pub dp_rank: DpRank,
}

/// One piece of a rank's state. Events rebuild the cache (parents first); every chunk carries
/// the rank's last event id at the time of the snapshot, so a replica knows which live
/// events the snapshot already contains.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateChunk {
    pub key: WorkerKey,
    pub instance_id: Uuid,
    pub last_event_id: Option<EventId>,
    pub events: Vec<KvEvent>,
}

/// Pins a request to a worker, or to one rank of it.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pin {
    pub worker_id: WorkerId,
    pub dp_rank: Option<DpRank>,
}

impl std::str::FromStr for Pin {
    type Err = String;

    /// `WORKER` (any of its ranks) or `WORKER:RANK`, as the CLI, the JSON API and the
    /// frontend's `kvrouter.pin` take it; the error says which part is wrong.
    fn from_str(s: &str) -> Result<Self, String> {
        let (worker, rank) = match s.split_once(':') {
            Some((w, r)) => (w.trim(), Some(r.trim())),
            None => (s.trim(), None),
        };
        let worker_id = worker
            .parse::<WorkerId>()
            .map_err(|_| format!("worker {worker:?} is not a worker id (a u64)"))?;
        let dp_rank = rank
            .map(|r| {
                r.parse::<DpRank>()
                    .map_err(|_| format!("rank {r:?} is not a rank (a u32)"))
            })
            .transpose()?;
        Ok(Self { worker_id, dp_rank })
    }
}

/// Which worker rank should serve these tokens?
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RouteRequest {
    pub model: String,
    pub request_id: String,
    pub tokens: Vec<u32>,
    pub lora: Option<String>,
    /// Only these workers may be chosen (`None`: any).
    pub allowed_workers: Option<Vec<WorkerId>>,
    pub pin: Option<Pin>,
    /// Track the request as active load (then `mark_prefill` and `free` must follow).
    pub update_states: bool,
    /// What the engine's cache keys depend on besides the tokens (`None`: nothing). New in
    /// format version 2.
    pub extras: Option<PromptExtras>,
    /// Workers that must not be chosen (a frontend routing around a worker that just failed
    /// it). New in format version 3.
    pub excluded_workers: Vec<WorkerId>,
    /// This request's own cost settings, in place of the replica's (`None`: the replica's).
    /// New in format version 3.
    pub overrides: Option<RouteOverrides>,
    /// Seconds this request counts as having waited already when it must queue (0: none;
    /// finite, not negative). New in format version 5, as is the field below.
    pub priority_jump: f64,
    /// Output tokens the caller expects: their blocks count in the rank's decode load from
    /// the start (`None`: only what `add_output_block` reports).
    pub expected_output_tokens: Option<u32>,
    /// The caller's id for this route call, the same on every retry of it (0: none). When a
    /// retried call may have been booked by a replica that did not answer in time, the
    /// caller sends [`Abandon`] with it: a copy of the call that reaches a replica late is
    /// then turned away, while a new call for the same request id is not.
    pub call_id: u64,
    /// The lease the booking is held under (`update_states`): 128 random bits the caller
    /// keeps and presents with `mark_prefill`, `add_output_block`, `free` and [`Abandon`].
    /// [`Lease::NONE`] from a version-5 caller; replicas refuse a booking without a lease
    /// unless started with `--allow-unleased`. New in format version 6.
    pub lease: Lease,
    /// Up to this many next-best workers beside the choice, by cost, for a caller that can
    /// fall back (a gateway retrying elsewhere): other workers than the chosen one, the best
    /// rank of each (0: none; at most 8 are given, more asked for count as 8). They are
    /// not booked. New in format version 7.
    pub fallbacks: u8,
    /// The caller's span (the route call's parent) in the distributed trace the request
    /// belongs to (`None`: not traced; a context with a zero id counts as none). New in
    /// format version 8.
    pub trace: Option<TraceContext>,
}

/// Building a request: [`RouteRequest::new`] is a plain lookup (no request id, nothing
/// booked, no filters, no hints); the `with_*` methods set the rest.
///
/// ```
/// # use kvrouter_protocol::{Pin, RouteRequest};
/// let lookup = RouteRequest::new("m", vec![1, 2, 3]);
/// assert!(!lookup.update_states && lookup.request_id.is_empty());
/// let booked = RouteRequest::new("m", vec![1, 2, 3])
///     .booked("req-1")
///     .with_pin(Pin { worker_id: 7, dp_rank: None })
///     .with_expected_output_tokens(128);
/// assert!(booked.update_states && booked.request_id == "req-1");
/// ```
impl RouteRequest {
    /// A lookup of `tokens` for `model`: `update_states` false, every other field empty.
    pub fn new(model: impl Into<String>, tokens: Vec<u32>) -> Self {
        Self {
            model: model.into(),
            tokens,
            trace: None,
            ..Self::default()
        }
    }

    /// Book the request as active load under `request_id` (`update_states`: `mark_prefill`
    /// and `free` must follow), under a fresh random [`Lease`] (the decision carries it).
    pub fn booked(self, request_id: impl Into<String>) -> Self {
        self.with_request_id(request_id)
            .with_update_states(true)
            .with_lease(Lease::random())
    }

    /// The lease a booking is held under (see [`RouteRequest::lease`]).
    pub fn with_lease(mut self, lease: Lease) -> Self {
        self.lease = lease;
        self
    }

    /// Ask for up to `n` fallbacks beside the choice (see [`RouteRequest::fallbacks`]).
    pub fn with_fallbacks(mut self, n: u8) -> Self {
        self.fallbacks = n;
        self
    }

    /// The caller's span in the distributed trace the request belongs to (see
    /// [`RouteRequest::trace`]).
    pub fn with_trace(mut self, trace: Option<TraceContext>) -> Self {
        self.trace = trace;
        self
    }

    /// Name the request (booked or not: see [`RouteRequest::with_update_states`]).
    pub fn with_request_id(mut self, request_id: impl Into<String>) -> Self {
        self.request_id = request_id.into();
        self
    }

    /// Track the request as active load (`true`) or only look it up (`false`).
    pub fn with_update_states(mut self, update_states: bool) -> Self {
        self.update_states = update_states;
        self
    }

    /// The LoRA adapter the prompt runs with (`None`: the base model).
    pub fn with_lora(mut self, lora: impl Into<Option<String>>) -> Self {
        self.lora = lora.into();
        self
    }

    /// Only these workers may be chosen (`None`: any).
    pub fn with_allowed_workers(mut self, allowed: impl Into<Option<Vec<WorkerId>>>) -> Self {
        self.allowed_workers = allowed.into();
        self
    }

    /// These workers must not be chosen.
    pub fn with_excluded_workers(mut self, excluded: Vec<WorkerId>) -> Self {
        self.excluded_workers = excluded;
        self
    }

    /// Serve on this worker (and rank, if given), or not at all.
    pub fn with_pin(mut self, pin: impl Into<Option<Pin>>) -> Self {
        self.pin = pin.into();
        self
    }

    /// What the engine's cache keys depend on besides the tokens.
    pub fn with_extras(mut self, extras: impl Into<Option<PromptExtras>>) -> Self {
        self.extras = extras.into();
        self
    }

    /// This request's own cost settings, in place of the replica's.
    pub fn with_overrides(mut self, overrides: impl Into<Option<RouteOverrides>>) -> Self {
        self.overrides = overrides.into();
        self
    }

    /// Seconds this request counts as having waited already when it must queue.
    pub fn with_priority_jump(mut self, seconds: f64) -> Self {
        self.priority_jump = seconds;
        self
    }

    /// Output tokens the caller expects (their blocks count as decode load from the start).
    pub fn with_expected_output_tokens(mut self, tokens: impl Into<Option<u32>>) -> Self {
        self.expected_output_tokens = tokens.into();
        self
    }

    /// The caller's id for this route call, the same on every retry of it (0: none).
    pub fn with_call_id(mut self, call_id: u64) -> Self {
        self.call_id = call_id;
        self
    }

    /// Why `priority_jump` is unusable, if it is.
    pub fn invalid_priority_jump(&self) -> Option<f64> {
        let j = self.priority_jump;
        (!j.is_finite() || j < 0.0).then_some(j)
    }
}

/// Per-request cost settings (Dynamo's per-request router config override). Each `None`
/// keeps the replica's setting; a value must be finite and not negative.
#[derive(Copy, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RouteOverrides {
    /// How many prefill blocks one cached block saves (`--overlap-credit`).
    pub overlap_credit: Option<f64>,
    /// Softmax sampling temperature over costs; 0 picks the cheapest (`--router-temperature`).
    pub temperature: Option<f64>,
    /// Credit per block found in a worker's host memory (`--host-cache-hit-weight`). New in
    /// format version 4, as are the two below.
    pub host_cache_hit_weight: Option<f64>,
    /// Credit per block found on a worker's disk (`--disk-cache-hit-weight`).
    pub disk_cache_hit_weight: Option<f64>,
    /// Credit per block found in shared storage (`--shared-cache-hit-weight`).
    pub shared_cache_hit_weight: Option<f64>,
}

impl RouteOverrides {
    /// The first value that is not finite and non-negative, by field name.
    pub fn invalid(&self) -> Option<(&'static str, f64)> {
        [
            ("overlap_credit", self.overlap_credit),
            ("temperature", self.temperature),
            ("host_cache_hit_weight", self.host_cache_hit_weight),
            ("disk_cache_hit_weight", self.disk_cache_hit_weight),
            ("shared_cache_hit_weight", self.shared_cache_hit_weight),
        ]
        .into_iter()
        .find_map(|(name, v)| v.filter(|v| !v.is_finite() || *v < 0.0).map(|v| (name, v)))
    }
}

/// The choice, and the replica that made it (send `mark_prefill` and `free` there).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteDecision {
    pub worker_id: WorkerId,
    pub dp_rank: DpRank,
    pub overlap_blocks: u32,
    pub replica_id: String,
    /// The chosen worker's HTTP address from its registration (empty for the mocker). New
    /// in format version 2.
    pub base_url: String,
    /// The chosen rank's overlap by tier (`device` equals `overlap_blocks`). New in format
    /// version 4.
    pub tier_overlap_blocks: TierBlocks,
    /// Tokens per KV block of the model: a caller reports one `add_output_block` per this
    /// many generated tokens (0 from a version-4 replica: report none). New in format
    /// version 5.
    pub block_size: u32,
    /// The lease the booking is held under: the request's ([`Lease::NONE`] when nothing was
    /// booked, or from a version-5 replica). New in format version 6.
    pub lease: Lease,
    /// The next-best workers, best first, when the request asked for them (none from a
    /// version-6 replica). New in format version 7.
    pub fallbacks: Vec<Fallback>,
}

/// A worker a request may fall back to when its choice fails it (not booked).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fallback {
    pub worker_id: WorkerId,
    pub dp_rank: DpRank,
    /// Leading blocks of the request cached on the rank's device.
    pub overlap_blocks: u32,
    /// The worker's HTTP address from its registration (empty for the mocker).
    pub base_url: String,
}

impl RouteDecision {
    pub fn key(&self) -> WorkerKey {
        WorkerKey::new(self.worker_id, self.dp_rank)
    }
}

/// A [`RouteDecision`] as JSON: the answer to a replica's `POST /v1/route` and what
/// `kvrouter route` prints (never on the bus: JSON only, so fields may be added freely).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RouteAnswer {
    pub worker_id: WorkerId,
    pub dp_rank: DpRank,
    /// Leading blocks cached on the worker's device.
    pub overlap_blocks: u32,
    /// The cached prefix by tier: `{device, host, disk, shared}`.
    pub tier_overlap_blocks: TierBlocks,
    /// The worker's HTTP address from its registration (empty for the mocker).
    pub base_url: String,
    /// Send `prefill_done` and `free` with it; `null` for a request that updates no state
    /// and came without one.
    pub request_id: Option<String>,
    /// The replica that counts the request's load.
    pub replica_id: String,
    /// Tokens per KV block: report `output_block` once per this many generated tokens.
    pub block_size: u32,
    /// The booking's lease (32 hexadecimal digits): send it with `prefill_done`,
    /// `output_block` and `free`; `null` when nothing was booked.
    pub lease: Option<String>,
    /// The next-best workers, best first (`fallbacks` in the request; empty otherwise).
    pub fallbacks: Vec<Fallback>,
}

impl RouteAnswer {
    pub fn new(d: RouteDecision, request_id: &str) -> Self {
        Self {
            worker_id: d.worker_id,
            dp_rank: d.dp_rank,
            overlap_blocks: d.overlap_blocks,
            tier_overlap_blocks: d.tier_overlap_blocks,
            base_url: d.base_url,
            request_id: (!request_id.is_empty()).then(|| request_id.to_string()),
            replica_id: d.replica_id,
            block_size: d.block_size,
            lease: (!d.lease.is_none()).then(|| d.lease.to_hex()),
            fallbacks: d.fallbacks,
        }
    }
}

/// Which prefill worker rank, and then which decode worker rank, should serve these tokens?
/// (A model with a prefill pool and a decode pool; answered with a [`DisaggDecision`].)
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DisaggRouteRequest {
    pub model: String,
    pub request_id: String,
    pub tokens: Vec<u32>,
    pub lora: Option<String>,
    /// Only these workers may be chosen, in either pool (`None`: any).
    pub allowed_workers: Option<Vec<WorkerId>>,
    /// Track both halves as active load: the prefill half as [`prefill_request_id`], the
    /// decode half as `request_id` (each then needs `mark_prefill`/`free`, or transfer
    /// reports for the prefill half).
    pub update_states: bool,
    /// The lease both halves are booked under (see [`RouteRequest::lease`]). New in format
    /// version 6.
    pub lease: Lease,
    /// The caller's span (the route call's parent) in the distributed trace the request
    /// belongs to (`None`: not traced; a context with a zero id counts as none). New in
    /// format version 8.
    pub trace: Option<TraceContext>,
}

/// Both halves of a disaggregated decision, made by one replica. `decode.dp_rank` is the
/// decode worker's `dp_start_rank + (prefill rank offset mod its dp_size)`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DisaggDecision {
    pub prefill: RouteDecision,
    pub decode: RouteDecision,
    pub replica_id: String,
}

/// The id under which a replica tracks the prefill half of a disaggregated request.
pub fn prefill_request_id(request_id: &str) -> String {
    format!("{request_id}/prefill")
}

/// Which end of a KV transfer a tensor-parallel rank reports.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TransferSide {
    /// A prefill tp rank finished sending these requests' KV.
    Sent,
    /// A decode tp rank finished receiving these requests' KV.
    Received,
}

/// KV transfers one tensor-parallel rank of one worker rank finished.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferReport {
    pub worker_id: WorkerId,
    pub dp_rank: DpRank,
    pub tp_rank: u32,
    pub side: TransferSide,
    /// Request ids as the worker got them in `GenerateRequest`.
    pub request_ids: Vec<String>,
}

/// How many leading blocks of these tokens each worker rank holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OverlapRequest {
    pub model: String,
    pub tokens: Vec<u32>,
    pub lora: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OverlapScoresReply {
    pub block_size: u32,
    /// Worker ranks holding at least one leading block on the device, with that overlap.
    pub scores: Vec<(WorkerKey, u32)>,
    /// Worker ranks whose overlap a lower tier extends, split by tier. New in format
    /// version 4, as is `shared_blocks`.
    pub tier_overlap_blocks: Vec<(WorkerKey, TierBlocks)>,
    /// The shared-storage overlap of any rank not in `tier_overlap_blocks`.
    pub shared_blocks: u32,
}

/// What each worker rank's load would be if these tokens went there.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PotentialLoad {
    pub key: WorkerKey,
    pub overlap_blocks: u32,
    pub prefill_blocks: f64,
    pub decode_blocks: u64,
}

/// `mark_prefill` or `free` for a request routed with `update_states`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestUpdate {
    pub model: String,
    pub request_id: String,
    /// The booking's lease, from its route decision. New in format version 6.
    pub lease: Lease,
}

/// A running request generated another block of output (`add_output_block`), sent to the
/// replica that routed it with `update_states`. New in format version 5.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OutputBlock {
    pub model: String,
    pub request_id: String,
    /// The share of the request's output load still to count, in `[0, 1]`: the caller's
    /// estimate of how much of its decode is still ahead (`None`: all of it).
    pub decay_fraction: Option<f64>,
    /// The booking's lease, from its route decision. New in format version 6.
    pub lease: Lease,
}

impl OutputBlock {
    /// `decay_fraction` when it is not a number in `[0, 1]`.
    pub fn invalid_decay_fraction(&self) -> Option<f64> {
        self.decay_fraction.filter(|f| !(0.0..=1.0).contains(f))
    }
}

/// A route call its caller sent more than once (an attempt timed out, or its answer was lost
/// in a NATS outage), broadcast to every replica on `NS.router.abandon`: each replica but
/// `kept_by` (the one whose answer the caller holds; `None`: it got none) frees its booking
/// of `request_id` (and of its prefill half) and turns away a copy of call `call_id` that
/// reaches it later. New in format version 5.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Abandon {
    pub model: String,
    pub request_id: String,
    pub call_id: u64,
    pub kept_by: Option<String>,
    /// The lease the call was made with: a replica frees only a booking held under it, and
    /// turns away only a late copy carrying it. New in format version 6.
    pub lease: Lease,
}

/// One change to a replica's active sequences, shared with its peers (`--replica-sync`).
/// Request ids are global: `"{origin replica id}:{request id}"`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SeqChange {
    /// A request was routed to `key` with these blocks and uncached prompt tokens.
    Add {
        request_id: String,
        key: WorkerKey,
        sequence_hashes: Vec<crate::types::SequenceHash>,
        prefill_tokens: u64,
        /// Output blocks counted in its decode load (new in format version 5).
        output_blocks: u32,
    },
    /// Its prefill is done.
    Prefilled { request_id: String },
    /// It finished.
    Free { request_id: String },
    /// Its output now counts this many blocks of decode load (new in format version 5).
    Output {
        request_id: String,
        output_blocks: u32,
    },
}

/// Active-sequence changes of one replica for one model, in the order it made them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyncBatch {
    pub replica_id: String,
    pub model: String,
    pub changes: Vec<SeqChange>,
    /// The sending process (new on every start). New in format version 5, as is `seq`.
    pub instance_id: Uuid,
    /// 1, 2, ... per instance and model on the sync subject, so peers notice a lost batch;
    /// 0 in a catch-up answer and from a version-4 peer (not sequenced).
    pub seq: u64,
}

/// A joining replica asks a peer for every active sequence it knows of a model (answered as
/// a stream of `SyncBatch`es holding `Add`s).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyncStateRequest {
    pub replica_id: String,
    pub model: String,
}

/// A remote-indexer replica asks a serving indexer (`--serve-indexer`) which worker ranks
/// hold the leading blocks of a prompt (answered `Reply<OverlapScoresReply>`). The block size
/// is the asker's: a serving indexer with another one refuses the query.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexerQuery {
    pub block_size: u32,
    pub local_hashes: Vec<crate::types::LocalBlockHash>,
}

/// A route decision recorded on every serving indexer in approximate mode (`--no-kv-events`):
/// the request's blocks count as cached on `key`. `local_hashes` and `sequence_hashes` pair
/// up one to one (vectors of different lengths are refused).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexerRecord {
    pub key: WorkerKey,
    pub local_hashes: Vec<crate::types::LocalBlockHash>,
    pub sequence_hashes: Vec<crate::types::SequenceHash>,
}

/// A serving indexer starting in approximate mode asks a peer serving indexer for its
/// approximate index (answered as a stream of `Reply<IndexerDumpChunk>`, ended by the
/// end-of-stream marker), so that it does not start empty.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexerDumpRequest {
    /// The asker, for the answerer's logs.
    pub replica_id: String,
}

/// One assumed-cached block of an approximate index. Within a dump, a block comes after its
/// parent (the block before it in the prompt, on the same worker rank).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApproxEntry {
    pub key: WorkerKey,
    /// The sequence hash of the previous block; `None` for a prompt's first block.
    pub parent: Option<crate::types::SequenceHash>,
    pub sequence_hash: crate::types::SequenceHash,
    pub local_hash: crate::types::LocalBlockHash,
    /// Milliseconds the block has left before it expires on the peer.
    pub expires_in_ms: u64,
}

/// One piece of a peer's approximate index.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexerDumpChunk {
    /// The peer's block size for the model (`None` before its first worker registered): an
    /// asker with another one must not load the entries.
    pub block_size: Option<u32>,
    pub entries: Vec<ApproxEntry>,
}

/// A serving indexer is synced and answers lookups (`NS.model.MODEL.indexer.announce`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexerAnnouncement {
    pub replica_id: String,
}

/// Runs a request on one rank of a worker (answered as a stream of [`GenerateEvent`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GenerateRequest {
    pub request_id: String,
    pub tokens: Vec<u32>,
    pub max_tokens: u32,
    pub dp_rank: DpRank,
}

/// Progress of a generate request. Times are simulated engine time, in microseconds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum GenerateEvent {
    /// The prompt is in the cache and the first token is out.
    PrefillDone {
        ttft_us: u64,
        /// Leading prompt blocks the engine reused instead of computing, from any tier.
        cached_blocks: u32,
        prompt_blocks: u32,
        /// `cached_blocks` by the tier each block came from.
        tier_cached_blocks: TierBlocks,
    },
    /// Inter-token latencies of the next tokens, in order.
    Tokens {
        itl_us: Vec<u32>,
    },
    Done {
        output_tokens: u32,
        e2e_us: u64,
    },
    Error(ErrorReply),
}

/// Why a request failed, for machines.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ErrorKind {
    /// The payload could not be decoded (or had an unsupported format version).
    Malformed,
    UnknownModel,
    EmptyPrompt,
    PromptTooLong,
    UnknownWorker,
    InvalidRank,
    NoAllowedWorkers,
    NoWorkers,
    /// Every candidate is busy and the queue is full.
    Overloaded,
    UnknownRequest,
    DuplicateRequest,
    QueueTimeout,
    /// The replica is shutting down or not ready.
    Unavailable,
    InvalidRequest,
    Internal,
}

impl ErrorKind {
    /// Snake-case name, used as a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Malformed => "malformed",
            Self::UnknownModel => "unknown_model",
            Self::EmptyPrompt => "empty_prompt",
            Self::PromptTooLong => "prompt_too_long",
            Self::UnknownWorker => "unknown_worker",
            Self::InvalidRank => "invalid_rank",
            Self::NoAllowedWorkers => "no_allowed_workers",
            Self::NoWorkers => "no_workers",
            Self::Overloaded => "overloaded",
            Self::UnknownRequest => "unknown_request",
            Self::DuplicateRequest => "duplicate_request",
            Self::QueueTimeout => "queue_timeout",
            Self::Unavailable => "unavailable",
            Self::InvalidRequest => "invalid_request",
            Self::Internal => "internal",
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An error answer: a kind for machines, a message for people.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorReply {
    pub kind: ErrorKind,
    pub message: String,
}

impl ErrorReply {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }
}

impl fmt::Display for ErrorReply {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind, self.message)
    }
}

impl std::error::Error for ErrorReply {}

/// The answer to every request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Reply<T> {
    Ok(T),
    Err(ErrorReply),
}

impl<T> Reply<T> {
    pub fn into_result(self) -> Result<T, ErrorReply> {
        match self {
            Self::Ok(v) => Ok(v),
            Self::Err(e) => Err(e),
        }
    }
}

impl<T> From<Result<T, ErrorReply>> for Reply<T> {
    fn from(r: Result<T, ErrorReply>) -> Self {
        match r {
            Ok(v) => Self::Ok(v),
            Err(e) => Self::Err(e),
        }
    }
}

/// Splits events into batches whose encoding stays under `max_payload` (with room to spare
/// for the batch's own fields), in order. An event bigger than that travels alone: producers
/// keep single events under [`max_blocks_per_batch`] blocks.
pub fn chunk_events(events: Vec<KvEvent>, max_payload: usize) -> Vec<Vec<KvEvent>> {
    chunk_by_budget(events, (max_payload / 2).max(1), |ev| {
        ENCODED_EVENT_OVERHEAD + ENCODED_BYTES_PER_BLOCK * ev.block_count()
    })
}

/// Upper bound on the encoded size of one [`ApproxEntry`] (varint hashes, key, expiry).
pub const ENCODED_APPROX_ENTRY_BYTES: usize = 64;

/// Splits an approximate index dump into chunks whose encoding stays under `max_payload`
/// (with room to spare for the chunk's own fields), in order.
pub fn chunk_approx_entries(
    entries: Vec<ApproxEntry>,
    max_payload: usize,
) -> Vec<Vec<ApproxEntry>> {
    chunk_by_budget(entries, max_payload / 2, |_| ENCODED_APPROX_ENTRY_BYTES)
}

/// Upper bound on the encoded size of an event apart from its blocks (key, id, variant,
/// parent, lengths).
pub const ENCODED_EVENT_OVERHEAD: usize = 64;

/// Room a route request keeps for everything but its tokens (model, ids, LoRA, allowed
/// workers): the longest prompt a bus carries is `(max_payload - this) / 4` tokens.
pub const ROUTE_PAYLOAD_OVERHEAD: usize = 64 << 10;

/// The longest prompt (in tokens) whose route request fits `max_payload`.
pub fn max_prompt_tokens_for(max_payload: usize) -> usize {
    max_payload.saturating_sub(ROUTE_PAYLOAD_OVERHEAD) / 4
}

/// Bytes one block costs in an encoded event (engine hash + local hash).
pub const ENCODED_BYTES_PER_BLOCK: usize = 16;

/// The most blocks per event batch that fit `max_payload` with room for headers.
pub fn max_blocks_per_batch(max_payload: usize) -> usize {
    (max_payload / 2 / ENCODED_BYTES_PER_BLOCK).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{EngineBlockHash, KvEventData, LocalBlockHash, StoredBlock, Tier};
    use crate::{decode, encode};

    #[test]
    fn pins_parse_from_text() {
        let pin = |w, r| Pin {
            worker_id: w,
            dp_rank: r,
        };
        assert_eq!("7".parse(), Ok(pin(7, None)));
        assert_eq!(" 7 : 2 ".parse(), Ok(pin(7, Some(2))));
        assert_eq!(
            "18446744073709551615:4294967295".parse(),
            Ok(pin(u64::MAX, Some(u32::MAX)))
        );
        let err = |s: &str| s.parse::<Pin>().unwrap_err();
        assert_eq!(err("x:1"), "worker \"x\" is not a worker id (a u64)");
        assert_eq!(err("7:"), "rank \"\" is not a rank (a u32)");
        assert_eq!(err("1:2:3"), "rank \"2:3\" is not a rank (a u32)");
        assert_eq!(
            err("7:4294967296"),
            "rank \"4294967296\" is not a rank (a u32)"
        );
        assert_eq!(err(""), "worker \"\" is not a worker id (a u64)");
        assert_eq!(err("-1"), "worker \"-1\" is not a worker id (a u64)");
    }

    #[test]
    fn route_requests_build_from_a_plain_lookup() {
        let lookup = RouteRequest::new("m", vec![1, 2, 3]);
        assert_eq!(
            lookup,
            RouteRequest {
                model: "m".into(),
                request_id: String::new(),
                tokens: vec![1, 2, 3],
                lora: None,
                allowed_workers: None,
                pin: None,
                update_states: false,
                extras: None,
                excluded_workers: Vec::new(),
                overrides: None,
                priority_jump: 0.0,
                expected_output_tokens: None,
                call_id: 0,
                lease: crate::Lease::NONE,
                fallbacks: 0,
                trace: None,
            }
        );
        let pin = Pin {
            worker_id: 7,
            dp_rank: Some(1),
        };
        let extras = PromptExtras {
            block_extras: Vec::new(),
            cache_salt: Some("salt".into()),
        };
        let overrides = RouteOverrides {
            temperature: Some(0.5),
            ..RouteOverrides::default()
        };
        let trace = TraceContext {
            trace_id: [1; 16],
            parent_id: [2; 8],
            flags: 1,
        };
        let full = RouteRequest::new("m", vec![4])
            .booked("req-1")
            .with_lora("adapter".to_string())
            .with_allowed_workers(vec![7, 8])
            .with_excluded_workers(vec![9])
            .with_pin(pin)
            .with_extras(extras.clone())
            .with_overrides(overrides)
            .with_priority_jump(2.5)
            .with_expected_output_tokens(64)
            .with_call_id(42)
            .with_fallbacks(2)
            .with_trace(Some(trace));
        assert_eq!(
            full,
            RouteRequest {
                model: "m".into(),
                request_id: "req-1".into(),
                tokens: vec![4],
                lora: Some("adapter".into()),
                allowed_workers: Some(vec![7, 8]),
                pin: Some(pin),
                update_states: true,
                extras: Some(extras),
                excluded_workers: vec![9],
                overrides: Some(overrides),
                priority_jump: 2.5,
                expected_output_tokens: Some(64),
                call_id: 42,
                lease: full.lease,
                fallbacks: 2,
                trace: Some(trace),
            }
        );
        assert!(!full.lease.is_none(), "a booked route is leased");
        // Options pass through as they are; a named but untracked request stays a lookup.
        let named = RouteRequest::new("m", vec![])
            .with_request_id("r")
            .with_lora(None)
            .with_pin(None)
            .with_expected_output_tokens(None);
        assert_eq!(
            (named.request_id.as_str(), named.update_states),
            ("r", false)
        );
        assert_eq!(
            (named.lora, named.pin, named.expected_output_tokens),
            (None, None, None)
        );
        let unbooked = RouteRequest::new("m", vec![])
            .booked("r")
            .with_update_states(false);
        assert!(!unbooked.update_states);
    }

    #[test]
    fn replies_round_trip() {
        let ok: Reply<RouteDecision> = Reply::Ok(RouteDecision {
            worker_id: 7,
            dp_rank: 1,
            overlap_blocks: 3,
            replica_id: "r1".into(),
            base_url: String::new(),
            tier_overlap_blocks: TierBlocks {
                device: 3,
                host: 1,
                disk: 2,
                shared: 4,
            },
            block_size: 0,
            lease: crate::Lease::NONE,
            fallbacks: vec![Fallback {
                worker_id: 9,
                dp_rank: 0,
                overlap_blocks: 2,
                base_url: "http://10.0.0.9:8000".into(),
            }],
        });
        let back: Reply<RouteDecision> = decode(&encode(&ok).unwrap()).unwrap();
        assert_eq!(back, ok);
        let err: Reply<RouteDecision> =
            Reply::Err(ErrorReply::new(ErrorKind::UnknownModel, "no such model"));
        let back: Reply<RouteDecision> = decode(&encode(&err).unwrap()).unwrap();
        assert_eq!(
            back.into_result().unwrap_err().kind,
            ErrorKind::UnknownModel
        );
    }

    #[test]
    fn approx_dump_chunks_fit_the_payload_and_keep_order() {
        use crate::types::SequenceHash;
        let entries: Vec<ApproxEntry> = (0..5000u64)
            .map(|i| ApproxEntry {
                key: WorkerKey::new(u64::MAX - i, u32::MAX),
                parent: Some(SequenceHash(u64::MAX - i)),
                sequence_hash: SequenceHash(u64::MAX - 2 * i),
                local_hash: LocalBlockHash(u64::MAX / 3 + i),
                expires_in_ms: u64::MAX - i,
            })
            .collect();
        let max = 64 << 10;
        let chunks = chunk_approx_entries(entries.clone(), max);
        assert!(chunks.len() > 1);
        for c in &chunks {
            let chunk = IndexerDumpChunk {
                block_size: Some(u32::MAX),
                entries: c.clone(),
            };
            let reply: Reply<IndexerDumpChunk> = Reply::Ok(chunk);
            let bytes = encode(&reply).unwrap();
            assert!(bytes.len() <= max, "{} bytes", bytes.len());
            assert_eq!(decode::<Reply<IndexerDumpChunk>>(&bytes).unwrap(), reply);
        }
        assert_eq!(chunks.concat(), entries);
        assert!(chunk_approx_entries(Vec::new(), max).is_empty());
        assert_eq!(chunk_approx_entries(entries[..3].to_vec(), 1).len(), 3);
    }

    #[test]
    fn chunks_respect_the_block_budget_and_keep_order() {
        let ev = |id: u64, n: usize| KvEvent {
            tier: Tier::Device,
            key: WorkerKey::new(1, 0),
            event_id: id,
            data: KvEventData::Stored {
                parent: None,
                blocks: (0..n)
                    .map(|i| StoredBlock {
                        engine_hash: EngineBlockHash(i as u64),
                        local_hash: LocalBlockHash(i as u64),
                    })
                    .collect(),
            },
        };
        let events: Vec<_> = (0..10).map(|i| ev(i, 3)).collect();
        let chunks = chunk_events(events.clone(), 7);
        assert!(chunks
            .iter()
            .all(|c| c.iter().map(|e| e.block_count()).sum::<usize>() <= 7));
        let flat: Vec<_> = chunks.into_iter().flatten().collect();
        assert_eq!(flat, events);
        // One event bigger than the budget still goes out, alone.
        let chunks = chunk_events(vec![ev(0, 20), ev(1, 1)], 7);
        assert_eq!(chunks.len(), 2);
    }

    #[test]
    fn a_full_batch_fits_the_default_nats_payload() {
        let max_payload = 1 << 20;
        let n = max_blocks_per_batch(max_payload);
        let batch = KvEventBatch {
            worker_id: 1,
            instance_id: Uuid::nil(),
            events: vec![KvEvent {
                tier: Tier::Device,
                key: WorkerKey::new(1, 0),
                event_id: 0,
                data: KvEventData::Stored {
                    parent: Some(EngineBlockHash(1)),
                    blocks: vec![
                        StoredBlock {
                            engine_hash: EngineBlockHash(1),
                            local_hash: LocalBlockHash(2)
                        };
                        n
                    ],
                },
            }],
        };
        assert!(encode(&batch).unwrap().len() < max_payload);
    }

    #[test]
    fn disagg_messages_round_trip() {
        let d = |w, r| RouteDecision {
            worker_id: w,
            dp_rank: r,
            overlap_blocks: 1,
            replica_id: "r".into(),
            base_url: String::new(),
            tier_overlap_blocks: TierBlocks::default(),
            block_size: 0,
            lease: crate::Lease::NONE,
            fallbacks: Vec::new(),
        };
        let ok: Reply<DisaggDecision> = Reply::Ok(DisaggDecision {
            prefill: d(1, 2),
            decode: d(3, 1),
            replica_id: "r".into(),
        });
        assert_eq!(
            decode::<Reply<DisaggDecision>>(&encode(&ok).unwrap()).unwrap(),
            ok
        );
        let report = TransferReport {
            worker_id: 1,
            dp_rank: 2,
            tp_rank: 1,
            side: TransferSide::Received,
            request_ids: vec!["a".into()],
        };
        assert_eq!(
            decode::<TransferReport>(&encode(&report).unwrap()).unwrap(),
            report
        );
        assert_eq!(prefill_request_id("a"), "a/prefill");
    }

    #[test]
    fn roles_parse() {
        for r in [
            WorkerRole::Aggregated,
            WorkerRole::Prefill,
            WorkerRole::Decode,
        ] {
            assert_eq!(r.as_str().parse::<WorkerRole>().unwrap(), r);
        }
        assert!("both".parse::<WorkerRole>().is_err());
    }

    #[test]
    fn engines_parse_and_print() {
        for e in [EngineKind::Mocker, EngineKind::Vllm, EngineKind::Sglang] {
            assert_eq!(e.to_string().parse::<EngineKind>().unwrap(), e);
        }
        assert_eq!("vllm".parse::<EngineKind>(), Ok(EngineKind::Vllm));
        assert!("VLLM".parse::<EngineKind>().is_err());
        assert!("trtllm".parse::<EngineKind>().is_err());
    }
}

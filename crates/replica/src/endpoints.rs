//! The router endpoints: decode, validate, hash, read the index, ask the scheduler actor.
//!
//! Each request is handled in its own task ([`crate::serve`]), so a request waiting in the
//! scheduler's queue holds up nobody. Every failure is answered with an [`ErrorReply`].

use crate::layouts::aggregated_workers;
use crate::metrics::KeyLabels;
use crate::route_phases::{RouteClock, RoutePhase};
use crate::scheduler_actor::{route_job, Asker, Held, RouteJob, SchedulerMsg};
use crate::serve::{serve_requests, Answer, OneWay, Server};
use crate::state::{ModelShared, ReplicaShared};
use kvrouter_bus::Subscription;
use kvrouter_otlp::{Span, SpanKind};
use kvrouter_protocol::{
    prompt_local_hashes, sequence_hashes, Abandon, ErrorKind, ErrorReply, Fallback, Lease,
    LimitError, LocalBlockHash, OutputBlock, OverlapRequest, OverlapScoresReply, PotentialLoad,
    PromptExtras, RequestUpdate, RouteDecision, RouteRequest, SequenceHash, Tier, TraceContext,
    WorkerKey,
};
use kvrouter_scheduler::{RouteFilters, Selection};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tracing::Instrument;

/// Which endpoint a subscription serves.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Route,
    OverlapScores,
    PotentialLoads,
    MarkPrefill,
    Free,
    OutputBlock,
    Abandon,
}

impl Endpoint {
    /// The subject kind, as metrics name it.
    pub fn kind(self) -> &'static str {
        match self {
            Self::Route => "route",
            Self::OverlapScores => "overlap_scores",
            Self::PotentialLoads => "potential_loads",
            Self::MarkPrefill => "mark_prefill",
            Self::Free => "free",
            Self::OutputBlock => "add_output_block",
            Self::Abandon => "abandon",
        }
    }
}

/// Serves one endpoint's subscription in a task of its own.
pub fn spawn(
    endpoint: Endpoint,
    sub: Subscription,
    server: Server,
    shared: Arc<ReplicaShared>,
    max_prompt_tokens: usize,
) -> JoinHandle<()> {
    tokio::spawn(serve(endpoint, sub, server, shared, max_prompt_tokens))
}

type Serving = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// Serves one endpoint's subscription until it ends (see [`crate::serve::serve_requests`]).
pub fn serve(
    endpoint: Endpoint,
    sub: Subscription,
    server: Server,
    shared: Arc<ReplicaShared>,
    max_prompt_tokens: usize,
) -> Serving {
    let kind = endpoint.kind();
    match endpoint {
        Endpoint::Route => Box::pin(serve_requests(
            sub,
            server,
            kind,
            OneWay::Drop,
            move |req, mut clock| {
                let shared = shared.clone();
                async move {
                    let started = Instant::now();
                    let result = route(&shared, max_prompt_tokens, req, &mut clock).await;
                    observe_route(&shared, &result, started);
                    let encoded = match &result {
                        Ok((model, _)) if clock.is_on() => {
                            let model = model.clone();
                            let then = move |d: Duration| {
                                clock.add(RoutePhase::Encode, d);
                                record_phases(&shared, &model, &clock);
                            };
                            Some(Box::new(then) as Box<dyn FnOnce(Duration) + Send>)
                        }
                        _ => None,
                    };
                    Answer {
                        result: result.map(|(_, d)| d),
                        encoded,
                    }
                }
            },
        )),
        Endpoint::OverlapScores => Box::pin(serve_requests(
            sub,
            server,
            kind,
            OneWay::Drop,
            move |req, _| {
                let shared = shared.clone();
                async move { overlap_scores(&shared, max_prompt_tokens, req).await.into() }
            },
        )),
        Endpoint::PotentialLoads => Box::pin(serve_requests(
            sub,
            server,
            kind,
            OneWay::Drop,
            move |req, _| {
                let shared = shared.clone();
                async move {
                    potential_loads(&shared, max_prompt_tokens, req)
                        .await
                        .into()
                }
            },
        )),
        Endpoint::MarkPrefill | Endpoint::Free => Box::pin(serve_requests(
            sub,
            server,
            kind,
            OneWay::Handle,
            move |req, _| {
                let shared = shared.clone();
                async move { update(&shared, endpoint, req).await.into() }
            },
        )),
        Endpoint::OutputBlock => Box::pin(serve_requests(
            sub,
            server,
            kind,
            OneWay::Handle,
            move |req, _| {
                let shared = shared.clone();
                async move { output_block(&shared, req).await.into() }
            },
        )),
        Endpoint::Abandon => Box::pin(serve_requests(
            sub,
            server,
            kind,
            OneWay::Handle,
            move |req, _| {
                let shared = shared.clone();
                async move { abandon(&shared, req).into() }
            },
        )),
    }
}

/// Counts a route decision (the bus and HTTP endpoints alike).
pub(crate) fn observe_route(
    shared: &ReplicaShared,
    result: &Result<(String, RouteDecision), ErrorReply>,
    started: Instant,
) {
    // Errors are counted where they arise, by kind.
    if let Ok((model, d)) = result {
        let labels = crate::metrics::Metrics::model(model);
        let m = &shared.metrics;
        m.routes.get_or_create(&labels).inc();
        m.overlap_blocks
            .get_or_create(&labels)
            .observe(d.overlap_blocks as f64);
        for tier in Tier::ALL {
            let n = d.tier_overlap_blocks.get(tier);
            if n > 0 {
                let labels = crate::metrics::TierLabels {
                    model: model.clone(),
                    tier: tier.as_str(),
                };
                m.tier_hits.get_or_create(&labels).inc();
                m.tier_hit_blocks
                    .get_or_create(&labels)
                    .inc_by(u64::from(n));
            }
        }
        m.decision_seconds
            .get_or_create(&labels)
            .observe(started.elapsed().as_secs_f64());
    }
}

/// Observes a routed request's phases under its (served) model.
pub(crate) fn record_phases(shared: &ReplicaShared, model: &str, clock: &RouteClock) {
    if let Some(h) = shared.metrics.route_phases(model) {
        h.record(clock);
    }
}

pub(crate) fn error(shared: &ReplicaShared, model: &str, e: ErrorReply) -> ErrorReply {
    shared.metrics.error(model, e.kind);
    tracing::debug!(model, kind = %e.kind, message = %e.message, "request refused");
    e
}

/// An input over one of the protocol's limits (`kvrouter_protocol::limits`): answered
/// `invalid_request` (HTTP 400), the message naming the field, its size and the limit.
pub(crate) fn over_limit(shared: &ReplicaShared, model: &str, e: LimitError) -> ErrorReply {
    error(
        shared,
        model,
        ErrorReply::new(ErrorKind::InvalidRequest, e.to_string()),
    )
}

pub(crate) fn model<'a>(
    shared: &'a ReplicaShared,
    name: &str,
) -> Result<&'a Arc<ModelShared>, ErrorReply> {
    shared.models.get(name).ok_or_else(|| {
        let mut served: Vec<&str> = shared.models.keys().map(String::as_str).collect();
        served.sort_unstable();
        ErrorReply::new(
            ErrorKind::UnknownModel,
            format!(
                "model {name:?} is not served by this router (it serves {})",
                served.join(", ")
            ),
        )
    })
}

/// The prompt's local and sequence hashes, after the checks every endpoint shares.
pub(crate) fn hash_prompt(
    model: &ModelShared,
    tokens: &[u32],
    lora: Option<&str>,
    extras: Option<&PromptExtras>,
    max_prompt_tokens: usize,
) -> Result<(Vec<LocalBlockHash>, Vec<SequenceHash>), ErrorReply> {
    if tokens.is_empty() {
        return Err(ErrorReply::new(
            ErrorKind::EmptyPrompt,
            "the token list is empty",
        ));
    }
    if tokens.len() > max_prompt_tokens {
        return Err(ErrorReply::new(
            ErrorKind::PromptTooLong,
            format!(
                "the prompt has {} tokens, more than the {max_prompt_tokens} this router accepts (--max-prompt-tokens)",
                tokens.len()
            ),
        ));
    }
    let block_size = model.status.block_size().ok_or_else(|| {
        ErrorReply::new(
            ErrorKind::NoWorkers,
            format!("no worker of model {:?} has registered yet", model.name),
        )
    })?;
    let local = prompt_local_hashes(tokens, block_size as usize, lora, extras)
        .map_err(|e| ErrorReply::new(ErrorKind::Internal, e.to_string()))?;
    let seq = sequence_hashes(&local);
    Ok((local, seq))
}

/// Routes one request: the one route path of the bus and HTTP endpoints. Answers the
/// model's name with the decision (for [`observe_route`]); `clock` times its phases from
/// hashing to scheduling.
///
/// The route is a span of the caller's trace (`req.trace`), exported when the replica
/// exports: the choice, its overlap by tier, its cost and the runner-up's, the policy.
pub(crate) async fn route(
    shared: &ReplicaShared,
    max_prompt_tokens: usize,
    req: RouteRequest,
    clock: &mut RouteClock,
) -> Result<(String, RouteDecision), ErrorReply> {
    let parent = req.trace.and_then(TraceContext::valid);
    let mut span = shared
        .tracer
        .span("kvrouter.route", SpanKind::Server, parent);
    let out = route_traced(shared, max_prompt_tokens, req, clock, &mut span).await;
    if let Err(e) = &out {
        span.fail(e.kind.to_string());
    }
    out
}

async fn route_traced(
    shared: &ReplicaShared,
    max_prompt_tokens: usize,
    req: RouteRequest,
    clock: &mut RouteClock,
    span: &mut Span,
) -> Result<(String, RouteDecision), ErrorReply> {
    // Sizes first: nothing below copies, logs or looks up an oversize input.
    req.check_limits()
        .map_err(|e| over_limit(shared, &req.model, e))?;
    // Not entered: the overlap query may await (an entered span is not Send).
    let _span = tracing::debug_span!("route", model = %req.model, request_id = %req.request_id);
    if let Some(stalled) = shared.stall.stalled(crate::clock::now()) {
        // Its caller has likely given up and asked another replica: booking it would be
        // load nobody frees.
        return Err(error(
            shared,
            &req.model,
            ErrorReply::new(
                ErrorKind::Unavailable,
                format!(
                    "replica {} was stalled for {} ms (stopped or starved of CPU) and turns away the requests that waited through it: ask another replica",
                    shared.replica_id,
                    stalled.as_millis()
                ),
            ),
        ));
    }
    let m = model(shared, &req.model).map_err(|e| error(shared, &req.model, e))?;
    let (local, seq) = hash_prompt(
        m,
        &req.tokens,
        req.lora.as_deref(),
        req.extras.as_ref(),
        max_prompt_tokens,
    )
    .map_err(|e| error(shared, &req.model, e))?;
    // With the request's checks above: what a replica does before its index.
    clock.lap(RoutePhase::Hash);
    let has_block = !local.is_empty();
    if req.update_states && req.request_id.is_empty() {
        return Err(error(
            shared,
            &req.model,
            ErrorReply::new(
                ErrorKind::InvalidRequest,
                "update_states needs a request_id (mark_prefill and free name it)",
            ),
        ));
    }
    check_lease(shared, &req.model, req.update_states, req.lease)?;
    let overrides = req.overrides.unwrap_or_default();
    if let Some((field, value)) = overrides.invalid() {
        return Err(error(
            shared,
            &req.model,
            ErrorReply::new(
                ErrorKind::InvalidRequest,
                format!("overrides.{field} must be a finite number >= 0, got {value}"),
            ),
        ));
    }
    if let Some(jump) = req.invalid_priority_jump() {
        return Err(error(
            shared,
            &req.model,
            ErrorReply::new(
                ErrorKind::InvalidRequest,
                format!("priority_jump must be a finite number of seconds >= 0, got {jump}"),
            ),
        ));
    }
    let overlaps = m.find_overlaps(&local).instrument(_span.clone()).await;
    clock.lap(match m.remote_index {
        Some(_) => RoutePhase::IndexRemote,
        None => RoutePhase::IndexLocal,
    });
    // Approximate mode, or a silent rank: a decision that updates state feeds the index
    // once it is made.
    let record = (req.update_states && (m.recorder.is_some() || m.fallback.is_some()))
        .then(|| (local, seq.clone()));
    let (mut job, rx) = route_job(
        req.request_id,
        req.tokens.len(),
        seq,
        overlaps,
        req.update_states,
    );
    job.token.call_id = req.call_id;
    job.lease = req.lease;
    job.fallbacks = req.fallbacks;
    // Aggregated workers only, when the model also has prefill/decode ones.
    let allowed = aggregated_workers(&m.status.layouts, req.allowed_workers, req.pin.is_some());
    job.filters = RouteFilters::from_request(allowed, req.excluded_workers, req.pin);
    job.overrides = overrides;
    (job.priority_jump, job.expected_output_tokens) =
        (req.priority_jump, req.expected_output_tokens);
    drop(_span);
    let sel = schedule(shared, m, job, rx).await?;
    clock.lap(RoutePhase::Schedule);
    clock.split(RoutePhase::Schedule, RoutePhase::Queue, sel.queued);
    if let Some((local, seq)) = record {
        match (&m.recorder, &m.fallback) {
            (Some(r), _) => r.record(sel.key, local, seq),
            (None, Some(f)) if m.silence.lock().is_silent(sel.key) => f.record(sel.key, local, seq),
            _ => {}
        }
    }
    // Booked routes only: a lookup may never reach the engine.
    if has_block && req.update_states {
        note_routed(shared, m, sel.key);
    }
    if span.is_recording() {
        describe_choice(span, shared, m, &sel, req.tokens.len(), req.update_states);
    }
    Ok((
        req.model,
        RouteDecision {
            tier_overlap_blocks: sel.tier_overlap_blocks,
            worker_id: sel.key.worker_id,
            dp_rank: sel.key.dp_rank,
            overlap_blocks: sel.overlap_blocks,
            replica_id: shared.replica_id.clone(),
            base_url: m.status.layouts.base_url(sel.key.worker_id),
            block_size: m.status.block_size().unwrap_or(0),
            lease: booked_lease(req.update_states, req.lease),
            fallbacks: sel
                .fallbacks
                .iter()
                .map(|&(key, overlap_blocks)| Fallback {
                    worker_id: key.worker_id,
                    dp_rank: key.dp_rank,
                    overlap_blocks,
                    base_url: m.status.layouts.base_url(key.worker_id),
                })
                .collect(),
        },
    ))
}

/// A booked prompt of a full block or more went to `key`: its engine should publish KV
/// events for it (see `rank_silence`).
pub(crate) fn note_routed(shared: &ReplicaShared, m: &ModelShared, key: WorkerKey) {
    m.silence.lock().routed(key, Instant::now());
    (shared.metrics.rank_routes)
        .get_or_create(&KeyLabels::new(&m.name, key))
        .inc();
}

/// A route span's attributes: the choice and what it was weighed against.
pub(crate) fn describe_choice(
    span: &mut Span,
    shared: &ReplicaShared,
    m: &ModelShared,
    sel: &Selection,
    prompt_tokens: usize,
    booked: bool,
) {
    let t = sel.tier_overlap_blocks;
    span.set("kvrouter.model", m.name.clone());
    span.set("kvrouter.replica_id", shared.replica_id.clone());
    span.set("kvrouter.policy", shared.policy);
    span.set("kvrouter.worker_id", sel.key.worker_id);
    span.set("kvrouter.dp_rank", sel.key.dp_rank);
    span.set("kvrouter.prompt_tokens", prompt_tokens);
    span.set("kvrouter.overlap_blocks.device", t.device);
    span.set("kvrouter.overlap_blocks.host", t.host);
    span.set("kvrouter.overlap_blocks.disk", t.disk);
    span.set("kvrouter.overlap_blocks.shared", t.shared);
    span.set("kvrouter.cost", sel.cost);
    if let Some(r) = sel.runner_up_cost {
        span.set("kvrouter.runner_up_cost", r);
    }
    span.set("kvrouter.queued_seconds", sel.queued.as_secs_f64());
    span.set("kvrouter.booked", booked);
}

/// A booking needs a lease, unless the replica takes unleased ones (`--allow-unleased`: for
/// callers that know no leases).
pub(crate) fn check_lease(
    shared: &ReplicaShared,
    model: &str,
    update_states: bool,
    lease: Lease,
) -> Result<(), ErrorReply> {
    if !update_states || !lease.is_none() || shared.allow_unleased {
        return Ok(());
    }
    Err(error(
        shared,
        model,
        ErrorReply::new(
            ErrorKind::InvalidRequest,
            "a booked route (update_states) needs a lease: 128 random bits the caller keeps and presents to mark, extend, free or abandon the request (a caller without one is taken only by a replica started with --allow-unleased)",
        ),
    ))
}

/// The lease a decision carries: the request's, when it booked anything.
pub(crate) fn booked_lease(update_states: bool, lease: Lease) -> Lease {
    if update_states {
        lease
    } else {
        Lease::NONE
    }
}

/// Hands a route job to the model's scheduler actor and waits for its answer.
pub(crate) async fn schedule(
    shared: &ReplicaShared,
    m: &ModelShared,
    job: RouteJob,
    rx: oneshot::Receiver<Result<Selection, ErrorReply>>,
) -> Result<Selection, ErrorReply> {
    m.scheduler
        .send_message(SchedulerMsg::Route(job))
        .map_err(|_| unavailable(shared, &m.name))?;
    rx.await
        .map_err(|_| unavailable(shared, &m.name))?
        .map_err(|e| error(shared, &m.name, e))
}

pub(crate) fn unavailable(shared: &ReplicaShared, model: &str) -> ErrorReply {
    error(
        shared,
        model,
        ErrorReply::new(
            ErrorKind::Unavailable,
            "the model's scheduler has stopped (the replica is shutting down)",
        ),
    )
}

async fn overlap_scores(
    shared: &ReplicaShared,
    max_prompt_tokens: usize,
    req: OverlapRequest,
) -> Result<OverlapScoresReply, ErrorReply> {
    req.check_limits()
        .map_err(|e| over_limit(shared, &req.model, e))?;
    let m = model(shared, &req.model).map_err(|e| error(shared, &req.model, e))?;
    let (local, _) = hash_prompt(m, &req.tokens, req.lora.as_deref(), None, max_prompt_tokens)
        .map_err(|e| error(shared, &req.model, e))?;
    let mut found = m.find_overlaps(&local).await;
    found.scores.sort_unstable();
    found.tiers.sort_unstable_by_key(|(k, _)| *k);
    Ok(OverlapScoresReply {
        block_size: m.status.block_size().unwrap_or(0),
        scores: found.scores,
        tier_overlap_blocks: found.tiers,
        shared_blocks: found.shared_blocks,
    })
}

async fn potential_loads(
    shared: &ReplicaShared,
    max_prompt_tokens: usize,
    req: OverlapRequest,
) -> Result<Vec<PotentialLoad>, ErrorReply> {
    req.check_limits()
        .map_err(|e| over_limit(shared, &req.model, e))?;
    let m = model(shared, &req.model).map_err(|e| error(shared, &req.model, e))?;
    let (local, seq) = hash_prompt(m, &req.tokens, req.lora.as_deref(), None, max_prompt_tokens)
        .map_err(|e| error(shared, &req.model, e))?;
    let overlaps = m.find_overlaps(&local).await;
    let (tx, rx) = oneshot::channel();
    m.scheduler
        .send_message(SchedulerMsg::PotentialLoads {
            prompt_tokens: req.tokens.len(),
            sequence_hashes: seq,
            overlaps,
            reply: tx,
        })
        .map_err(|_| unavailable(shared, &req.model))?;
    let loads = rx.await.map_err(|_| unavailable(shared, &req.model))?;
    Ok(loads
        .into_iter()
        .map(|l| PotentialLoad {
            key: l.key,
            overlap_blocks: l.overlap_blocks,
            prefill_blocks: l.potential_prefill_blocks,
            decode_blocks: l.potential_decode_blocks,
        })
        .collect())
}

/// `mark_prefill` or `free` of a request this replica routed.
pub(crate) async fn update(
    shared: &ReplicaShared,
    endpoint: Endpoint,
    req: RequestUpdate,
) -> Result<(), ErrorReply> {
    req.check_limits()
        .map_err(|e| over_limit(shared, &req.model, e))?;
    let m = model(shared, &req.model).map_err(|e| error(shared, &req.model, e))?;
    let (tx, rx) = oneshot::channel();
    let asker = Asker::Holder(req.lease);
    let msg = match endpoint {
        Endpoint::MarkPrefill => SchedulerMsg::MarkPrefill(req.request_id.clone(), asker, tx),
        _ => SchedulerMsg::Free(req.request_id.clone(), asker, tx),
    };
    ask_known(shared, m, msg, rx, &req.request_id).await
}

/// `add_output_block` of a request this replica routed.
pub(crate) async fn output_block(
    shared: &ReplicaShared,
    req: OutputBlock,
) -> Result<(), ErrorReply> {
    req.check_limits()
        .map_err(|e| over_limit(shared, &req.model, e))?;
    let m = model(shared, &req.model).map_err(|e| error(shared, &req.model, e))?;
    if let Some(f) = req.invalid_decay_fraction() {
        return Err(error(
            shared,
            &req.model,
            ErrorReply::new(
                ErrorKind::InvalidRequest,
                format!("decay_fraction must be a number from 0 to 1, got {f}"),
            ),
        ));
    }
    let (tx, rx) = oneshot::channel();
    let msg = SchedulerMsg::OutputBlock {
        request_id: req.request_id.clone(),
        decay_fraction: req.decay_fraction,
        asker: Asker::Holder(req.lease),
        reply: tx,
    };
    ask_known(shared, m, msg, rx, &req.request_id).await
}

/// A caller abandoned a route call after asking more than one replica: unless this replica's
/// answer is the one it kept, the model's scheduler drops its booking of it.
fn abandon(shared: &ReplicaShared, req: Abandon) -> Result<(), ErrorReply> {
    req.check_limits()
        .map_err(|e| over_limit(shared, &req.model, e))?;
    if req.kept_by.as_deref() == Some(shared.replica_id.as_str()) {
        return Ok(());
    }
    let m = model(shared, &req.model).map_err(|e| error(shared, &req.model, e))?;
    m.scheduler
        .send_message(SchedulerMsg::Abandon {
            request_id: req.request_id,
            call_id: req.call_id,
            lease: req.lease,
        })
        .map_err(|_| unavailable(shared, &m.name))
}

/// Sends an update about one request to the model's scheduler actor; `UnknownRequest` when
/// the actor does not hold it.
async fn ask_known(
    shared: &ReplicaShared,
    m: &ModelShared,
    msg: SchedulerMsg,
    held: oneshot::Receiver<Held>,
    request_id: &str,
) -> Result<(), ErrorReply> {
    m.scheduler
        .send_message(msg)
        .map_err(|_| unavailable(shared, &m.name))?;
    match held.await.map_err(|_| unavailable(shared, &m.name))? {
        Held::Done => Ok(()),
        // One answer for both: a caller without the lease learns nothing of the request.
        Held::Unknown | Held::WrongLease => Err(error(
            shared,
            &m.name,
            ErrorReply::new(
                ErrorKind::UnknownRequest,
                format!(
                    "request {request_id:?} is not active on replica {} under this lease (already freed, swept, routed elsewhere, or booked under another lease)",
                    shared.replica_id
                ),
            ),
        )),
    }
}

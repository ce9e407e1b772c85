//! The router endpoints: decode, validate, hash, read the index, ask the scheduler actor.
//!
//! Each request is handled in its own task, so a request waiting in the scheduler's queue
//! holds up nobody. Every failure is answered with an [`ErrorReply`]; nothing a peer sends
//! can stop the loop.

use crate::scheduler_actor::{RouteJob, RouteToken, SchedulerMsg};
use crate::state::{ModelShared, ReplicaShared};
use bytes::Bytes;
use kvrouter_bus::Message;
use kvrouter_protocol::Wire;
use kvrouter_protocol::{
    decode, encode, local_block_hashes, sequence_hashes, ErrorKind, ErrorReply, LocalBlockHash,
    OverlapRequest, OverlapScoresReply, Pin, PotentialLoad, Reply, RequestUpdate, RouteDecision,
    RouteRequest, SequenceHash, WorkerKey,
};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::oneshot;
use tracing::Instrument;

/// Requests being answered; shutdown waits for them.
#[derive(Default)]
pub struct InFlight(AtomicUsize);

impl InFlight {
    pub fn count(&self) -> usize {
        self.0.load(Ordering::Acquire)
    }
}

pub(crate) struct InFlightGuard(Arc<InFlight>);

impl InFlightGuard {
    pub(crate) fn new(f: &Arc<InFlight>) -> Self {
        f.0.fetch_add(1, Ordering::AcqRel);
        Self(f.clone())
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.0 .0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Which endpoint a message arrived on.
#[derive(Copy, Clone, Debug)]
pub enum Endpoint {
    Route,
    OverlapScores,
    PotentialLoads,
    MarkPrefill,
    Free,
}

/// Handles one request in a task of its own.
pub fn spawn_handler(
    shared: Arc<ReplicaShared>,
    inflight: &Arc<InFlight>,
    max_prompt_tokens: usize,
    endpoint: Endpoint,
    msg: Message,
) {
    let guard = InFlightGuard::new(inflight);
    tokio::spawn(async move {
        let _guard = guard;
        let Some(reply_to) = msg.reply.clone() else {
            // mark_prefill and free may be fire-and-forget; the others need an answer.
            match endpoint {
                Endpoint::MarkPrefill | Endpoint::Free => {
                    let _ = update(&shared, endpoint, &msg.payload).await;
                }
                _ => {
                    tracing::debug!(subject = %msg.subject, "request without a reply subject dropped")
                }
            }
            return;
        };
        let started = Instant::now();
        let payload = match endpoint {
            Endpoint::Route => {
                let result = route(&shared, max_prompt_tokens, &msg.payload).await;
                observe_route(&shared, &result, started);
                encode_reply(result.map(|(_, d)| d))
            }
            Endpoint::OverlapScores => {
                encode_reply(overlap_scores(&shared, max_prompt_tokens, &msg.payload).await)
            }
            Endpoint::PotentialLoads => {
                encode_reply(potential_loads(&shared, max_prompt_tokens, &msg.payload).await)
            }
            Endpoint::MarkPrefill | Endpoint::Free => {
                encode_reply(update(&shared, endpoint, &msg.payload).await)
            }
        };
        if let Err(e) = shared.bus.publish(&reply_to, payload).await {
            tracing::debug!(error = %e, "cannot send a reply (the requester may have gone)");
        }
    });
}

pub(crate) fn encode_reply<T: Wire>(result: Result<T, ErrorReply>) -> Bytes {
    let reply: Reply<T> = result.into();
    match encode(&reply) {
        Ok(b) => Bytes::from(b),
        Err(e) => {
            let err: Reply<()> = Reply::Err(ErrorReply::new(ErrorKind::Internal, e.to_string()));
            Bytes::from(encode(&err).unwrap_or_default())
        }
    }
}

fn observe_route(
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
        m.decision_seconds
            .get_or_create(&labels)
            .observe(started.elapsed().as_secs_f64());
    }
}

pub(crate) fn malformed(e: impl std::fmt::Display) -> ErrorReply {
    ErrorReply::new(
        ErrorKind::Malformed,
        format!("cannot decode the request: {e}"),
    )
}

pub(crate) fn error(shared: &ReplicaShared, model: &str, e: ErrorReply) -> ErrorReply {
    shared.metrics.error(model, e.kind);
    tracing::debug!(model, kind = %e.kind, message = %e.message, "request refused");
    e
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
    let local = local_block_hashes(tokens, block_size as usize, lora)
        .map_err(|e| ErrorReply::new(ErrorKind::Internal, e.to_string()))?;
    let seq = sequence_hashes(&local);
    Ok((local, seq))
}

async fn route(
    shared: &ReplicaShared,
    max_prompt_tokens: usize,
    payload: &[u8],
) -> Result<(String, RouteDecision), ErrorReply> {
    let req: RouteRequest = decode(payload).map_err(|e| error(shared, "", malformed(e)))?;
    // Not entered: the overlap query may await (an entered span is not Send).
    let _span = tracing::debug_span!("route", model = %req.model, request_id = %req.request_id);
    let m = model(shared, &req.model).map_err(|e| error(shared, "", e))?;
    let (local, seq) = hash_prompt(m, &req.tokens, req.lora.as_deref(), max_prompt_tokens)
        .map_err(|e| error(shared, &req.model, e))?;
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
    let overlaps = m.find_overlaps(&local).instrument(_span.clone()).await;
    // Approximate mode: a decision that updates state feeds the index once it is made.
    let record = match &m.recorder {
        Some(r) if req.update_states => Some((r, local, seq.clone())),
        _ => None,
    };
    let (pinned, pinned_worker) = match req.pin {
        Some(Pin {
            worker_id,
            dp_rank: Some(r),
        }) => (Some(WorkerKey::new(worker_id, r)), None),
        Some(Pin {
            worker_id,
            dp_rank: None,
        }) => (None, Some(worker_id)),
        None => (None, None),
    };
    let (tx, rx) = oneshot::channel();
    let job = RouteJob {
        request_id: req.request_id,
        prompt_tokens: req.tokens.len(),
        sequence_hashes: seq,
        // Aggregated workers only, when the model also has prefill/decode ones.
        allowed_workers: crate::disagg::aggregated_workers(
            &m.status.layouts,
            req.allowed_workers,
            req.pin.is_some(),
        ),
        pinned,
        pinned_worker,
        allowed_keys: None,
        overlaps,
        update_states: req.update_states,
        enqueued_at: crate::clock::now(),
        token: RouteToken {
            reply: tx,
            request_id: String::new(),
        },
    };
    drop(_span);
    m.scheduler
        .send_message(SchedulerMsg::Route(job))
        .map_err(|_| unavailable(shared, &req.model))?;
    let sel = rx
        .await
        .map_err(|_| unavailable(shared, &req.model))?
        .map_err(|e| error(shared, &req.model, e))?;
    if let Some((recorder, local, seq)) = record {
        recorder.record(sel.key, local, seq);
    }
    Ok((
        req.model,
        RouteDecision {
            worker_id: sel.key.worker_id,
            dp_rank: sel.key.dp_rank,
            overlap_blocks: sel.overlap_blocks,
            replica_id: shared.replica_id.clone(),
        },
    ))
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
    payload: &[u8],
) -> Result<OverlapScoresReply, ErrorReply> {
    let req: OverlapRequest = decode(payload).map_err(|e| error(shared, "", malformed(e)))?;
    let m = model(shared, &req.model).map_err(|e| error(shared, "", e))?;
    let (local, _) = hash_prompt(m, &req.tokens, req.lora.as_deref(), max_prompt_tokens)
        .map_err(|e| error(shared, &req.model, e))?;
    Ok(OverlapScoresReply {
        block_size: m.status.block_size().unwrap_or(0),
        scores: {
            let mut scores = m.find_overlaps(&local).await;
            scores.sort_unstable();
            scores
        },
    })
}

async fn potential_loads(
    shared: &ReplicaShared,
    max_prompt_tokens: usize,
    payload: &[u8],
) -> Result<Vec<PotentialLoad>, ErrorReply> {
    let req: OverlapRequest = decode(payload).map_err(|e| error(shared, "", malformed(e)))?;
    let m = model(shared, &req.model).map_err(|e| error(shared, "", e))?;
    let (local, seq) = hash_prompt(m, &req.tokens, req.lora.as_deref(), max_prompt_tokens)
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

async fn update(
    shared: &ReplicaShared,
    endpoint: Endpoint,
    payload: &[u8],
) -> Result<(), ErrorReply> {
    let req: RequestUpdate = decode(payload).map_err(|e| error(shared, "", malformed(e)))?;
    let m = model(shared, &req.model).map_err(|e| error(shared, "", e))?;
    let (tx, rx) = oneshot::channel();
    let msg = match endpoint {
        Endpoint::MarkPrefill => SchedulerMsg::MarkPrefill(req.request_id.clone(), tx),
        _ => SchedulerMsg::Free(req.request_id.clone(), tx),
    };
    m.scheduler
        .send_message(msg)
        .map_err(|_| unavailable(shared, &req.model))?;
    if rx.await.map_err(|_| unavailable(shared, &req.model))? {
        Ok(())
    } else {
        Err(error(
            shared,
            &req.model,
            ErrorReply::new(
                ErrorKind::UnknownRequest,
                format!(
                    "request {:?} is not active on replica {} (already freed, swept, or routed elsewhere)",
                    req.request_id, shared.replica_id
                ),
            ),
        ))
    }
}

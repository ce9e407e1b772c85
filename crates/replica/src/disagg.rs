//! Disaggregated prefill and decode: worker roles, the `route_disagg` endpoint, and KV
//! transfer reports.
//!
//! - [`Layouts`]: each registered worker's role and data-parallel layout, written by the
//!   fleet actor, read by the endpoints.
//! - Aggregated routes ([`aggregated_workers`]): when a model has aggregated workers as well
//!   as prefill or decode ones, `route` considers the aggregated ones only (unless the
//!   request pins a worker); a model with no aggregated worker routes over all its workers.
//! - `route_disagg`: a prefill worker rank among the model's prefill workers by overlap and
//!   load (the normal cost), then a decode worker among its decode workers by load, on the
//!   rank [`decode_rank`] gives (the prefill's rank offset carried over). With
//!   `update_states`, the prefill half is tracked as `{request_id}/prefill` with its
//!   uncached prompt tokens as prefill load, the decode half as `{request_id}` with no
//!   prefill load (its KV arrives by transfer).
//! - Transfer reports ([`crate::transfer`]): the prefill half is freed (its prefill load and
//!   blocks released) once every prefill tp rank reported the request sent, and not before.
//!   A side still incomplete after `ReplicaConfig::transfer_timeout` is logged once and
//!   counted (`transfers_overdue`); the prefill half then stays until its client frees it or
//!   the scheduler's request timeout sweeps it.

use crate::endpoints::{self, InFlight};
use crate::replica::{subscribe, ReplicaError};
use crate::scheduler_actor::{RouteJob, RouteToken, SchedulerMsg};
use crate::state::{ModelShared, ReplicaShared};
use crate::transfer::{ReportOutcome, TransferEnd, TransferTracker};
use kvrouter_bus::Message;
use kvrouter_protocol::{
    decode, prefill_request_id, DisaggDecision, DisaggRouteRequest, DpRank, ErrorKind, ErrorReply,
    Registration, RouteDecision, SequenceHash, Subjects, TransferReport, TransferSide, WorkerId,
    WorkerKey, WorkerRole,
};
use parking_lot::RwLock;
use rustc_hash::FxHashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

/// How long a disaggregated request may wait for its transfer reports before it is logged
/// and counted as overdue, by default ([`crate::ReplicaConfig::transfer_timeout`]).
pub const TRANSFER_TIMEOUT: Duration = Duration::from_secs(10);
/// When an incomplete transfer is dropped from tracking altogether.
pub const TRANSFER_MAX_AGE: Duration = Duration::from_secs(300);

/// A worker's role and data-parallel layout, from its registration.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct WorkerLayout {
    pub role: WorkerRole,
    pub dp_start_rank: DpRank,
    pub dp_size: u32,
    pub tp_size: u32,
}

impl WorkerLayout {
    pub fn of(reg: &Registration) -> Self {
        Self {
            role: reg.role,
            dp_start_rank: reg.dp_start_rank,
            dp_size: reg.dp_size,
            tp_size: reg.tp_size,
        }
    }
}

/// Every registered worker's layout (one model).
#[derive(Default)]
pub struct Layouts(RwLock<FxHashMap<WorkerId, WorkerLayout>>);

impl Layouts {
    pub fn set(&self, worker_id: WorkerId, layout: WorkerLayout) {
        self.0.write().insert(worker_id, layout);
    }

    pub fn remove(&self, worker_id: WorkerId) {
        self.0.write().remove(&worker_id);
    }

    pub fn get(&self, worker_id: WorkerId) -> Option<WorkerLayout> {
        self.0.read().get(&worker_id).copied()
    }

    /// Whether `key` is a rank of a registered worker (within its data-parallel ranks).
    pub fn has_rank(&self, key: WorkerKey) -> bool {
        self.get(key.worker_id).is_some_and(|l| {
            (l.dp_start_rank..l.dp_start_rank.saturating_add(l.dp_size)).contains(&key.dp_rank)
        })
    }

    /// Workers of a role, sorted, that `allowed` (if any) lists.
    pub fn workers_with(&self, role: WorkerRole, allowed: Option<&[WorkerId]>) -> Vec<WorkerId> {
        let mut out: Vec<WorkerId> = self
            .0
            .read()
            .iter()
            .filter(|(w, l)| l.role == role && allowed.is_none_or(|a| a.contains(w)))
            .map(|(&w, _)| w)
            .collect();
        out.sort_unstable();
        out
    }

    /// (workers of role `role`, workers of any other role).
    fn role_counts(&self, role: WorkerRole) -> (usize, usize) {
        let map = self.0.read();
        let n = map.values().filter(|l| l.role == role).count();
        (n, map.len() - n)
    }
}

/// The workers an aggregated `route` may use: unchanged when it pins a worker or when the
/// model's workers are all of one kind; otherwise its aggregated workers (within
/// `allowed`). A model with no aggregated worker routes over all of them.
pub fn aggregated_workers(
    layouts: &Layouts,
    allowed: Option<Vec<WorkerId>>,
    pinned: bool,
) -> Option<Vec<WorkerId>> {
    if pinned {
        return allowed;
    }
    match layouts.role_counts(WorkerRole::Aggregated) {
        (agg, others) if agg > 0 && others > 0 => {
            Some(layouts.workers_with(WorkerRole::Aggregated, allowed.as_deref()))
        }
        _ => allowed,
    }
}

/// The decode rank for a prefill on `prefill_rank` of a worker starting at
/// `prefill_start`: the decode worker's `decode_start + (offset mod decode_size)`.
pub fn decode_rank(
    prefill_rank: DpRank,
    prefill_start: DpRank,
    decode_start: DpRank,
    decode_size: u32,
) -> DpRank {
    let offset = prefill_rank.saturating_sub(prefill_start);
    decode_start.saturating_add(offset % decode_size.max(1))
}

/// One key per decode worker (within `allowed`): the rank the prefill's offset maps to.
pub fn decode_candidates(
    layouts: &Layouts,
    prefill: WorkerKey,
    prefill_layout: WorkerLayout,
    allowed: Option<&[WorkerId]>,
) -> Vec<WorkerKey> {
    let map = layouts.0.read();
    let mut out: Vec<WorkerKey> = map
        .iter()
        .filter(|(w, l)| l.role == WorkerRole::Decode && allowed.is_none_or(|a| a.contains(w)))
        .map(|(&w, l)| {
            WorkerKey::new(
                w,
                decode_rank(
                    prefill.dp_rank,
                    prefill_layout.dp_start_rank,
                    l.dp_start_rank,
                    l.dp_size,
                ),
            )
        })
        .collect();
    out.sort_unstable_by_key(|k| (k.worker_id, k.dp_rank));
    out
}

/// What the transfer task of one model takes.
pub enum TransferMsg {
    Expect {
        request_id: String,
        prefill: TransferEnd,
        decode: TransferEnd,
    },
    Report(TransferReport),
    Tick,
}

/// Per model: where the transfer task listens.
struct DisaggModel {
    shared: Arc<ModelShared>,
    transfers: mpsc::UnboundedSender<TransferMsg>,
}

/// Starts the `route_disagg` endpoint (returned first: stopped first on shutdown) and, per
/// model, the KV transfer tracker and its report subscription.
pub async fn start(
    shared: &Arc<ReplicaShared>,
    inflight: &Arc<InFlight>,
    max_prompt_tokens: usize,
    transfer_timeout: Duration,
    subjects: &Subjects,
    gate: &mut crate::route_gate::RouteGate,
) -> Result<(Vec<JoinHandle<()>>, Vec<JoinHandle<()>>), ReplicaError> {
    let bus = &shared.bus;
    // Overdue transfers are found at most a quarter of the timeout late (a short timeout is
    // for tests), at most every 500 ms.
    let tick_every =
        (transfer_timeout / 4).clamp(Duration::from_millis(10), Duration::from_millis(500));
    let mut back = Vec::new();
    let mut models = FxHashMap::default();
    for m in shared.models.values() {
        let (tx, rx) = mpsc::unbounded_channel();
        back.push(tokio::spawn(run_transfers(
            m.clone(),
            shared.metrics.clone(),
            transfer_timeout,
            rx,
        )));
        let mut sub = subscribe(bus, m.subjects.kv_transfer(), None).await?;
        let to = tx.clone();
        back.push(tokio::spawn(async move {
            while let Some(msg) = sub.next().await {
                match decode::<TransferReport>(&msg.payload) {
                    Ok(r) => {
                        let _ = to.send(TransferMsg::Report(r));
                    }
                    Err(e) => tracing::debug!(error = %e, "undecodable transfer report dropped"),
                }
            }
        }));
        let tick = tx.clone();
        back.push(tokio::spawn(async move {
            let mut every = tokio::time::interval(tick_every);
            loop {
                every.tick().await;
                if tick.send(TransferMsg::Tick).is_err() {
                    return;
                }
            }
        }));
        models.insert(
            m.name.clone(),
            Arc::new(DisaggModel {
                shared: m.clone(),
                transfers: tx,
            }),
        );
    }
    let models = Arc::new(models);
    let sub = gate.subscribe_later(subjects.route_disagg());
    let (shared, inflight) = (shared.clone(), inflight.clone());
    let front = tokio::spawn(async move {
        let Ok(mut sub) = sub.await else { return };
        while let Some(msg) = sub.next().await {
            spawn_route(
                shared.clone(),
                models.clone(),
                &inflight,
                max_prompt_tokens,
                msg,
            );
        }
    });
    Ok((vec![front], back))
}

fn spawn_route(
    shared: Arc<ReplicaShared>,
    models: Arc<FxHashMap<String, Arc<DisaggModel>>>,
    inflight: &Arc<InFlight>,
    max_prompt_tokens: usize,
    msg: Message,
) {
    let guard = endpoints::InFlightGuard::new(inflight);
    tokio::spawn(async move {
        let _guard = guard;
        let Some(reply_to) = msg.reply.clone() else {
            tracing::debug!(subject = %msg.subject, "request without a reply subject dropped");
            return;
        };
        let result = route_disagg(&shared, &models, max_prompt_tokens, &msg.payload).await;
        if let Ok(d) = &result {
            let labels = crate::metrics::Metrics::model(&d.0);
            shared.metrics.disagg_routes.get_or_create(&labels).inc();
        }
        let payload = endpoints::encode_reply(result.map(|(_, d)| d));
        if let Err(e) = shared.bus.publish(&reply_to, payload).await {
            tracing::debug!(error = %e, "cannot send a reply (the requester may have gone)");
        }
    });
}

/// Sends one route job to the model's scheduler and waits for the answer.
#[allow(clippy::too_many_arguments)]
async fn schedule(
    shared: &ReplicaShared,
    m: &ModelShared,
    request_id: String,
    prompt_tokens: usize,
    sequence_hashes: Vec<SequenceHash>,
    allowed_workers: Option<Vec<WorkerId>>,
    allowed_keys: Option<Vec<WorkerKey>>,
    overlaps: Vec<(WorkerKey, u32)>,
    update_states: bool,
) -> Result<kvrouter_scheduler::Selection, ErrorReply> {
    let (tx, rx) = oneshot::channel();
    let job = RouteJob {
        request_id,
        prompt_tokens,
        sequence_hashes,
        allowed_workers,
        pinned: None,
        pinned_worker: None,
        allowed_keys,
        overlaps,
        update_states,
        enqueued_at: crate::clock::now(),
        token: RouteToken {
            reply: tx,
            request_id: String::new(),
        },
    };
    m.scheduler
        .send_message(SchedulerMsg::Route(job))
        .map_err(|_| endpoints::unavailable(shared, &m.name))?;
    rx.await
        .map_err(|_| endpoints::unavailable(shared, &m.name))?
        .map_err(|e| endpoints::error(shared, &m.name, e))
}

/// Tells the scheduler to mark or free a request (fire and forget).
fn scheduler_update(m: &ModelShared, request_id: String, free: bool) {
    let (tx, _rx) = oneshot::channel();
    let msg = if free {
        SchedulerMsg::Free(request_id, tx)
    } else {
        SchedulerMsg::MarkPrefill(request_id, tx)
    };
    let _ = m.scheduler.send_message(msg);
}

fn no_pool(shared: &ReplicaShared, model: &str, role: WorkerRole) -> ErrorReply {
    endpoints::error(
        shared,
        model,
        ErrorReply::new(
            ErrorKind::NoWorkers,
            format!("model {model:?} has no {role} worker (allowed by the request)"),
        ),
    )
}

async fn route_disagg(
    shared: &ReplicaShared,
    models: &FxHashMap<String, Arc<DisaggModel>>,
    max_prompt_tokens: usize,
    payload: &[u8],
) -> Result<(String, DisaggDecision), ErrorReply> {
    let req: DisaggRouteRequest =
        decode(payload).map_err(|e| endpoints::error(shared, "", endpoints::malformed(e)))?;
    let dm = models.get(&req.model).ok_or_else(|| {
        let e = match endpoints::model(shared, &req.model) {
            Err(e) => e,
            Ok(_) => ErrorReply::new(ErrorKind::Internal, "model without disaggregation state"),
        };
        endpoints::error(shared, "", e)
    })?;
    let m = &dm.shared;
    let (local, seq) =
        endpoints::hash_prompt(m, &req.tokens, req.lora.as_deref(), max_prompt_tokens)
            .map_err(|e| endpoints::error(shared, &req.model, e))?;
    if req.update_states && req.request_id.is_empty() {
        return Err(endpoints::error(
            shared,
            &req.model,
            ErrorReply::new(
                ErrorKind::InvalidRequest,
                "update_states needs a request_id (mark_prefill, free and transfer reports name it)",
            ),
        ));
    }
    let layouts = &m.status.layouts;
    let allowed = req.allowed_workers.as_deref();
    let prefill_workers = layouts.workers_with(WorkerRole::Prefill, allowed);
    if prefill_workers.is_empty() {
        return Err(no_pool(shared, &req.model, WorkerRole::Prefill));
    }
    if layouts.workers_with(WorkerRole::Decode, allowed).is_empty() {
        return Err(no_pool(shared, &req.model, WorkerRole::Decode));
    }

    // Prefill: overlap and load, among prefill workers.
    let overlaps = m.find_overlaps(&local).await;
    let prefill_id = prefill_request_id(&req.request_id);
    let record = match &m.recorder {
        Some(r) if req.update_states => Some((r, local)),
        _ => None,
    };
    let pre = schedule(
        shared,
        m,
        prefill_id.clone(),
        req.tokens.len(),
        seq.clone(),
        Some(prefill_workers),
        None,
        overlaps,
        req.update_states,
    )
    .await?;
    let undo_prefill = || {
        if req.update_states {
            scheduler_update(m, prefill_id.clone(), true);
        }
    };

    // Decode: load alone, on the rank the prefill's offset maps to.
    let Some(pre_layout) = layouts.get(pre.key.worker_id) else {
        undo_prefill();
        return Err(no_pool(shared, &req.model, WorkerRole::Prefill));
    };
    let candidates = decode_candidates(layouts, pre.key, pre_layout, allowed);
    if candidates.is_empty() {
        undo_prefill();
        return Err(no_pool(shared, &req.model, WorkerRole::Decode));
    }
    let dec = match schedule(
        shared,
        m,
        req.request_id.clone(),
        req.tokens.len(),
        seq.clone(),
        None,
        Some(candidates),
        Vec::new(),
        req.update_states,
    )
    .await
    {
        Ok(d) => d,
        Err(e) => {
            undo_prefill();
            return Err(e);
        }
    };
    if req.update_states {
        // The decode worker computes no prefill: its KV arrives by transfer.
        scheduler_update(m, req.request_id.clone(), false);
        let dec_tp = layouts.get(dec.key.worker_id).map_or(1, |l| l.tp_size);
        let _ = dm.transfers.send(TransferMsg::Expect {
            request_id: req.request_id.clone(),
            prefill: TransferEnd {
                key: pre.key,
                tp_size: pre_layout.tp_size,
            },
            decode: TransferEnd {
                key: dec.key,
                tp_size: dec_tp,
            },
        });
    }
    if let Some((recorder, local)) = record {
        recorder.record(pre.key, local, seq);
    }
    let decision = |sel: &kvrouter_scheduler::Selection| RouteDecision {
        worker_id: sel.key.worker_id,
        dp_rank: sel.key.dp_rank,
        overlap_blocks: sel.overlap_blocks,
        replica_id: shared.replica_id.clone(),
    };
    tracing::debug!(model = %req.model, request_id = %req.request_id, prefill = %pre.key, decode = %dec.key, "disaggregated route");
    Ok((
        req.model.clone(),
        DisaggDecision {
            prefill: decision(&pre),
            decode: decision(&dec),
            replica_id: shared.replica_id.clone(),
        },
    ))
}

/// Owns the model's [`TransferTracker`]: frees the prefill half of a request once every
/// prefill tp rank sent it; logs what stays incomplete.
async fn run_transfers(
    m: Arc<ModelShared>,
    metrics: Arc<crate::metrics::Metrics>,
    timeout: Duration,
    mut rx: mpsc::UnboundedReceiver<TransferMsg>,
) {
    let mut t = TransferTracker::new(timeout, TRANSFER_MAX_AGE);
    let model = m.name.clone();
    let labels = crate::metrics::Metrics::model(&model);
    let mut seen = crate::transfer::TransferCounters::default();
    while let Some(msg) = rx.recv().await {
        match msg {
            TransferMsg::Expect {
                request_id,
                prefill,
                decode,
            } => {
                t.expect(&request_id, prefill, decode, Instant::now());
            }
            TransferMsg::Report(r) => {
                let key = WorkerKey::new(r.worker_id, r.dp_rank);
                for id in &r.request_ids {
                    match t.report(key, r.tp_rank, r.side, id) {
                        ReportOutcome::Completed(TransferSide::Sent) => {
                            tracing::debug!(%model, request_id = %id, "KV sent by every prefill tp rank; prefill released");
                            scheduler_update(&m, prefill_request_id(id), true);
                        }
                        ReportOutcome::Completed(TransferSide::Received) => {
                            tracing::debug!(%model, request_id = %id, "KV received by every decode tp rank");
                        }
                        ReportOutcome::Unknown | ReportOutcome::Foreign => {
                            tracing::debug!(%model, request_id = %id, %key, tp_rank = r.tp_rank, "transfer report for no pending transfer dropped");
                        }
                        ReportOutcome::Pending | ReportOutcome::Duplicate => {}
                    }
                }
            }
            TransferMsg::Tick => {
                // A worker that left will never report: its transfers are not overdue, gone.
                for id in t.forget_workers(|w| m.status.layouts.get(w).is_none()) {
                    tracing::info!(%model, request_id = %id, "KV transfer abandoned: its prefill or decode worker left");
                }
                for o in t.expire(Instant::now()) {
                    tracing::warn!(
                        %model,
                        request_id = %o.request_id,
                        side = ?o.side,
                        worker = o.end.key.worker_id,
                        dp_rank = o.end.key.dp_rank,
                        missing_tp_ranks = ?o.missing_tp_ranks,
                        dropped = o.dropped,
                        "KV transfer incomplete"
                    );
                }
            }
        }
        let c = t.counters();
        let overdue = (c.overdue + c.dropped).saturating_sub(seen.overdue + seen.dropped);
        for (reason, now, before) in [
            ("not_pending", c.unknown, seen.unknown),
            ("wrong_rank", c.foreign, seen.foreign),
            ("duplicate", c.duplicate, seen.duplicate),
        ] {
            if now > before {
                metrics
                    .transfer_reports_dropped
                    .get_or_create(&crate::metrics::ReasonLabels::new(&model, reason))
                    .inc_by(now - before);
            }
        }
        seen = c;
        if overdue > 0 {
            metrics
                .transfers_overdue
                .get_or_create(&labels)
                .inc_by(overdue);
        }
        metrics
            .transfers_pending
            .get_or_create(&labels)
            .set(t.pending_count() as i64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(role: WorkerRole, start: u32, size: u32) -> WorkerLayout {
        WorkerLayout {
            role,
            dp_start_rank: start,
            dp_size: size,
            tp_size: 1,
        }
    }

    #[test]
    fn decode_rank_carries_the_prefill_offset() {
        // Prefill ranks 2..4, decode ranks 0..4: offsets 0, 1.
        assert_eq!(decode_rank(2, 2, 0, 4), 0);
        assert_eq!(decode_rank(3, 2, 0, 4), 1);
        // Offset modulo the decode worker's dp size.
        assert_eq!(decode_rank(7, 2, 10, 2), 11);
        assert_eq!(decode_rank(6, 2, 10, 2), 10);
        assert_eq!(decode_rank(0, 0, 5, 1), 5);
    }

    #[test]
    fn candidates_and_aggregated_filter() {
        let l = Layouts::default();
        l.set(1, layout(WorkerRole::Prefill, 2, 2));
        l.set(2, layout(WorkerRole::Decode, 0, 4));
        l.set(3, layout(WorkerRole::Decode, 8, 1));
        let pre = WorkerKey::new(1, 3);
        assert_eq!(
            decode_candidates(&l, pre, l.get(1).unwrap(), None),
            vec![WorkerKey::new(2, 1), WorkerKey::new(3, 8)]
        );
        assert_eq!(
            decode_candidates(&l, pre, l.get(1).unwrap(), Some(&[1, 3])),
            vec![WorkerKey::new(3, 8)]
        );
        // No aggregated worker: aggregated routes keep every worker.
        assert_eq!(aggregated_workers(&l, None, false), None);
        l.set(4, layout(WorkerRole::Aggregated, 0, 1));
        assert_eq!(aggregated_workers(&l, None, false), Some(vec![4]));
        assert_eq!(aggregated_workers(&l, Some(vec![1]), false), Some(vec![]));
        assert_eq!(aggregated_workers(&l, Some(vec![1]), true), Some(vec![1]));
        assert_eq!(l.workers_with(WorkerRole::Decode, Some(&[2, 4])), vec![2]);
        l.remove(2);
        assert_eq!(l.workers_with(WorkerRole::Decode, None), vec![3]);
    }
}

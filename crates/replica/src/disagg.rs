//! Disaggregated prefill and decode: the `route_disagg` endpoint and KV transfer reports.
//! Worker roles and the candidate rules live in [`crate::layouts`].
//!
//! - `route_disagg`: a prefill worker rank among the model's prefill workers by overlap and
//!   load (the normal cost), then a decode worker among its decode workers by load, on the
//!   rank [`crate::layouts::decode_rank`] gives (the prefill's rank offset carried over). With
//!   `update_states`, the prefill half is tracked as `{request_id}/prefill` with its
//!   uncached prompt tokens as prefill load, the decode half as `{request_id}` with no
//!   prefill load (its KV arrives by transfer).
//! - Transfer reports ([`crate::transfer`]): the prefill half is freed (its prefill load and
//!   blocks released) once every prefill tp rank reported the request sent, and not before.
//!   A side still incomplete after `ReplicaConfig::transfer_timeout` is logged once and
//!   counted (`transfers_overdue`); the prefill half then stays until its client frees it or
//!   the scheduler's request timeout sweeps it.

use crate::config::ReplicaError;
use crate::endpoints;
use crate::endpoints::booked_lease;
use crate::layouts::decode_candidates;
use crate::metrics::Metrics;
use crate::route_gate::RouteGate;
use crate::scheduler_actor::{route_job, Asker, SchedulerMsg};
use crate::serve::{follow_workers, serve_requests, OneWay, Server};
use crate::state::{ModelShared, ReplicaShared};
use crate::transfer::{ReportOutcome, TransferEnd, TransferTracker};
use kvrouter_otlp::SpanKind;
use kvrouter_protocol::{
    prefill_request_id, DisaggDecision, DisaggRouteRequest, ErrorKind, ErrorReply, RouteDecision,
    Subjects, TraceContext, TransferReport, TransferSide, WorkerKey, WorkerRole, WorkerSubject,
};
use kvrouter_scheduler::RouteFilters;
use rustc_hash::FxHashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

/// When an incomplete transfer is dropped from tracking altogether.
pub const TRANSFER_MAX_AGE: Duration = Duration::from_secs(300);

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
    server: &Server,
    max_prompt_tokens: usize,
    transfer_timeout: Duration,
    subjects: &Subjects,
    gate: &mut RouteGate,
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
        let to = tx.clone();
        follow_workers(
            bus,
            &m.subjects,
            WorkerSubject::KvTransfer,
            &shared.metrics,
            "kv_transfer",
            move |r: TransferReport| {
                let _ = to.send(TransferMsg::Report(r));
            },
            &mut back,
        )
        .await?;
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
    let (shared, server) = (shared.clone(), server.clone());
    let front = tokio::spawn(async move {
        let Ok(sub) = sub.await else { return };
        serve_requests(
            sub,
            server,
            "route_disagg",
            OneWay::Drop,
            move |req: DisaggRouteRequest, _| {
                let (shared, models) = (shared.clone(), models.clone());
                async move {
                    let parent = req.trace.and_then(TraceContext::valid);
                    let mut span =
                        (shared.tracer).span("kvrouter.route_disagg", SpanKind::Server, parent);
                    let routed = route_disagg(&shared, &models, max_prompt_tokens, req).await;
                    match &routed {
                        Ok((model, d)) if span.is_recording() => {
                            span.set("kvrouter.model", model.clone());
                            span.set("kvrouter.replica_id", shared.replica_id.clone());
                            span.set("kvrouter.prefill.worker_id", d.prefill.worker_id);
                            span.set("kvrouter.prefill.dp_rank", d.prefill.dp_rank);
                            span.set(
                                "kvrouter.prefill.overlap_blocks.device",
                                d.prefill.overlap_blocks,
                            );
                            span.set("kvrouter.decode.worker_id", d.decode.worker_id);
                            span.set("kvrouter.decode.dp_rank", d.decode.dp_rank);
                        }
                        Err(e) => span.fail(e.kind.to_string()),
                        Ok(_) => {}
                    }
                    routed
                        .map(|(model, decision)| {
                            let labels = Metrics::model(&model);
                            shared.metrics.disagg_routes.get_or_create(&labels).inc();
                            decision
                        })
                        .into()
                }
            },
        )
        .await;
    });
    Ok((vec![front], back))
}

/// Tells the scheduler to mark or free a request (fire and forget).
fn scheduler_update(m: &ModelShared, request_id: String, free: bool) {
    let (tx, _rx) = oneshot::channel();
    let msg = if free {
        SchedulerMsg::Free(request_id, Asker::Replica, tx)
    } else {
        SchedulerMsg::MarkPrefill(request_id, Asker::Replica, tx)
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
    req: DisaggRouteRequest,
) -> Result<(String, DisaggDecision), ErrorReply> {
    req.check_limits()
        .map_err(|e| endpoints::over_limit(shared, &req.model, e))?;
    let dm = models.get(&req.model).ok_or_else(|| {
        let e = match endpoints::model(shared, &req.model) {
            Err(e) => e,
            Ok(_) => ErrorReply::new(ErrorKind::Internal, "model without disaggregation state"),
        };
        endpoints::error(shared, &req.model, e)
    })?;
    let m = &dm.shared;
    let (local, seq) =
        endpoints::hash_prompt(m, &req.tokens, req.lora.as_deref(), None, max_prompt_tokens)
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
    endpoints::check_lease(shared, &req.model, req.update_states, req.lease)?;
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
    let local_empty = local.is_empty();
    let record = match &m.recorder {
        Some(r) if req.update_states => Some((r, local)),
        _ => None,
    };
    let (mut job, rx) = route_job(
        prefill_id.clone(),
        req.tokens.len(),
        seq.clone(),
        overlaps,
        req.update_states,
    );
    job.lease = req.lease;
    job.filters = RouteFilters::only_workers(prefill_workers);
    let pre = endpoints::schedule(shared, m, job, rx).await?;
    if !local_empty && req.update_states {
        endpoints::note_routed(shared, m, pre.key);
    }
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
    let (mut job, rx) = route_job(
        req.request_id.clone(),
        req.tokens.len(),
        seq.clone(),
        Default::default(),
        req.update_states,
    );
    job.lease = req.lease;
    job.filters = RouteFilters::only_keys(candidates);
    let dec = match endpoints::schedule(shared, m, job, rx).await {
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
        tier_overlap_blocks: sel.tier_overlap_blocks,
        worker_id: sel.key.worker_id,
        dp_rank: sel.key.dp_rank,
        overlap_blocks: sel.overlap_blocks,
        replica_id: shared.replica_id.clone(),
        base_url: m.status.layouts.base_url(sel.key.worker_id),
        block_size: m.status.block_size().unwrap_or(0),
        lease: booked_lease(req.update_states, req.lease),
        fallbacks: Vec::new(),
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

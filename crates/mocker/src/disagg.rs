//! Prefill and decode roles: what a disaggregated worker does beyond an aggregated one.
//!
//! - A **prefill** worker runs every request as prefill only (`max_tokens` 0, whatever the
//!   request asks) and, once the prefill is done, each of its tensor-parallel ranks reports
//!   the request's KV as sent (`TransferReport { side: Sent }` on `kv_transfer`).
//! - A **decode** worker takes the request as its KV arriving: each tp rank reports it
//!   received at once, then the rank runs it with the prompt's KV transferred
//!   ([`RankEngine::submit_transferred`](crate::engine::RankEngine::submit_transferred)):
//!   the prompt's blocks are allocated and cached (published as `Stored`) without prefill
//!   compute, and the first token comes after one decode step. The transfer takes no
//!   simulated time.
//!
//! Reports go out one message per tp rank, as separate engines' ranks would send them.

use crate::engine::OutputKind;
use crate::rank_task::RankOut;
use crate::worker::{publish_msg, WorkerInfo};
use kvrouter_bus::Bus;
use kvrouter_protocol::{DpRank, TransferReport, TransferSide, WorkerRole};
use tokio::sync::mpsc;

/// One report per tp rank of the worker.
pub(crate) fn reports(
    info: &WorkerInfo,
    dp_rank: DpRank,
    side: TransferSide,
    request_id: &str,
) -> Vec<TransferReport> {
    (0..info.tp_size.max(1))
        .map(|tp_rank| TransferReport {
            worker_id: info.worker_id,
            dp_rank,
            tp_rank,
            side,
            request_ids: vec![request_id.to_string()],
        })
        .collect()
}

async fn publish_all(bus: &Bus, subject: &str, reports: Vec<TransferReport>) {
    for r in reports {
        if !publish_msg(bus, subject, &r).await {
            return;
        }
    }
}

/// The `max_tokens` a request runs with on a worker of this role.
pub(crate) fn max_tokens_for(role: WorkerRole, asked: u32) -> u32 {
    match role {
        WorkerRole::Prefill => 0,
        WorkerRole::Aggregated | WorkerRole::Decode => asked,
    }
}

/// Whether a request on a worker of this role arrives with its prompt's KV computed
/// elsewhere (a decode worker's): its rank then skips the prefill compute.
pub(crate) fn kv_transferred(role: WorkerRole) -> bool {
    matches!(role, WorkerRole::Decode)
}

/// Hooks a submitted request's output stream: a decode worker reports the KV received now;
/// a prefill worker reports it sent once the prefill is done. Returns the stream to serve.
pub(crate) fn hook(
    bus: &Bus,
    subject: &str,
    info: &WorkerInfo,
    dp_rank: DpRank,
    request_id: &str,
    rx: mpsc::UnboundedReceiver<RankOut>,
) -> mpsc::UnboundedReceiver<RankOut> {
    match info.role {
        WorkerRole::Aggregated => rx,
        WorkerRole::Decode => {
            let reports = reports(info, dp_rank, TransferSide::Received, request_id);
            let (bus, subject) = (bus.clone(), subject.to_string());
            tokio::spawn(async move { publish_all(&bus, &subject, reports).await });
            rx
        }
        WorkerRole::Prefill => {
            let reports = reports(info, dp_rank, TransferSide::Sent, request_id);
            let (bus, subject) = (bus.clone(), subject.to_string());
            let (tx, out) = mpsc::unbounded_channel();
            tokio::spawn(forward_prefill(rx, tx, bus, subject, reports));
            out
        }
    }
}

/// Passes a prefill rank's outputs on; after the request finished, publishes the reports.
async fn forward_prefill(
    mut rx: mpsc::UnboundedReceiver<RankOut>,
    tx: mpsc::UnboundedSender<RankOut>,
    bus: Bus,
    subject: String,
    reports: Vec<TransferReport>,
) {
    while let Some(out) = rx.recv().await {
        let finished = matches!(out, RankOut::Output(OutputKind::Finished { .. }));
        let _ = tx.send(out);
        if finished {
            publish_all(&bus, &subject, reports).await;
            return;
        }
    }
}

//! Prefill and decode roles: what a disaggregated worker does beyond an aggregated one.
//!
//! - A **prefill** worker runs every request as prefill only (`max_tokens` 0, whatever the
//!   request asks) and, once the prefill is done, each of its tensor-parallel ranks reports
//!   the request's KV as sent (`TransferReport { side: Sent }` on `kv_transfer`).
//! - A **decode** worker takes the request's KV by transfer, each tp rank on its own
//!   ([`Receive`]): a tp rank receives the prompt's blocks in `kv_transfer_per_block` of
//!   simulated time per block, then reports them received (`side: Received`). Only once
//!   every tp rank received does the rank get the request, with the prompt's KV transferred
//!   ([`RankEngine::submit_transferred`](crate::engine::RankEngine::submit_transferred)):
//!   the prompt's blocks are allocated and cached (published as `Stored`) without prefill
//!   compute, and the first token comes after one decode step (its TTFT counts the
//!   transfer). If not every tp rank received within `kv_receive_timeout` (wall time), the
//!   request fails with an `Unavailable` error naming the missing tp ranks.
//! - **Test hook** (`silence_tp_rank`): a silenced prefill tp rank never reports its KV
//!   sent; a silenced decode tp rank never receives (so its requests time out).
//!
//! Reports go out one message per tp rank, as separate engines' ranks would send them.

use crate::engine::{OutputKind, Request};
use crate::mock_info::MockInfo;
use crate::rank_task::{sim_to_wall, RankCmd, RankOut};
use kvrouter_bus::Bus;
use kvrouter_protocol::{DpRank, ErrorKind, ErrorReply, TransferReport, TransferSide, WorkerRole};
use kvrouter_worker::publish_msg;
use kvrouter_worker::stopped;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

/// One tp rank's report.
fn report(
    info: &MockInfo,
    dp_rank: DpRank,
    tp_rank: u32,
    side: TransferSide,
    request_id: &str,
) -> TransferReport {
    TransferReport {
        worker_id: info.worker_id,
        dp_rank,
        tp_rank,
        side,
        request_ids: vec![request_id.to_string()],
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
/// elsewhere (a decode worker's): it then waits for the transfer and skips the prefill.
pub(crate) fn kv_transferred(role: WorkerRole) -> bool {
    matches!(role, WorkerRole::Decode)
}

/// Hooks a submitted request's output stream: a prefill worker reports the KV sent once
/// the prefill is done. Returns the stream to serve.
pub(crate) fn hook(
    bus: &Bus,
    subject: &str,
    info: &Arc<MockInfo>,
    dp_rank: DpRank,
    request_id: &str,
    rx: mpsc::UnboundedReceiver<RankOut>,
) -> mpsc::UnboundedReceiver<RankOut> {
    match info.role {
        WorkerRole::Aggregated | WorkerRole::Decode => rx,
        WorkerRole::Prefill => {
            let (tx, out) = mpsc::unbounded_channel();
            tokio::spawn(forward_prefill(
                rx,
                tx,
                bus.clone(),
                subject.to_string(),
                info.clone(),
                dp_rank,
                request_id.to_string(),
            ));
            out
        }
    }
}

/// Passes a prefill rank's outputs on; after the request finished, each tp rank but a
/// silenced one reports it sent.
async fn forward_prefill(
    mut rx: mpsc::UnboundedReceiver<RankOut>,
    tx: mpsc::UnboundedSender<RankOut>,
    bus: Bus,
    subject: String,
    info: Arc<MockInfo>,
    dp_rank: DpRank,
    request_id: String,
) {
    while let Some(out) = rx.recv().await {
        let finished = matches!(out, RankOut::Output(OutputKind::Finished { .. }));
        let _ = tx.send(out);
        if finished {
            for tp_rank in 0..info.tp_size.max(1) {
                if info.silenced_tp_rank() == Some(tp_rank) {
                    tracing::info!(worker_id = info.worker_id, dp_rank, tp_rank, request_id = %request_id, "silenced tp rank: no Sent report (test hook)");
                    continue;
                }
                let r = report(&info, dp_rank, tp_rank, TransferSide::Sent, &request_id);
                if !publish_msg(&bus, &subject, &r).await {
                    return;
                }
            }
            return;
        }
    }
}

/// Simulated time one tp rank takes to receive a prompt of `prompt_tokens` tokens: every
/// block the prompt touches (a partial last block too) at `per_block`.
pub(crate) fn receive_time(prompt_tokens: usize, block_size: u32, per_block: Duration) -> Duration {
    let blocks = prompt_tokens.div_ceil(block_size.max(1) as usize);
    per_block.saturating_mul(u32::try_from(blocks).unwrap_or(u32::MAX))
}

/// Which tp ranks of one request have received its KV: a plain core.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Receipts {
    received: Vec<bool>,
    missing: u32,
}

impl Receipts {
    pub(crate) fn new(tp_size: u32) -> Self {
        let tp = tp_size.max(1);
        Self {
            received: vec![false; tp as usize],
            missing: tp,
        }
    }

    /// Records tp rank `tp_rank` as received; false if it already was or is no tp rank.
    pub(crate) fn receive(&mut self, tp_rank: u32) -> bool {
        match self.received.get_mut(tp_rank as usize) {
            Some(r) if !*r => {
                *r = true;
                self.missing -= 1;
                true
            }
            _ => false,
        }
    }

    pub(crate) fn complete(&self) -> bool {
        self.missing == 0
    }

    pub(crate) fn missing_ranks(&self) -> Vec<u32> {
        (0..self.received.len() as u32)
            .filter(|&r| !self.received[r as usize])
            .collect()
    }
}

/// A decode worker's request waiting for its KV: every tp rank receives on its own and
/// reports it; then the rank gets the request, or after the receive timeout the request
/// fails.
pub(crate) struct Receive {
    pub bus: Bus,
    pub subject: String,
    pub info: Arc<MockInfo>,
    pub dp_rank: DpRank,
    pub request: Request,
    pub rank: mpsc::UnboundedSender<RankCmd>,
    pub out: mpsc::UnboundedSender<RankOut>,
}

impl Receive {
    pub(crate) async fn run(self, mut shutdown: watch::Receiver<bool>) {
        let info = &self.info;
        let t = info.transfer;
        let start = Instant::now();
        let took = receive_time(self.request.tokens.len(), info.block_size, t.per_block);
        let deadline = start + t.receive_timeout;
        let mut receipts = Receipts::new(info.tp_size);
        // Each tp rank's receive is its own step; they run side by side, so they take the
        // same time and finish in tp rank order.
        let done_at = start + sim_to_wall(took, t.speedup);
        for tp_rank in 0..info.tp_size.max(1) {
            if done_at > deadline {
                break;
            }
            tokio::select! {
                biased;
                _ = stopped(&mut shutdown) => return,
                _ = tokio::time::sleep_until(done_at) => {}
            }
            if info.silenced_tp_rank() == Some(tp_rank) {
                tracing::info!(worker_id = info.worker_id, dp_rank = self.dp_rank, tp_rank, request_id = %self.request.request_id, "silenced tp rank: KV not received (test hook)");
                continue;
            }
            receipts.receive(tp_rank);
            let r = report(
                info,
                self.dp_rank,
                tp_rank,
                TransferSide::Received,
                &self.request.request_id,
            );
            publish_msg(&self.bus, &self.subject, &r).await;
        }
        if receipts.complete() {
            // Fails only when the rank has stopped: `out` is dropped and the stream says so.
            let _ = self.rank.send(RankCmd::Submit {
                request: self.request,
                transferred: Some(took),
                out: self.out,
            });
            return;
        }
        // Nothing else will arrive: fail the request once the timeout is up.
        tokio::select! {
            biased;
            _ = stopped(&mut shutdown) => return,
            _ = tokio::time::sleep_until(deadline) => {}
        }
        let missing = receipts.missing_ranks();
        tracing::warn!(worker_id = info.worker_id, dp_rank = self.dp_rank, request_id = %self.request.request_id, ?missing, "KV not received by every tp rank in time; request failed");
        let _ = self.out.send(RankOut::Failed(ErrorReply::new(
            ErrorKind::Unavailable,
            format!(
                "KV transfer of request {:?} incomplete: tp ranks {missing:?} of worker {} rank {} received nothing within {:?}",
                self.request.request_id, info.worker_id, self.dp_rank, t.receive_timeout
            ),
        )));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn receive_time_counts_every_touched_block() {
        let ms = Duration::from_millis;
        assert_eq!(receive_time(64, 16, ms(2)), ms(8));
        assert_eq!(receive_time(65, 16, ms(2)), ms(10));
        assert_eq!(receive_time(0, 16, ms(2)), Duration::ZERO);
        assert_eq!(
            receive_time(10, 0, ms(1)),
            ms(10),
            "block size 0 taken as 1"
        );
    }

    #[test]
    fn receipts_complete_only_with_every_tp_rank() {
        let mut r = Receipts::new(3);
        assert!(!r.complete());
        assert!(r.receive(2));
        assert!(!r.receive(2), "duplicate");
        assert!(!r.receive(3), "no such tp rank");
        assert!(r.receive(0));
        assert_eq!(r.missing_ranks(), vec![1]);
        assert!(!r.complete());
        assert!(r.receive(1));
        assert!(r.complete());
        assert!(r.missing_ranks().is_empty());
        let mut one = Receipts::new(0);
        assert!(one.receive(0), "tp size 0 counts as 1");
        assert!(one.complete());
    }
}

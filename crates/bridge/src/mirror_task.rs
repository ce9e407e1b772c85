//! The task that owns a bridge's [`WorkerMirror`]: engine batches in, kvrouter events out to
//! the publisher, state snapshots out to replicas.

use crate::engine_event::{BadEvents, EngineEvent, EventError};
use crate::metrics::{BridgeMetrics, RankLabel, ReasonLabel};
use crate::worker_mirror::{Skip, WorkerMirror};
use kvrouter_bus::Bus;
use kvrouter_protocol::{DpRank, ModelSubjects};
use kvrouter_worker::{announce, PubMsg, Snapshot, WorkerInfo};
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};

pub enum MirrorCmd {
    /// A decoded engine batch of `rank`, in sequence order.
    Batch {
        rank: DpRank,
        events: Vec<Result<EngineEvent, EventError>>,
        /// Bad events left out of `events`, counted as skipped all the same.
        more_bad: BadEvents,
    },
    /// Batches of `rank` were lost for good.
    Lost { rank: DpRank },
    /// `rank`'s engine process started again: a new worker instance.
    Restarted { rank: DpRank },
    /// The engine answers its health check again after failing it: assume it restarted
    /// (its cache may be gone; a cold start costs affinity, a stale index costs more).
    EngineBack,
    Snapshot {
        rank: DpRank,
        reply: oneshot::Sender<Option<Snapshot>>,
    },
}

pub struct MirrorTask {
    pub mirror: WorkerMirror,
    pub info: Arc<WorkerInfo>,
    pub publisher: mpsc::UnboundedSender<PubMsg>,
    pub metrics: Arc<BridgeMetrics>,
    pub bus: Bus,
    pub subjects: ModelSubjects,
    /// Per rank (from the first): nothing came from it since the instance was renewed, so
    /// its own restart signal is the same restart (ranks of one engine restart together).
    pub fresh: Vec<bool>,
}

impl MirrorTask {
    /// Runs until every sender of `rx` is gone.
    pub async fn run(mut self, mut rx: mpsc::Receiver<MirrorCmd>) {
        let mut reported = [0u64; Skip::ALL.len()];
        while let Some(cmd) = rx.recv().await {
            match cmd {
                MirrorCmd::Batch {
                    rank,
                    events,
                    more_bad,
                } => {
                    self.mirror.skip_bad(&more_bad);
                    if let Some(out) = self.mirror.apply(rank, &events) {
                        self.set_fresh(rank, false);
                        self.forward(rank, out);
                    }
                }
                MirrorCmd::Lost { rank } => {
                    if let Some(cleared) = self.mirror.clear_rank(rank) {
                        self.metrics
                            .ranks_cleared
                            .get_or_create(&RankLabel { dp_rank: rank })
                            .inc();
                        self.forward(rank, vec![cleared]);
                    }
                }
                MirrorCmd::Restarted { rank } => self.restarted(Some(rank)).await,
                MirrorCmd::EngineBack => self.restarted(None).await,
                MirrorCmd::Snapshot { rank, reply } => {
                    let snap = self
                        .mirror
                        .snapshot(rank)
                        .map(|(events, last_event_id)| Snapshot {
                            events,
                            last_event_id,
                        });
                    let _ = reply.send(snap);
                }
            }
            for (i, s) in Skip::ALL.iter().enumerate() {
                let now = self.mirror.skipped(*s);
                if now > reported[i] {
                    self.metrics
                        .events_skipped
                        .get_or_create(&ReasonLabel { reason: s.as_str() })
                        .inc_by(now - reported[i]);
                    reported[i] = now;
                }
            }
        }
    }

    fn forward(&self, rank: DpRank, events: Vec<kvrouter_protocol::KvEvent>) {
        if events.is_empty() {
            return;
        }
        self.metrics
            .events_forwarded
            .get_or_create(&RankLabel { dp_rank: rank })
            .inc_by(events.len() as u64);
        let _ = self.publisher.send(PubMsg::Events(events));
    }

    fn set_fresh(&mut self, rank: DpRank, fresh: bool) {
        let i = rank
            .checked_sub(self.info.dp_start_rank)
            .map(|i| i as usize);
        if let Some(f) = i.and_then(|i| self.fresh.get_mut(i)) {
            *f = fresh;
        }
    }

    /// Everything forwarded so far goes out under the old instance id; then the new one, with
    /// event ids from 0 and every rank's blocks gone (the engine's ranks restart together).
    /// Replicas see the new instance and drop the old state. A signal of the same restart
    /// (nothing came from the rank, or from any rank, since) changes nothing more.
    async fn restarted(&mut self, rank: Option<DpRank>) {
        let already = match rank {
            Some(rank) => {
                let i = rank
                    .checked_sub(self.info.dp_start_rank)
                    .map(|i| i as usize);
                i.and_then(|i| self.fresh.get(i)).copied().unwrap_or(true)
            }
            None => self.fresh.iter().all(|f| *f),
        };
        if already {
            return;
        }
        let (done, flushed) = oneshot::channel();
        if self.publisher.send(PubMsg::Flush(done)).is_ok() {
            let _ = flushed.await;
        }
        let old = self.info.instance_id();
        let new = self.info.renew_instance();
        self.mirror.new_instance();
        self.fresh.iter_mut().for_each(|f| *f = true);
        self.metrics.engine_restarts.inc();
        tracing::warn!(
            worker_id = self.info.worker_id,
            dp_rank = ?rank,
            old_instance = %old,
            new_instance = %new,
            "the engine restarted (its sequence numbers went back, its publisher came back as a \
             new process, or it is back after failing its health check): its cache is gone; \
             registering as a new instance"
        );
        announce(&self.bus, &self.subjects, &self.info).await;
    }
}

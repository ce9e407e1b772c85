//! What every task of one simulated worker shares: identity, registration fields, KV
//! transfer settings, live ranks and loads.

use kvrouter_protocol::{
    DpRank, EngineKind, Heartbeat, LoadReport, RankLoad, Registration, WorkerId, WorkerRole,
};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::futures::Notified;
use tokio::sync::Notify;
use uuid::Uuid;

/// How a prefill or decode worker's KV transfers behave.
#[derive(Copy, Clone, Debug)]
pub(crate) struct TransferConfig {
    /// Simulated time one tp rank takes to receive one prompt block.
    pub per_block: Duration,
    /// Wall time a decode worker waits for every tp rank to receive.
    pub receive_timeout: Duration,
    /// The fleet's speedup (simulated time / wall time).
    pub speedup: f64,
}

/// No tp rank silenced.
const NOT_SILENCED: u32 = u32::MAX;

/// What every task of one worker shares: identity, registration fields, live ranks, loads.
pub(crate) struct WorkerInfo {
    pub worker_id: WorkerId,
    pub instance_id: Uuid,
    pub model: String,
    pub role: WorkerRole,
    pub block_size: u32,
    pub dp_size: u32,
    pub dp_start_rank: DpRank,
    pub tp_size: u32,
    pub capacity_blocks: u64,
    pub heartbeat_interval_ms: u32,
    pub transfer: TransferConfig,
    /// The silenced tp rank (test hook), or [`NOT_SILENCED`].
    silenced_tp_rank: AtomicU32,
    live: Vec<AtomicBool>,
    loads: Mutex<Vec<RankLoad>>,
    load_dirty: AtomicBool,
    load_changed: Notify,
}

impl WorkerInfo {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        worker_id: WorkerId,
        model: String,
        role: WorkerRole,
        block_size: u32,
        dp_size: u32,
        dp_start_rank: DpRank,
        tp_size: u32,
        capacity_blocks: u64,
        heartbeat_interval_ms: u32,
        transfer: TransferConfig,
    ) -> Self {
        Self {
            worker_id,
            instance_id: Uuid::new_v4(),
            model,
            role,
            block_size,
            dp_size,
            dp_start_rank,
            tp_size,
            capacity_blocks,
            heartbeat_interval_ms,
            transfer,
            silenced_tp_rank: AtomicU32::new(NOT_SILENCED),
            live: (0..dp_size).map(|_| AtomicBool::new(true)).collect(),
            loads: Mutex::new(
                (0..dp_size)
                    .map(|i| RankLoad {
                        dp_rank: dp_start_rank + i,
                        active_blocks: 0,
                        waiting_requests: 0,
                    })
                    .collect(),
            ),
            load_dirty: AtomicBool::new(true),
            load_changed: Notify::new(),
        }
    }

    /// The tp rank that finishes no transfer (test hook).
    pub(crate) fn silenced_tp_rank(&self) -> Option<u32> {
        Some(self.silenced_tp_rank.load(Ordering::Acquire)).filter(|&tp| tp != NOT_SILENCED)
    }

    pub(crate) fn set_silenced_tp_rank(&self, tp_rank: Option<u32>) {
        self.silenced_tp_rank
            .store(tp_rank.unwrap_or(NOT_SILENCED), Ordering::Release);
    }

    /// Index of `rank` among this worker's ranks, if it is one of them.
    pub(crate) fn rank_index(&self, rank: DpRank) -> Option<usize> {
        rank.checked_sub(self.dp_start_rank)
            .filter(|&i| i < self.dp_size)
            .map(|i| i as usize)
    }

    /// Index of `rank` if it is one of this worker's ranks and live.
    pub(crate) fn live_rank_index(&self, rank: DpRank) -> Option<usize> {
        self.rank_index(rank)
            .filter(|&i| self.live[i].load(Ordering::Acquire))
    }

    /// Sets a rank live or not; returns whether that changed anything.
    pub(crate) fn set_live(&self, index: usize, live: bool) -> bool {
        self.live[index].swap(live, Ordering::AcqRel) != live
    }

    pub(crate) fn live_ranks(&self) -> Vec<DpRank> {
        self.live
            .iter()
            .enumerate()
            .filter(|(_, l)| l.load(Ordering::Acquire))
            .map(|(i, _)| self.dp_start_rank + i as u32)
            .collect()
    }

    pub(crate) fn registration(&self) -> Registration {
        Registration {
            worker_id: self.worker_id,
            instance_id: self.instance_id,
            model: self.model.clone(),
            role: self.role,
            block_size: self.block_size,
            dp_size: self.dp_size,
            dp_start_rank: self.dp_start_rank,
            live_ranks: self.live_ranks(),
            tp_size: self.tp_size,
            capacity_blocks: self.capacity_blocks,
            heartbeat_interval_ms: self.heartbeat_interval_ms,
            engine: EngineKind::Mocker,
            base_url: String::new(),
        }
    }

    pub(crate) fn heartbeat(&self) -> Heartbeat {
        Heartbeat {
            worker_id: self.worker_id,
            instance_id: self.instance_id,
            live_ranks: self.live_ranks(),
        }
    }

    /// Records a rank's new load and wakes the publisher.
    pub(crate) fn set_load(&self, index: usize, load: RankLoad) {
        {
            let mut loads = self.loads.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(slot) = loads.get_mut(index) {
                *slot = load;
            }
        }
        self.load_dirty.store(true, Ordering::Release);
        self.load_changed.notify_one();
    }

    /// Resolves once a rank's load changed (a wake-up stored by [`Self::set_load`] counts).
    pub(crate) fn load_changed(&self) -> Notified<'_> {
        self.load_changed.notified()
    }

    /// Whether a rank's load changed since the last [`Self::take_load_report`].
    pub(crate) fn load_dirty(&self) -> bool {
        self.load_dirty.load(Ordering::Acquire)
    }

    /// The load report of the live ranks, marking the loads reported.
    pub(crate) fn take_load_report(&self) -> LoadReport {
        self.load_dirty.store(false, Ordering::Release);
        self.load_report()
    }

    /// The load report of the live ranks.
    fn load_report(&self) -> LoadReport {
        let loads = self.loads.lock().unwrap_or_else(|e| e.into_inner());
        let ranks = loads
            .iter()
            .enumerate()
            .filter(|(i, _)| self.live[*i].load(Ordering::Acquire))
            .map(|(_, l)| *l)
            .collect();
        LoadReport {
            worker_id: self.worker_id,
            instance_id: self.instance_id,
            ranks,
        }
    }
}

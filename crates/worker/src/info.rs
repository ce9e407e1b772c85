//! What every task of one worker shares: identity, registration fields, live ranks, loads.

use kvrouter_protocol::{
    DpRank, EngineKind, Heartbeat, LoadReport, RankLoad, Registration, WorkerId, WorkerRole,
};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::sync::futures::Notified;
use tokio::sync::Notify;
use uuid::Uuid;

/// A worker's registration fields that never change while it runs.
#[derive(Clone, Debug)]
pub struct WorkerSpec {
    pub worker_id: WorkerId,
    pub model: String,
    pub role: WorkerRole,
    pub block_size: u32,
    pub dp_size: u32,
    pub dp_start_rank: DpRank,
    pub tp_size: u32,
    pub capacity_blocks: u64,
    pub heartbeat_interval_ms: u32,
    pub engine: EngineKind,
    pub base_url: String,
}

/// What every task of one worker shares: its spec (its fields read through `Deref`),
/// instance id, live ranks and loads.
pub struct WorkerInfo {
    spec: WorkerSpec,
    /// New at every start, and whenever the engine behind the worker restarts.
    instance_id: Mutex<Uuid>,
    live: Vec<AtomicBool>,
    loads: Mutex<Vec<RankLoad>>,
    load_dirty: AtomicBool,
    load_changed: Notify,
}

impl std::ops::Deref for WorkerInfo {
    type Target = WorkerSpec;

    fn deref(&self) -> &WorkerSpec {
        &self.spec
    }
}

impl WorkerInfo {
    /// Every rank starts live.
    pub fn new(spec: WorkerSpec) -> Self {
        Self::with_live(spec, true)
    }

    /// Every rank starts live or not (a bridge waits for its engine's health check).
    pub fn with_live(spec: WorkerSpec, live: bool) -> Self {
        let (dp_size, dp_start_rank) = (spec.dp_size, spec.dp_start_rank);
        Self {
            spec,
            instance_id: Mutex::new(Uuid::new_v4()),
            live: (0..dp_size).map(|_| AtomicBool::new(live)).collect(),
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

    pub fn instance_id(&self) -> Uuid {
        *self.instance_id.lock()
    }

    /// A new instance id (the engine restarted); returns it.
    pub fn renew_instance(&self) -> Uuid {
        let id = Uuid::new_v4();
        *self.instance_id.lock() = id;
        id
    }

    /// Index of `rank` among this worker's ranks, if it is one of them.
    pub fn rank_index(&self, rank: DpRank) -> Option<usize> {
        rank.checked_sub(self.dp_start_rank)
            .filter(|&i| i < self.dp_size)
            .map(|i| i as usize)
    }

    /// Index of `rank` if it is one of this worker's ranks and live.
    pub fn live_rank_index(&self, rank: DpRank) -> Option<usize> {
        self.rank_index(rank)
            .filter(|&i| self.live[i].load(Ordering::Acquire))
    }

    /// Sets a rank live or not; returns whether that changed anything.
    pub fn set_live(&self, index: usize, live: bool) -> bool {
        self.live[index].swap(live, Ordering::AcqRel) != live
    }

    pub fn live_ranks(&self) -> Vec<DpRank> {
        self.live
            .iter()
            .enumerate()
            .filter(|(_, l)| l.load(Ordering::Acquire))
            .map(|(i, _)| self.dp_start_rank + i as u32)
            .collect()
    }

    pub fn registration(&self) -> Registration {
        Registration {
            worker_id: self.worker_id,
            instance_id: self.instance_id(),
            model: self.model.clone(),
            role: self.role,
            block_size: self.block_size,
            dp_size: self.dp_size,
            dp_start_rank: self.dp_start_rank,
            live_ranks: self.live_ranks(),
            tp_size: self.tp_size,
            capacity_blocks: self.capacity_blocks,
            heartbeat_interval_ms: self.heartbeat_interval_ms,
            engine: self.engine,
            base_url: self.base_url.clone(),
        }
    }

    pub fn heartbeat(&self) -> Heartbeat {
        Heartbeat {
            worker_id: self.worker_id,
            instance_id: self.instance_id(),
            live_ranks: self.live_ranks(),
        }
    }

    /// Records a rank's new load and wakes the publisher.
    pub fn set_load(&self, index: usize, load: RankLoad) {
        if let Some(slot) = self.loads.lock().get_mut(index) {
            *slot = load;
        }
        self.load_dirty.store(true, Ordering::Release);
        self.load_changed.notify_one();
    }

    /// Every rank's last load, in rank order (live or not).
    pub fn loads(&self) -> Vec<RankLoad> {
        self.loads.lock().clone()
    }

    /// Resolves once a rank's load changed (a wake-up stored by [`Self::set_load`] counts).
    pub fn load_changed(&self) -> Notified<'_> {
        self.load_changed.notified()
    }

    /// Whether a rank's load changed since the last [`Self::take_load_report`].
    pub fn load_dirty(&self) -> bool {
        self.load_dirty.load(Ordering::Acquire)
    }

    /// The load report of the live ranks, marking the loads reported.
    pub fn take_load_report(&self) -> LoadReport {
        self.load_dirty.store(false, Ordering::Release);
        let loads = self.loads.lock();
        let ranks = loads
            .iter()
            .enumerate()
            .filter(|(i, _)| self.live[*i].load(Ordering::Acquire))
            .map(|(_, l)| *l)
            .collect();
        LoadReport {
            worker_id: self.worker_id,
            instance_id: self.instance_id(),
            ranks,
        }
    }
}

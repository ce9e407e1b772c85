//! A simulated worker's shared state: the worker's identity (as every worker has it) plus
//! the mocker's own KV transfer settings and test hook.

use kvrouter_worker::WorkerInfo;
use std::ops::Deref;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

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

pub(crate) struct MockInfo {
    pub worker: Arc<WorkerInfo>,
    pub transfer: TransferConfig,
    /// The silenced tp rank (test hook), or [`NOT_SILENCED`].
    silenced_tp_rank: AtomicU32,
}

impl MockInfo {
    pub(crate) fn new(worker: WorkerInfo, transfer: TransferConfig) -> Self {
        Self {
            worker: Arc::new(worker),
            transfer,
            silenced_tp_rank: AtomicU32::new(NOT_SILENCED),
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
}

impl Deref for MockInfo {
    type Target = WorkerInfo;

    fn deref(&self) -> &WorkerInfo {
        &self.worker
    }
}

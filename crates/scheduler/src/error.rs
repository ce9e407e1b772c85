//! Errors a route, an addition or a configuration can fail with.

use kvrouter_protocol::{DpRank, WorkerId};
use thiserror::Error;

/// Why a request could not be placed (or the scheduler not built).
///
/// Messages are written for a client to show as they are.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ScheduleError {
    /// The model has no worker keys at all.
    #[error("no workers are registered for this model")]
    NoWorkers,
    /// The request's allowed / pinned workers name no registered worker (or their
    /// intersection is empty).
    #[error("none of the workers the request allows is registered for this model")]
    NoAllowedWorkers,
    /// The request is pinned to a worker that is not registered.
    #[error("worker {0} is not registered for this model")]
    UnknownWorker(WorkerId),
    /// The request is pinned to a rank the worker does not have.
    #[error("worker {worker_id} has no data-parallel rank {dp_rank}")]
    InvalidRank {
        worker_id: WorkerId,
        dp_rank: DpRank,
    },
    /// Every candidate worker key is over a busy threshold (the caller may queue it).
    #[error("all candidate workers are busy")]
    AllBusy,
    /// Every candidate is busy and the queue is full.
    #[error("overloaded: {queued} requests queued, max {max}")]
    Overloaded { queued: usize, max: usize },
    /// A request with this id is already active.
    #[error("request {0:?} is already active")]
    DuplicateRequest(String),
    /// The request waited in the queue for longer than the request timeout.
    #[error("request timed out waiting for a worker that is not busy")]
    QueueTimeout,
    /// The scheduler configuration is invalid.
    #[error("invalid scheduler configuration: {0}")]
    InvalidConfig(String),
}

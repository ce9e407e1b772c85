use kvrouter_protocol::{EngineBlockHash, EventId, WorkerKey};
use thiserror::Error;

/// Why the index refused an event or a routing decision. Nothing refused changes the index.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum IndexError {
    #[error("worker {key}: event {event_id} is a duplicate or older than the last applied {last}")]
    StaleEvent {
        key: WorkerKey,
        event_id: EventId,
        last: EventId,
    },
    #[error("worker {key}: stored blocks extend parent {parent} that this rank does not hold")]
    MissingParent {
        key: WorkerKey,
        parent: EngineBlockHash,
    },
    #[error("worker {key}: storing {adding} blocks on top of {held} exceeds its limit of {limit}")]
    BlockLimit {
        key: WorkerKey,
        held: usize,
        adding: usize,
        limit: usize,
    },
    #[error("routing decision has {local} local hashes but {sequence} sequence hashes")]
    LengthMismatch { local: usize, sequence: usize },
}

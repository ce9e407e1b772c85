//! `kvrouter bridge`: a sidecar beside one vLLM or SGLang engine that reads the engine's KV
//! events from ZeroMQ and speaks for it on the bus as a kvrouter worker.
//!
//! Plain cores, no I/O:
//! - [`msgpack`]: a zero-copy MessagePack reader;
//! - [`engine_event`]: the engines' event batches, in every wire form they use;
//! - [`sequence`]: a rank's ZMQ sequence numbers (gaps, restarts);
//! - [`worker_mirror`]: what the engine's ranks cache, and engine events turned into
//!   kvrouter KV events with gap-free ids.

pub mod engine_event;
pub mod msgpack;
pub mod sequence;
pub mod worker_mirror;

pub use engine_event::{decode_batch, BatchError, EngineBatch, EngineEvent, EventError, Stored};
pub use sequence::{replay_covers, SeqStep, SeqTracker};
pub use worker_mirror::{Skip, WorkerMirror};

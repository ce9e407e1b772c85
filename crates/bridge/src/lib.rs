//! `kvrouter bridge`: a sidecar beside one vLLM or SGLang engine that reads the engine's KV
//! events from ZeroMQ and speaks for it on the bus as a kvrouter worker.
//!
//! Plain cores, no I/O:
//! - [`msgpack`]: a zero-copy MessagePack reader;
//! - [`engine_event`]: the engines' event batches, in every wire form they use;
//! - [`sequence`]: a rank's ZMQ sequence numbers (gaps, restarts);
//! - [`worker_mirror`]: what the engine's ranks cache, and engine events turned into
//!   kvrouter KV events with gap-free ids;
//! - [`endpoints`]: per-rank ZMQ endpoints, the default worker id, engine URLs;
//! - [`engine_load`]: the engine's load from its Prometheus metrics;
//! - [`config`]: the bridge's configuration, validated once.
//!
//! Tasks: [`zmq_rank`] (one rank's ZMQ stream, gaps and replay), [`mirror_task`] (owns the
//! mirror), [`engine_watch`] (health and load over HTTP); [`bridge`] starts and stops them,
//! with the worker crate's discovery, publisher and state answers.

pub mod bridge;
pub mod config;
pub mod endpoints;
pub mod engine_event;
pub mod engine_load;
pub mod engine_watch;
pub mod event_silence;
pub mod http_get;
pub mod metrics;
pub mod mirror_task;
pub mod msgpack;
pub mod sequence;
pub mod worker_mirror;
pub mod zmq_rank;

pub use bridge::Bridge;
pub use config::{BridgeConfig, BridgeError};
pub use engine_event::{
    decode_batch, decode_batch_steps, BadEvents, BatchError, EngineBatch, EngineEvent, EventError,
    Stored,
};
pub use sequence::{catch_up_run, replay_covers, Rejoined, SeqStep, SeqTracker};
pub use worker_mirror::{Skip, WorkerMirror};

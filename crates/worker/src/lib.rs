//! Being a kvrouter worker on the bus, for every program that speaks for an engine (the
//! mocker's simulated workers, the bridge beside a vLLM or SGLang engine).
//!
//! - core: [`info`] (identity, registration fields, live ranks, loads; no I/O);
//! - tasks: [`discovery`] (registrations, heartbeats, roll calls, rank liveness),
//!   [`publisher`] (KV event batches and load reports), [`state_reply`] (answering a state
//!   query), [`deregister`] (leaving in bounded time);
//! - [`publish`]: encoding and chunking messages for the bus; [`shutdown`]: the stop signal.

pub mod deregister;
pub mod discovery;
pub mod info;
pub mod publish;
pub mod publisher;
pub mod shutdown;
pub mod state_reply;

pub use deregister::deregister_within;
pub use discovery::{announce, discovery_task, set_rank_live};
pub use info::{WorkerInfo, WorkerSpec};
pub use publish::{encode_chunked, publish_as, publish_msg};
pub use publisher::{PubMsg, Publisher};
pub use shutdown::stopped;
pub use state_reply::{send_error_stream, send_state, Snapshot};

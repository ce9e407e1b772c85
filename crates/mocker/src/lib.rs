//! Simulated engine workers: paged KV cache, continuous batching, timing model, bus runner.
//!
//! This crate's synchronous core simulates one data-parallel rank of an LLM engine (vLLM
//! style) without a GPU, I/O, async or clock reads; simulated time goes in and comes out:
//!
//! - [`config`]: [`EngineConfig`] and the [`TimingModel`] (estimated constants for an 8B model
//!   on one H100 with vLLM, with their reasoning).
//! - [`kv_cache`]: [`KvCache`], the paged KV cache with prefix reuse, LRU eviction and KV
//!   events (`Stored` / `Removed` / `Cleared` with gap-free event ids).
//! - `offload`: the host and disk tiers a rank's evicted blocks move to (when configured).
//! - [`engine`]: [`RankEngine`], continuous batching with chunked prefill and admission
//!   control, producing per-step outputs (TTFT, inter-token latency) and events.
//! - [`engine_hash`]: the engine's own block ids, a hash chain distinct from the router's
//!   local and sequence hashes, so the router can only link blocks through events.
//!
//! A rank is driven like this:
//!
//! ```
//! use kvrouter_mocker::{EngineConfig, OutputKind, RankEngine, Request};
//! use kvrouter_protocol::WorkerKey;
//! use std::time::Duration;
//!
//! let mut rank = RankEngine::new(WorkerKey::new(1, 0), EngineConfig::default()).unwrap();
//! let req = Request { request_id: "r1".into(), tokens: (0..1000).collect(), max_tokens: 3 };
//! rank.submit(req, Duration::ZERO).unwrap();
//! let mut now = Duration::ZERO;
//! let mut finished = false;
//! while let Some(out) = rank.step(now) {
//!     now += out.duration;
//!     // out.events go to the event plane; out.outputs to the client.
//!     finished |= out.outputs.iter().any(|o| matches!(o.kind, OutputKind::Finished { .. }));
//! }
//! assert!(finished);
//! assert_eq!(rank.load().cached_blocks, 1000 / 64);
//! ```

pub mod config;
mod disagg;
pub mod emulate;
pub mod engine;
pub mod engine_hash;
pub mod fleet;
pub mod kv_cache;
mod mock_info;
mod offload;
mod rank_task;
mod worker;

pub use config::{BatchShape, ConfigError, EngineConfig, TimingModel};
pub use engine::{
    LoadReport, Output, OutputKind, RankEngine, Request, SimTime, StepOutcome, SubmitError,
};
pub use engine_hash::{engine_block_hash, engine_block_hashes, DEFAULT_ENGINE_HASH_SEED};
pub use fleet::{
    FleetConfig, FleetError, MockerFleet, DEFAULT_KV_RECEIVE_TIMEOUT, DEFAULT_KV_TRANSFER_PER_BLOCK,
};
pub use kv_cache::{BlockTable, CacheFull, CachedBlock, KvCache, PrefixMatch, PromptBlocks};

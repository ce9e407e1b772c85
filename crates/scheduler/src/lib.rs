//! The scheduling core: active sequences, cost, filters, busy thresholds and the queue.
//!
//! A plain synchronous structure (no I/O, no clock: callers pass `now`), deterministic
//! for a given [`SchedulerConfig::seed`]. One [`Scheduler`] per model, owned by an actor.
//!
//! For each route request ([`Scheduler::route`] / [`Scheduler::select`]):
//! 1. **Filters** ([`RouteFilters`]): allowed worker ids, excluded worker ids, pinned worker
//!    key, pinned worker (any rank), allowed keys.
//!    Errors: [`ScheduleError::NoWorkers`], [`ScheduleError::NoAllowedWorkers`],
//!    [`ScheduleError::UnknownWorker`], [`ScheduleError::InvalidRank`].
//! 2. **Busy thresholds**: keys whose active blocks reach `busy_active_blocks_frac ×
//!    capacity_blocks` (tracked or reported, whichever is larger) or whose in-flight
//!    prefill tokens reach `busy_prefill_tokens` are dropped; if none is left the answer is
//!    [`ScheduleError::AllBusy`], and the caller may [`Scheduler::enqueue`] the request
//!    and retry with [`Scheduler::drain_ready`] after every state change.
//! 3. **Cost** (see [`cost`]): `prefill_load_scale × prefill_blocks + decode_blocks`;
//!    lowest wins with random tie-breaks, or softmax sampling when `temperature > 0`.
//!
//! Overlaps (leading request blocks cached per key, from the indexer) are passed as a
//! sparse list `&[(WorkerKey, u32)]` holding only keys with overlap > 0.
//!
//! A routed request becomes an *active sequence* on its key: its uncached prompt tokens
//! count as prefill load until [`Scheduler::mark_prefill`], its blocks (deduplicated per
//! key by sequence hash) as decode load until [`Scheduler::free`] or
//! [`Scheduler::sweep`].

mod active;
mod config;
pub mod cost;
mod echo;
mod error;
mod filters;
mod queue;
mod route_query;
mod scheduler;

pub use active::{KeyLoad, ReportedLoad, RequestId};
pub use config::{
    QueuePolicy, RoutingPolicy, SchedulerConfig, DEFAULT_ACTIVE_PREFIX_CREDIT,
    DEFAULT_DISK_CACHE_HIT_WEIGHT, DEFAULT_HOST_CACHE_HIT_WEIGHT, DEFAULT_PREFILL_LOAD_SCALE,
    DEFAULT_PREFILL_QUEUE_CAP_TOKENS, DEFAULT_SHARED_CACHE_HIT_WEIGHT,
};
pub use error::ScheduleError;
pub use filters::{FilterView, RouteFilters};
pub use queue::{Overloaded, Queued};
pub use route_query::RouteQuery;
pub use scheduler::{PotentialLoad, Scheduler, Selection};

//! A router replica: discovery, state sync, event ingest, scheduler actors, endpoints, admin
//! HTTP.
//!
//! Plain cores, thin actors:
//! - [`discovery`]: which worker ranks are alive (registrations, heartbeats, leases).
//! - [`rank_sync`]: event-id continuity per rank and merging fetched snapshots with live
//!   events.
//! - [`fleet`]: the actor per model that owns both, feeds the index and tells the scheduler.
//! - [`scheduler_actor`]: the actor per model that owns the scheduling core.
//! - [`replica_sync`]: sharing active sequences with peer replicas (`--replica-sync`).
//! - [`endpoints`]: route, overlap_scores, potential_loads, mark_prefill, free.
//! - [`admin`] and [`metrics`]: `/healthz`, `/readyz`, `/metrics`.
//! - [`approx`]: approximate mode (`--no-kv-events`), route decisions feeding the index.
//! - [`served_indexer`] and [`remote_indexer`]: `--serve-indexer` answers other replicas'
//!   overlap queries; `--use-remote-indexer` asks them instead of keeping an index, through
//!   the circuit breaker of [`breaker`].
//! - [`disagg`] and [`transfer`]: disaggregated prefill/decode routing (`route_disagg`) and
//!   KV transfer tracking across tensor-parallel ranks.
//! - [`replica`]: starting, wiring and draining it all.

pub mod admin;
pub mod approx;
pub mod breaker;
mod clock;
pub mod disagg;
pub mod discovery;
pub mod endpoints;
pub mod fleet;
pub mod metrics;
pub mod rank_sync;
pub mod remote_indexer;
pub mod replica;
pub mod replica_sync;
pub mod route_gate;
pub mod scheduler_actor;
pub mod served_indexer;
pub mod state;
pub mod sync_bus;
pub mod transfer;

pub use replica::{Replica, ReplicaConfig, ReplicaError, DEFAULT_SYNC_ECHO};

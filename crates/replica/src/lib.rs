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
//! - [`replica`]: starting, wiring and draining it all.

pub mod admin;
pub mod approx;
pub mod discovery;
pub mod endpoints;
pub mod fleet;
pub mod metrics;
pub mod rank_sync;
pub mod replica;
pub mod replica_sync;
pub mod scheduler_actor;
pub mod state;
pub mod sync_bus;

pub use replica::{Replica, ReplicaConfig, ReplicaError};

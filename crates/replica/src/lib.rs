//! A router replica: discovery, worker-state sync, event ingest, scheduler actors, bus
//! handlers, admin HTTP. See docs/architecture.md for the picture.
//!
//! Layers, each importing only from the ones below it:
//! - plain cores, no I/O: `config` (the pipeline, validated once), `discovery` (which
//!   worker ranks are alive), [`worker_state`] (event ids, state fetches and their schedule),
//!   `layouts` (worker roles and candidate rules), `transfer` (KV transfer tracking),
//!   `breaker`, [`replica_sync`] (sharing active sequences with peers), `status` (what
//!   readiness reads), `stall` (noticing the process was stopped), [`route_phases`], [`metrics`];
//! - actors and clients that own them: `scheduler_actor`, `worker_tracker` (discovery,
//!   event ingest and state fetches of one model), `remote_indexer`, `approx`;
//! - the shared read view the handlers use: `state`;
//! - bus and HTTP handlers: `serve` (the one way a subject is served), `endpoints`,
//!   `disagg`, `served_indexer`, `replica_sync_bus`, `route_gate`, `http_api` (the JSON API
//!   for peer routers), `admin`;
//! - `replica`: starting, wiring and stopping it all.
//!
//! Only the cores other crates test or read are public (`worker_state`, `replica_sync`,
//! `metrics`); the rest is reached through [`Replica`] and the re-exports below.

mod abandoned;
mod admin;
mod approx;
mod breaker;
mod clock;
mod config;
mod disagg;
mod discovery;
mod endpoints;
mod http_api;
mod layouts;
pub mod metrics;
pub mod rank_silence;
mod remote_indexer;
mod replica;
pub mod replica_sync;
mod replica_sync_bus;
mod route_gate;
pub mod route_phases;
mod scheduler_actor;
mod serve;
mod served_indexer;
mod stall;
mod state;
mod status;
mod transfer;
pub mod worker_state;
mod worker_tracker;

pub use config::{
    IndexFlags, IndexSource, RemoteIndex, ReplicaConfig, ReplicaError, SyncConfig,
    DEFAULT_SYNC_ECHO,
};
pub use replica::Replica;
pub use state::{ModelShared, ReplicaShared};

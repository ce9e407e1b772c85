//! Replicas in-process: routing, approximate mode, disaggregation, served indexers, peers,
//! and replica sync against reference models.

mod approx;
mod disagg;
mod in_process;
mod indexer;
mod limits;
mod peers;
mod replica_sync_model;
mod support;
mod sync_model;

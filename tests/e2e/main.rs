//! End to end: the real binary as separate processes (replicas, mockers, bridges with
//! emulated engines, the frontend) over a real nats-server, as a fleet runs.

#[path = "../common/mod.rs"]
mod common;

mod bridge;
mod disagg;
mod emulate;
mod engines;
mod epp;
mod frontend;
mod http_auth;
mod indexer;
mod leases;
mod lifecycle;
mod peer_api;
mod readiness;
mod replica;
mod silent_engines;
mod support;
mod sync;

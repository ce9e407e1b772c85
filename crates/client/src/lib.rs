//! The kvrouter client for frontends and peer routers.
//!
//! [`KvRouterClient`] calls the router endpoints of one namespace over a [`Bus`]
//! (NATS or in-process): [`route`](KvRouterClient::route),
//! [`overlap_scores`](KvRouterClient::overlap_scores),
//! [`potential_loads`](KvRouterClient::potential_loads),
//! [`mark_prefill`](KvRouterClient::mark_prefill) and [`free`](KvRouterClient::free), plus
//! [`generate`](KvRouterClient::generate), which does what a frontend does with one request:
//! route, run on the chosen worker, `mark_prefill` after the prefill, `free` at the end.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use kvrouter_bus::{Bus, NatsOptions};
//! use kvrouter_client::{route_request, KvRouterClient};
//!
//! let bus = Bus::connect(&NatsOptions::new("nats://127.0.0.1:4222")).await?;
//! let client = KvRouterClient::new(bus, "kvrouter")?;
//! let mut req = route_request("Qwen/Qwen3-0.6B", vec![1, 2, 3]);
//! req.update_states = false;
//! let decision = client.route(&req).await?;
//! println!("worker {} rank {}", decision.worker_id, decision.dp_rank);
//! # Ok(()) }
//! ```

mod booking;
mod client;
mod disagg;
mod error;
mod generate;
mod route_lease;

pub use booking::Booking;
pub use client::{
    new_call_id, new_request_id, route_request, KvRouterClient, DEFAULT_GENERATE_IDLE_TIMEOUT,
    DEFAULT_REQUEST_TIMEOUT, DEFAULT_RETRIES,
};
pub use disagg::{DisaggOutcome, StageOutcome};
pub use error::{ClientError, WorkerFailure};
pub use generate::{GenerateOutcome, GenerateParams};
pub use kvrouter_bus::Bus;
pub use route_lease::{LeaseCounts, RouteLease};

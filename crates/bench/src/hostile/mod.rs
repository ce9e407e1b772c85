//! `kvrouter bench hostile`: the real fleet (nats-server, two `kvrouter serve` replicas, a
//! `kvrouter frontend`, an emulated vLLM engine behind a `kvrouter bridge`), locked as it
//! should be deployed (one NATS identity per role, tokens and API keys), under honest
//! traffic, first alone, then with each adversary for a fixed time: slow and half-open
//! connections on every HTTP listener, oversized and deeply nested bodies, label floods,
//! 200,000-entry worker lists, 1 MiB request ids, poisoned engine frames, and impostors
//! holding valid credentials of their own (a tenant ending others' bookings, a bridge
//! speaking for another worker, a frontend answering routes and publishing sync, readers of
//! others' replies). The report gives per phase the attack's rate and CPU time, the honest
//! success rate and latency against the clean phase, what the fleet refused and counted,
//! what took effect, each process's memory, deaths, and whether each process exits on
//! SIGTERM within its drain timeout. Plain core: [`plan`] (phases, report, invariants); the
//! process-driving shell: [`runner`], the fleet's [`credentials`], what the attacks aim at
//! ([`targets`]), the adversaries at the doors ([`attacks`]) and the impostors.

pub mod attacks;
pub mod credentials;
mod impostors;
pub mod plan;
pub mod runner;
pub mod targets;

pub use plan::{Attack, HostileReport, Thresholds};
pub use runner::{run_hostile, HostileConfig, HostileError};

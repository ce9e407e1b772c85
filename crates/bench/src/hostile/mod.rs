//! `kvrouter bench hostile`: the real fleet (nats-server, two `kvrouter serve` replicas, a
//! `kvrouter frontend`, an emulated vLLM engine behind a `kvrouter bridge`) under honest
//! traffic, first alone, then with each adversary for a fixed time: slow and half-open
//! connections on every HTTP listener, oversized and deeply nested bodies, label floods,
//! 200,000-entry worker lists, poisoned engine frames, 1 MiB request ids. The report gives
//! per phase the attack's rate and CPU time, the honest success rate and latency against the
//! clean phase, each process's memory, deaths, and whether each process exits on SIGTERM
//! within its drain timeout. Plain core: [`plan`] (phases, report, invariants); the
//! process-driving shell: [`runner`] and the adversaries in [`attacks`].

pub mod attacks;
pub mod plan;
pub mod runner;

pub use plan::{Attack, HostileReport, Thresholds};
pub use runner::{run_hostile, HostileConfig, HostileError};

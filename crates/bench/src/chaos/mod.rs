//! `kvrouter bench chaos`: a real fleet (nats-server, router replicas, mocker workers,
//! emulated vLLM and SGLang engines behind `kvrouter bridge`s) under traffic while a seeded
//! schedule injects faults; at checkpoints every replica's index is compared with the
//! workers' true caches and its active sequences with the requests in flight. Plain cores: [`schedule`] (the seeded fault schedule) and [`compare`] (index vs
//! truth); the process-driving shell: [`runner`], [`fleet`], [`traffic`].

pub mod compare;
pub mod config;
pub mod fleet;
pub mod report;
pub mod runner;
pub mod schedule;
pub mod traffic;

pub use config::{ChaosConfig, EngineSpec};
pub use report::ChaosReport;
pub use runner::{run_chaos, ChaosError};
pub use schedule::{FaultKind, Schedule, Step, Timing};

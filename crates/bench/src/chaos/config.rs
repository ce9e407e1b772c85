//! How a chaos run is shaped: the fleet, the traffic, the timings. Read by the runner and
//! by the report, which records it.

use super::schedule::Timing;
use std::path::PathBuf;
use std::time::Duration;

/// One emulated engine of the fleet (with a `kvrouter bridge` beside it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineSpec {
    /// `vllm` or `sglang`.
    pub kind: &'static str,
    /// Its ZMQ wire form (`mocker --zmq-wire`).
    pub wire: &'static str,
    pub dp_size: u32,
}

impl EngineSpec {
    /// `vllm` (array-batch wire) or `sglang` (array wire) with `dp_size` ranks.
    pub fn named(kind: &str, dp_size: u32) -> Option<Self> {
        match kind {
            "vllm" => Some(Self {
                kind: "vllm",
                wire: "array-batch",
                dp_size,
            }),
            "sglang" => Some(Self {
                kind: "sglang",
                wire: "array",
                dp_size,
            }),
            _ => None,
        }
    }
}

/// How a chaos run is shaped.
#[derive(Clone, Debug)]
pub struct ChaosConfig {
    /// The kvrouter executable (`serve`, `mocker`, `mocker --emulate` and `bridge` children).
    pub exe: PathBuf,
    pub duration: Duration,
    pub seed: u64,
    pub namespace: String,
    pub model: String,
    pub block_size: usize,
    /// Replicas: the first `replicas - 1` keep an index (`--serve-indexer`), the last uses
    /// theirs (`--use-remote-indexer`); all with `--replica-sync`.
    pub replicas: usize,
    pub mockers: usize,
    pub workers_per_mocker: u32,
    pub dp_size: u32,
    /// Emulated engines (`mocker --emulate`), each behind its own bridge.
    pub engines: Vec<EngineSpec>,
    /// The share of requests sent to the engines.
    pub engine_share: f64,
    pub capacity_blocks: u32,
    pub speedup: f64,
    pub concurrency: usize,
    pub max_retries: u32,
    /// The replicas' `--request-timeout-secs` (serve's 300 s by default): the sweep of
    /// requests nobody frees; shorter, it would hide leaks as slow convergence.
    pub request_timeout_secs: u64,
    /// How long a checkpoint polls for convergence.
    pub converge_timeout: Duration,
    /// After convergence, how long before the second comparison.
    pub stability: Duration,
    /// After traffic stops, before the final comparison.
    pub quiet: Duration,
    pub timing: Timing,
    /// Where the children's stderr goes (nowhere without it).
    pub log_dir: Option<PathBuf>,
}

impl ChaosConfig {
    pub fn new(exe: PathBuf, duration: Duration, seed: u64) -> Self {
        Self {
            exe,
            duration,
            seed,
            namespace: format!("chaos{seed}"),
            model: "chaos-model".into(),
            block_size: 16,
            replicas: 3,
            mockers: 2,
            workers_per_mocker: 2,
            dp_size: 2,
            engines: ["vllm", "sglang"]
                .into_iter()
                .filter_map(|k| EngineSpec::named(k, 2))
                .collect(),
            engine_share: 0.3,
            capacity_blocks: 256,
            speedup: 100.0,
            concurrency: 4,
            max_retries: 3,
            request_timeout_secs: 300,
            converge_timeout: Duration::from_secs(30),
            stability: Duration::from_secs(1),
            quiet: Duration::from_secs(2),
            timing: Timing::default(),
            log_dir: None,
        }
    }
}

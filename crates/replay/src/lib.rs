//! A Mooncake trace through real router replicas and a simulated (mocker) fleet, per routing
//! policy and arrival rate, against two ideal caches: the engine of `kvrouter demo` and of
//! `kvrouter bench replay`. In-process on a virtual clock (exact, deterministic, as fast as
//! the CPU allows) or over NATS in real time.
//!
//! - [`trace`]: the Mooncake trace format, read line by line with typed errors.
//! - [`requests`]: trace records → prompts (each hash id stands for 512 deterministic tokens).
//! - [`ideal`]: hit rates of an unlimited cache and of one LRU cache holding the fleet's capacity.
//! - [`runner`]: starts the fleet and the replicas on a bus and replays the requests.
//! - [`experiment`]: the rate × policy runs, the SLO base run, the report.
//! - [`report`]: per-run summaries, goodput across rates, the table and the JSON.
//! - [`stats`]: percentiles and min/median/max, for every bench.

pub mod experiment;
pub mod ideal;
pub mod report;
pub mod requests;
pub mod runner;
pub mod stats;
pub mod trace;

use serde::Serialize;

/// What happened to one replayed request. Times are simulated (engine) microseconds; arrival
/// and done are measured from the start of the run.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RequestResult {
    /// Position in the trace.
    pub index: usize,
    pub arrival_us: u64,
    pub done_us: u64,
    pub worker_id: u64,
    pub dp_rank: u32,
    /// Overlap the router saw when it chose.
    pub overlap_blocks: u32,
    /// Blocks the worker found cached at prefill (any tier), and the prompt's full blocks.
    pub cached_blocks: u32,
    /// Of `cached_blocks`, those loaded from host memory and from disk.
    pub host_blocks: u32,
    pub disk_blocks: u32,
    pub prompt_blocks: u32,
    pub ttft_us: u64,
    /// Mean inter-token latency (0 with fewer than two output tokens).
    pub itl_mean_us: f64,
    pub e2e_us: u64,
    pub output_tokens: u32,
    /// Wall time of the route call, client side; 0 on the virtual clock, where it would
    /// only be the CPU time of the one thread (and break determinism).
    pub route_wall_us: u64,
    /// Set when the request failed (then the timings are 0).
    pub error: Option<String>,
}

/// Active blocks of every worker rank at one moment (from the workers' load reports).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct LoadSample {
    pub at_us: u64,
    pub active_blocks: Vec<u64>,
}

/// The replicas' own counters at the end of a run, summed over them: which cluster features
/// were at work (events, approximate records, remote lookups, sync peers).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ClusterCounters {
    /// KV events applied to the replicas' indexes (0 in approximate mode and on remote ones),
    /// and how many replicas applied any.
    pub kv_events_applied: u64,
    pub replicas_applying_events: usize,
    /// Approximate mode: route decisions recorded in an index.
    pub approx_records: u64,
    /// Remote indexers: overlap lookups answered by a serving indexer, and routes that fell
    /// back to load alone.
    pub remote_lookups: u64,
    pub remote_fallbacks: u64,
    /// Replica sync: live peers each replica sees, summed (n × (n − 1) when all see all).
    pub sync_peers: u64,
}

/// One policy at one rate: every request's result and the load samples.
#[derive(Clone, Debug, Default)]
pub struct RunOutcome {
    pub policy: String,
    pub rate_scale: f64,
    pub results: Vec<RequestResult>,
    pub samples: Vec<LoadSample>,
    /// Simulated length of the run (first arrival to last completion), µs.
    pub duration_us: u64,
    pub cluster: ClusterCounters,
    /// Ran on the wall clock (over NATS): route wall times are real.
    pub real_clock: bool,
}

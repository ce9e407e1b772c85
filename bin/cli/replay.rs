//! `kvrouter bench replay` and `kvrouter demo`: a trace through replicas and a mocker fleet.

use anyhow::{bail, Context};
use clap::Args;
use kvrouter_bench::replay::ideal::ideal_hit_rates;
use kvrouter_bench::replay::plot::plot;
use kvrouter_bench::replay::report::{
    derived_slo_ttft_ms, render_table, summarize, ReplayReport, ReportSettings,
};
use kvrouter_bench::replay::requests::{build_requests, count_truncated, load_trace};
use kvrouter_bench::replay::runner::{run_policy, virtual_runtime, ReplayConfig};
use kvrouter_bench::replay::RunOutcome;
use kvrouter_bus::NatsOptions;
use kvrouter_scheduler::{RoutingPolicy, SchedulerConfig};
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The fleet, router and output flags `bench replay` and `demo` share.
#[derive(Args, Clone, Debug)]
pub struct FleetArgs {
    /// Simulated workers.
    #[arg(long, env = "KVROUTER_WORKERS", default_value_t = 8)]
    workers: u32,
    /// Data-parallel ranks per worker.
    #[arg(long, env = "KVROUTER_DP_SIZE", default_value_t = 1)]
    dp_size: u32,
    /// Tokens per KV block (must divide 512, the tokens of one trace hash id).
    #[arg(long, env = "KVROUTER_BLOCK_SIZE", default_value_t = 64)]
    block_size: usize,
    /// KV cache capacity of each rank, in blocks.
    #[arg(long, env = "KVROUTER_CAPACITY_BLOCKS", default_value_t = 8192)]
    capacity_blocks: usize,
    /// Host-memory tier of each rank, in blocks (evicted blocks move there and load back
    /// at a transfer cost; see the mocker's timing model); 0 for none.
    #[arg(long, env = "KVROUTER_HOST_CAPACITY_BLOCKS", default_value_t = 0)]
    host_capacity_blocks: usize,
    /// Disk tier of each rank, in blocks; 0 for none.
    #[arg(long, env = "KVROUTER_DISK_CAPACITY_BLOCKS", default_value_t = 0)]
    disk_capacity_blocks: usize,
    /// Router replicas (requests are spread over them as over NATS queue subscribers).
    #[arg(long, env = "KVROUTER_REPLICAS", default_value_t = 2)]
    replicas: usize,
    /// Simulated seconds per wall second, with --nats. The in-process replay runs on a
    /// virtual clock: as fast as the CPU allows, exact and deterministic.
    #[arg(long, env = "KVROUTER_SPEEDUP", default_value_t = 10.0)]
    speedup: f64,
    /// Replay over this NATS server instead of the in-process bus (each run uses its own
    /// namespace).
    #[arg(long, env = "KVROUTER_NATS")]
    nats: Option<String>,
    /// TTFT objective for goodput: the highest rate whose p90 TTFT meets it. Default: one
    /// the trace can meet, --slo-factor x round robin's p90 TTFT at --slo-base-rate-scale
    /// (an extra run, printed with the report; over NATS it runs in real time, so give
    /// this to skip it).
    #[arg(long, env = "KVROUTER_SLO_TTFT_MS")]
    slo_ttft_ms: Option<f64>,
    /// The derived SLO: this many times round robin's unloaded p90 TTFT.
    #[arg(long, env = "KVROUTER_SLO_FACTOR", default_value_t = 3.0)]
    slo_factor: f64,
    /// The derived SLO: the rate scale at which round robin counts as unloaded.
    #[arg(long, env = "KVROUTER_SLO_BASE_RATE_SCALE", default_value_t = 0.1)]
    slo_base_rate_scale: f64,
    /// Routes carry the trace's output length as their expected output tokens, so the
    /// replicas count each request's whole decode as load from the start.
    #[arg(long, env = "KVROUTER_EXPECTED_OUTPUT")]
    expected_output: bool,
    /// Seed of the routers' tie-breaks (the replay is deterministic for a seed in-process).
    #[arg(long, env = "KVROUTER_SEED", default_value_t = 1)]
    seed: u64,
    /// The replicas' cost: prefill blocks one cached block saves.
    #[arg(long, env = "KVROUTER_OVERLAP_CREDIT", default_value_t = 1.0)]
    overlap_credit: f64,
    /// The replicas' cost: credit per block found in a worker's host memory.
    #[arg(long, env = "KVROUTER_HOST_CACHE_HIT_WEIGHT", default_value_t = kvrouter_scheduler::DEFAULT_HOST_CACHE_HIT_WEIGHT)]
    host_cache_hit_weight: f64,
    /// The replicas' cost: credit per block found on a worker's disk.
    #[arg(long, env = "KVROUTER_DISK_CACHE_HIT_WEIGHT", default_value_t = kvrouter_scheduler::DEFAULT_DISK_CACHE_HIT_WEIGHT)]
    disk_cache_hit_weight: f64,
    /// The replicas' cost: weight of prefill blocks against decode blocks.
    #[arg(long, env = "KVROUTER_PREFILL_LOAD_SCALE",
          default_value_t = kvrouter_scheduler::DEFAULT_PREFILL_LOAD_SCALE)]
    prefill_load_scale: f64,
    /// The replicas' cost: credit per predicted block (a leading prompt block of a request
    /// active on the worker, not yet in the index); 0: off.
    #[arg(long, env = "KVROUTER_ACTIVE_PREFIX_CREDIT",
          default_value_t = kvrouter_scheduler::DEFAULT_ACTIVE_PREFIX_CREDIT)]
    active_prefix_credit: f64,
    /// The replicas' cost: in-flight prefill tokens on a worker past this many count no
    /// more (0: no cap).
    #[arg(long, env = "KVROUTER_PREFILL_QUEUE_CAP_TOKENS",
          default_value_t = kvrouter_scheduler::DEFAULT_PREFILL_QUEUE_CAP_TOKENS)]
    prefill_queue_cap_tokens: u64,
    /// The replicas' request timeout: active requests never freed are dropped after this
    /// many (simulated) seconds. The replay frees every request, and under overload a
    /// request may queue in its engine for minutes: a shorter timeout would drop live load
    /// from the routers' view.
    #[arg(long, env = "KVROUTER_REQUEST_TIMEOUT_SECS", default_value_t = 3600.0)]
    request_timeout_secs: f64,
    /// The replicas' sampling temperature (0: lowest cost wins).
    #[arg(long, env = "KVROUTER_ROUTER_TEMPERATURE", default_value_t = 0.0)]
    router_temperature: f64,
    /// The replicas share their active sequences, so each routes on the whole load.
    #[arg(long, env = "KVROUTER_REPLICA_SYNC")]
    replica_sync: bool,
    /// Replica sync: how long the picks peers would make at the same moment count as load
    /// (the replicas' --replica-sync-echo-ms; 0: off).
    #[arg(long, env = "KVROUTER_REPLICA_SYNC_ECHO_MS", default_value_t = 1.0)]
    replica_sync_echo_ms: f64,
    /// Approximate mode: the replicas consume no KV events; each feeds its index from its own
    /// routing decisions (expiring after 120 s of simulated time).
    #[arg(long, env = "KVROUTER_NO_KV_EVENTS")]
    no_kv_events: bool,
    /// The first K replicas serve their index (--serve-indexer); the others keep none and ask
    /// them (--use-remote-indexer).
    #[arg(long, env = "KVROUTER_SERVE_INDEXER_REPLICAS", default_value_t = 0)]
    serve_indexer_replicas: usize,
    /// Remote indexers: the first replica (or --serve-indexer-replicas) serves the index, the
    /// others ask it.
    #[arg(long, env = "KVROUTER_REMOTE_INDEXER")]
    remote_indexer: bool,
    /// Replay only the first N requests of the trace.
    #[arg(long, env = "KVROUTER_LIMIT")]
    limit: Option<usize>,
    /// Write the TTFT distributions and hit rates to this file (.svg or .png).
    #[arg(long, env = "KVROUTER_PLOT")]
    plot: Option<PathBuf>,
    /// Print the report as one JSON object instead of a table.
    #[arg(long, env = "KVROUTER_JSON")]
    json: bool,
}

#[derive(Args)]
pub struct ReplayArgs {
    /// Mooncake-format trace (JSONL).
    #[arg(long, env = "KVROUTER_TRACE")]
    trace: PathBuf,
    /// Routing policies to compare.
    #[arg(
        long,
        env = "KVROUTER_POLICIES",
        value_delimiter = ',',
        default_value = "kv,round-robin,random,least-loaded"
    )]
    policies: Vec<RoutingPolicy>,
    /// Arrival rate multiplier: request i arrives at timestamp_i / X.
    #[arg(long, env = "KVROUTER_RATE_SCALE", conflicts_with = "rate_scales")]
    rate_scale: Option<f64>,
    /// Several rate multipliers (for goodput).
    #[arg(long, env = "KVROUTER_RATE_SCALES", value_delimiter = ',')]
    rate_scales: Vec<f64>,
    #[command(flatten)]
    fleet: FleetArgs,
}

#[derive(Args)]
pub struct DemoArgs {
    /// Trace to replay (default: the Mooncake sample shipped in data/).
    #[arg(long, env = "KVROUTER_TRACE")]
    trace: Option<PathBuf>,
    /// Arrival rate multiplier (default: 2, where round robin's queues build up).
    #[arg(long, env = "KVROUTER_RATE_SCALE", default_value_t = 2.0)]
    rate_scale: f64,
    #[command(flatten)]
    fleet: FleetArgs,
}

fn default_trace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("data/mooncake_trace_1000.jsonl")
}

/// A one-line progress display on a terminal (stderr), nothing otherwise.
struct Progress {
    enabled: bool,
}

impl Progress {
    fn new(quiet: bool) -> Self {
        Self {
            enabled: !quiet && std::io::stderr().is_terminal(),
        }
    }

    fn show(&self, label: &str, done: usize, total: usize, started: Instant) {
        if !self.enabled {
            return;
        }
        let width = 30;
        let filled = done * width / total.max(1);
        let mut err = std::io::stderr().lock();
        let _ = write!(
            err,
            "\r{label:<28} [{}{}] {done}/{total} {:.0}s",
            "#".repeat(filled),
            "-".repeat(width - filled),
            started.elapsed().as_secs_f64()
        );
        if done == total {
            let _ = writeln!(err);
        }
        let _ = err.flush();
    }
}

/// Runs every (rate, policy) pair and builds the report.
fn replay(
    trace_path: &Path,
    policies: &[RoutingPolicy],
    rates: &[f64],
    fleet: &FleetArgs,
) -> anyhow::Result<(ReplayReport, Vec<RunOutcome>)> {
    if policies.is_empty() || rates.is_empty() {
        bail!("give at least one policy and one rate scale");
    }
    let trace = load_trace(trace_path, fleet.limit)
        .with_context(|| format!("cannot load the trace {}", trace_path.display()))?;
    let config = ReplayConfig {
        workers: fleet.workers,
        dp_size: fleet.dp_size,
        block_size: fleet.block_size,
        capacity_blocks: fleet.capacity_blocks,
        host_capacity_blocks: fleet.host_capacity_blocks,
        disk_capacity_blocks: fleet.disk_capacity_blocks,
        speedup: fleet.speedup,
        replicas: fleet.replicas,
        nats: fleet.nats.as_ref().map(NatsOptions::new),
        seed: fleet.seed,
        scheduler: SchedulerConfig {
            overlap_credit: fleet.overlap_credit,
            host_cache_hit_weight: fleet.host_cache_hit_weight,
            disk_cache_hit_weight: fleet.disk_cache_hit_weight,
            prefill_load_scale: fleet.prefill_load_scale,
            active_prefix_credit: fleet.active_prefix_credit,
            prefill_queue_cap_tokens: fleet.prefill_queue_cap_tokens,
            request_timeout: crate::cli::serve::secs(
                "request-timeout-secs",
                fleet.request_timeout_secs,
            )?,
            temperature: fleet.router_temperature,
            ..SchedulerConfig::default()
        },
        no_kv_events: fleet.no_kv_events,
        replica_sync: fleet.replica_sync,
        replica_sync_echo: crate::cli::serve::millis(
            "replica-sync-echo-ms",
            fleet.replica_sync_echo_ms,
        )?,
        serve_indexer_replicas: fleet.serve_indexer_replicas,
        remote_indexer: fleet.remote_indexer,
        expected_output: fleet.expected_output,
        ..ReplayConfig::default()
    };
    config.validate()?;
    if let Some(slo) = fleet.slo_ttft_ms {
        if !(slo.is_finite() && slo > 0.0) {
            bail!("--slo-ttft-ms must be a number above 0, got {slo}");
        }
    } else if !(fleet.slo_factor.is_finite() && fleet.slo_factor > 0.0) {
        bail!(
            "--slo-factor must be a number above 0, got {}",
            fleet.slo_factor
        );
    }
    let progress = Progress::new(fleet.json);
    let mut outcomes = Vec::new();
    let mut ideals = None;
    for &rate in rates {
        let requests = build_requests(&trace, rate)?;
        if ideals.is_none() {
            ideals = Some(ideal_hit_rates(
                &requests,
                config.block_size,
                config.fleet_capacity_blocks(),
            ));
        }
        for &policy in policies {
            let label = format!("{policy} x{rate}");
            let started = Instant::now();
            let total = requests.len();
            let on_done = |n: usize| progress.show(&label, n, total, started);
            let outcome = match config.nats {
                None => virtual_runtime()?
                    .block_on(run_policy(&config, policy, rate, &requests, &on_done)),
                Some(_) => super::runtime()?
                    .block_on(run_policy(&config, policy, rate, &requests, &on_done)),
            }
            .with_context(|| format!("replay with policy {policy} at rate x{rate} failed"))?;
            outcomes.push(outcome);
        }
    }
    // The default SLO: round robin's p90 TTFT, unloaded, on this trace, times a factor.
    let slo_base = match fleet.slo_ttft_ms {
        Some(_) => None,
        None => {
            let rate = fleet.slo_base_rate_scale;
            let requests = build_requests(&trace, rate)?;
            let rr = RoutingPolicy::RoundRobin;
            let label = format!("slo base: {rr} x{rate}");
            let started = Instant::now();
            let total = requests.len();
            let on_done = |n: usize| progress.show(&label, n, total, started);
            let outcome =
                match config.nats {
                    None => virtual_runtime()?
                        .block_on(run_policy(&config, rr, rate, &requests, &on_done)),
                    Some(_) => super::runtime()?
                        .block_on(run_policy(&config, rr, rate, &requests, &on_done)),
                }
                .with_context(|| format!("the SLO base run ({rr} at x{rate}) failed"))?;
            let summary = summarize(&outcome, config.block_size);
            let base = derived_slo_ttft_ms(&summary, fleet.slo_factor).with_context(|| {
                format!(
                    "over 10% of the SLO base run's requests ({rr} at x{rate}) failed: \
                     give --slo-ttft-ms"
                )
            })?;
            Some(base)
        }
    };
    let slo_ttft_ms = match (&slo_base, fleet.slo_ttft_ms) {
        (Some(b), _) => b.slo_ttft_ms(),
        (None, Some(s)) => s,
        (None, None) => unreachable!("a derived SLO or an explicit one"),
    };
    let settings = ReportSettings {
        workers: fleet.workers as usize,
        dp_size: fleet.dp_size,
        block_size: fleet.block_size,
        capacity_blocks: fleet.capacity_blocks as u64,
        host_capacity_blocks: fleet.host_capacity_blocks as u64,
        disk_capacity_blocks: fleet.disk_capacity_blocks as u64,
        replicas: fleet.replicas,
        speedup: if fleet.nats.is_some() {
            fleet.speedup
        } else {
            0.0
        },
        slo_ttft_ms,
        slo_base,
        expected_output: fleet.expected_output,
        bus: if fleet.nats.is_some() {
            "nats"
        } else {
            "in-process"
        }
        .to_string(),
        requests: trace.len(),
        seed: fleet.seed,
        truncated_requests: count_truncated(&trace),
        serving_indexers: config.serving_indexers(),
        replica_sync: config.replica_sync,
        no_kv_events: config.no_kv_events,
    };
    let report = ReplayReport::from_outcomes(
        trace_path.display().to_string(),
        settings,
        ideals.unwrap_or_default(),
        &outcomes,
    );
    Ok((report, outcomes))
}

fn output(report: &ReplayReport, outcomes: &[RunOutcome], fleet: &FleetArgs) -> anyhow::Result<()> {
    if let Some(path) = &fleet.plot {
        plot(report, outcomes, path)
            .with_context(|| format!("cannot plot to {}", path.display()))?;
    }
    if fleet.json {
        println!("{}", serde_json::to_string(report)?);
    } else {
        print!("{}", render_table(report));
        if let Some(path) = &fleet.plot {
            println!("plot written to {}", path.display());
        }
    }
    Ok(())
}

pub fn run_replay(args: ReplayArgs) -> anyhow::Result<()> {
    let rates = match (args.rate_scale, args.rate_scales.is_empty()) {
        (Some(r), _) => vec![r],
        (None, false) => args.rate_scales.clone(),
        (None, true) => vec![1.0],
    };
    let (report, outcomes) = replay(&args.trace, &args.policies, &rates, &args.fleet)?;
    output(&report, &outcomes, &args.fleet)
}

pub fn run_demo(args: DemoArgs) -> anyhow::Result<()> {
    let trace = args.trace.clone().unwrap_or_else(default_trace);
    if !args.fleet.json {
        println!(
            "kvrouter demo: replaying {} through {} router replicas and {} simulated workers \
             (in-process bus), kv routing against round robin, arrivals x{}.\n",
            trace.display(),
            args.fleet.replicas,
            args.fleet.workers,
            args.rate_scale
        );
    }
    let (report, outcomes) = replay(
        &trace,
        &[RoutingPolicy::Kv, RoutingPolicy::RoundRobin],
        &[args.rate_scale],
        &args.fleet,
    )?;
    output(&report, &outcomes, &args.fleet)?;
    if !args.fleet.json {
        let find = |p: &str| report.runs.iter().find(|r| r.policy == p);
        if let (Some(kv), Some(rr)) = (find("kv"), find("round-robin")) {
            println!(
                "\nkv routing: mean TTFT {:.0} ms against round robin's {:.0} ms ({:.1}x lower), \
                 p99 {:.0} ms against {:.0} ms; cache hit rate {:.1}% against {:.1}% \
                 (an ideal pooled cache: {:.1}%).",
                kv.ttft_ms.mean,
                rr.ttft_ms.mean,
                rr.ttft_ms.mean / kv.ttft_ms.mean.max(1e-9),
                kv.ttft_ms.p99,
                rr.ttft_ms.p99,
                kv.hit_rate * 100.0,
                rr.hit_rate * 100.0,
                report.ideals.pooled_hit_rate * 100.0
            );
        }
    }
    Ok(())
}

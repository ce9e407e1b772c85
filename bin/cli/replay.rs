//! `kvrouter bench replay` and `kvrouter demo`: a trace through replicas and a mocker fleet
//! (the work is kvrouter-replay's [`Experiment`]; this parses flags and prints).

use super::cost_args::CostArgs;
use anyhow::Context;
use clap::Args;
use kvrouter_bus::NatsOptions;
use kvrouter_replay::experiment::{Experiment, Progress, Slo};
use kvrouter_replay::report::{render_table, ReplayReport};
use kvrouter_replay::requests::load_trace;
use kvrouter_replay::runner::ReplayConfig;
use kvrouter_replay::RunOutcome;
use kvrouter_replica::{IndexFlags, IndexSource};
use kvrouter_scheduler::{RoutingPolicy, SchedulerConfig};
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};

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
    /// The replicas' cost (as `serve` takes it).
    #[command(flatten)]
    cost: CostArgs,
    /// The replicas' request timeout: active requests never freed are dropped after this
    /// many (simulated) seconds. The replay frees every request, and under overload a
    /// request may queue in its engine for minutes: a shorter timeout would drop live load
    /// from the routers' view.
    #[arg(long, env = "KVROUTER_REQUEST_TIMEOUT_SECS", default_value_t = 3600.0)]
    request_timeout_secs: f64,
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

#[cfg(feature = "bench")]
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
fn progress_bar(quiet: bool) -> impl Fn(Progress) + Sync {
    let enabled = !quiet && std::io::stderr().is_terminal();
    move |p: Progress| {
        if !enabled {
            return;
        }
        let width = 30;
        let filled = p.done * width / p.total.max(1);
        let mut err = std::io::stderr().lock();
        let _ = write!(
            err,
            "\r{:<28} [{}{}] {}/{} {:.0}s",
            p.label,
            "#".repeat(filled),
            "-".repeat(width - filled),
            p.done,
            p.total,
            p.elapsed.as_secs_f64()
        );
        if p.done == p.total {
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
    #[cfg(not(feature = "bench"))]
    if fleet.plot.is_some() {
        anyhow::bail!(
            "--plot: this kvrouter was built without plots (the bench feature); build it with \
             `cargo build --release` (default features)"
        );
    }
    let trace = load_trace(trace_path, fleet.limit)
        .with_context(|| format!("cannot load the trace {}", trace_path.display()))?;
    let experiment = Experiment {
        trace_name: trace_path.display().to_string(),
        trace,
        policies: policies.to_vec(),
        rates: rates.to_vec(),
        config: fleet.config()?,
        slo: match fleet.slo_ttft_ms {
            Some(ttft_ms) => Slo::Fixed { ttft_ms },
            None => Slo::Derived {
                factor: fleet.slo_factor,
                base_rate_scale: fleet.slo_base_rate_scale,
            },
        },
    };
    Ok(experiment.run(&progress_bar(fleet.json))?)
}

impl FleetArgs {
    /// Each replica's index from the flags, through the mapping `serve` uses: the first
    /// K replicas serve theirs (K = --serve-indexer-replicas, or 1 with --remote-indexer
    /// alone), the rest ask them; --no-kv-events for all.
    fn indexes(&self) -> anyhow::Result<Vec<IndexSource>> {
        let serving = match (self.serve_indexer_replicas, self.remote_indexer) {
            (0, true) => 1,
            (k, _) => k,
        };
        if serving > self.replicas {
            anyhow::bail!(
                "{serving} serving indexers asked of {} replicas",
                self.replicas
            );
        }
        (0..self.replicas)
            .map(|i| {
                let flags = IndexFlags {
                    no_kv_events: self.no_kv_events,
                    serve_indexer: i < serving,
                    use_remote_indexer: serving > 0 && i >= serving,
                    ..IndexFlags::default()
                };
                Ok(flags.source()?)
            })
            .collect()
    }

    fn config(&self) -> anyhow::Result<ReplayConfig> {
        Ok(ReplayConfig {
            workers: self.workers,
            dp_size: self.dp_size,
            block_size: self.block_size,
            capacity_blocks: self.capacity_blocks,
            host_capacity_blocks: self.host_capacity_blocks,
            disk_capacity_blocks: self.disk_capacity_blocks,
            speedup: self.speedup,
            replicas: self.replicas,
            nats: self.nats.as_ref().map(NatsOptions::new),
            seed: self.seed,
            scheduler: self.cost.apply(SchedulerConfig {
                request_timeout: crate::cli::serve::secs(
                    "request-timeout-secs",
                    self.request_timeout_secs,
                )?,
                ..SchedulerConfig::default()
            }),
            indexes: self.indexes()?,
            replica_sync: self.replica_sync,
            replica_sync_echo: crate::cli::serve::millis(
                "replica-sync-echo-ms",
                self.replica_sync_echo_ms,
            )?,
            expected_output: self.expected_output,
            ..ReplayConfig::default()
        })
    }
}

fn output(report: &ReplayReport, outcomes: &[RunOutcome], fleet: &FleetArgs) -> anyhow::Result<()> {
    #[cfg(feature = "bench")]
    if let Some(path) = &fleet.plot {
        kvrouter_bench::plot::plot(report, outcomes, path)
            .with_context(|| format!("cannot plot to {}", path.display()))?;
    }
    #[cfg(not(feature = "bench"))]
    let _ = outcomes; // plots need the bench feature; `replay` refused --plot up front
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

#[cfg(feature = "bench")]
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

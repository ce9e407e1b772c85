//! `kvrouter bench ...`

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use kvrouter_bench::indexer_bench::{
    measure_rss, measure_ruler_rss, transparent_huge_pages, BenchError, IndexMode, RssFigures,
};
use kvrouter_bench::indexer_experiment::{IndexerExperiment, RssOf};
use kvrouter_bench::indexer_scale::{run_scale, ScaleConfig, ScaleFigures};
use kvrouter_bench::indexer_stream::StreamConfig;
use kvrouter_bench::stats::Spread;
use kvrouter_bench::trace::load_trace;
use kvrouter_bench::trace_gen::{generate, write_trace, ChatModel, TraceKind};
use kvrouter_bench::trace_stats::TraceStats;
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Build the indexer event stream from a Mooncake trace, apply it, look up every request.
    Indexer(IndexerArgs),
    /// (internal) Populate an index from an exported stream in a fresh process; print RSS.
    #[command(hide = true)]
    IndexerRss(IndexerRssArgs),
    /// Write a Mooncake-format trace from a model of a multi-turn chat service.
    GenTrace(GenTraceArgs),
    /// Print a Mooncake trace's shape: requests, duration, prompt blocks, distinct blocks,
    /// an unlimited cache's hit rate, output lengths.
    TraceStats(TraceStatsArgs),
    /// Open-loop route latency against running replicas (p50/p99/p99.9/max).
    RouteLatency(super::bench_route::RouteLatencyArgs),
    /// Replay a Mooncake trace through router replicas and a mocker fleet, per routing
    /// policy and rate: hit rates against two ideals, TTFT, ITL, throughput, goodput.
    Replay(super::replay::ReplayArgs),
    /// The bridge: engine KV event payloads decoded and forwarded per second on one core,
    /// and the delay from an engine's ZMQ publish to index visibility at a fixed rate.
    Bridge(super::bench_bridge::BridgeBenchArgs),
    /// The frontend's added latency over calling the engine directly (open-loop streaming
    /// requests with token-id prompts, p50/p99 per rate) and the tokenizer's time per 1k tokens.
    Frontend(super::bench_frontend::FrontendBenchArgs),
    /// The endpoint picker's added latency behind Envoy: the same open-loop streaming
    /// requests through Envoy's round robin and through ext_proc and `kvrouter epp` to the
    /// same engines (p50/p99 per rate). Needs `envoy` on PATH.
    Epp(super::bench_epp::EppBenchArgs),
    /// A real fleet (nats-server, replicas, mocker workers) under traffic while a seeded
    /// schedule kills, pauses and restarts processes, drops KV events and publishes garbage;
    /// every replica is checked against the workers' true caches. Exits non-zero when the
    /// fleet diverged after converging, or never converged.
    Chaos(super::bench_chaos::ChaosArgs),
    /// The real fleet (replicas, frontend, a bridge over an emulated engine, NATS) under
    /// honest traffic, alone and then beside each adversary (slow connections, hostile
    /// bodies, label floods, huge worker lists, poisoned engine frames, 1 MiB request ids).
    /// Exits non-zero when a process died, honest success fell, memory passed its ceiling or
    /// a process did not exit on SIGTERM within its drain timeout.
    Hostile(super::bench_hostile::HostileArgs),
}

#[derive(Args)]
pub struct IndexerArgs {
    /// Mooncake-format trace (JSONL).
    #[arg(long, env = "KVROUTER_TRACE", required_unless_present = "scale")]
    trace: Option<PathBuf>,
    /// W: request r goes to worker r mod W (--scale: workers in the fleet, default 1000).
    #[arg(long, env = "KVROUTER_WORKERS", required_unless_present = "scale")]
    workers: Option<u64>,
    /// C: per-worker LRU capacity in sub-blocks.
    #[arg(
        long,
        env = "KVROUTER_CAPACITY_BLOCKS",
        required_unless_present = "scale"
    )]
    capacity_blocks: Option<usize>,
    /// K: sub-blocks per trace block.
    #[arg(long, env = "KVROUTER_SUB_BLOCKS", required_unless_present = "scale")]
    sub_blocks: Option<u64>,
    /// A fleet generated without a trace: --workers x --ranks worker keys holding --pairs
    /// live (block, rank) pairs; apply rate, lookups, bytes per pair, dump and rebuild of a
    /// 64k-block rank.
    #[arg(long, env = "KVROUTER_SCALE", conflicts_with_all = ["trace", "capacity_blocks", "sub_blocks", "export_stream"])]
    scale: bool,
    /// --scale: data-parallel ranks per worker.
    #[arg(long, env = "KVROUTER_RANKS", default_value_t = 8, requires = "scale")]
    ranks: u32,
    /// --scale: live (block, rank) pairs to build.
    #[arg(
        long,
        env = "KVROUTER_PAIRS",
        default_value_t = 100_000_000,
        requires = "scale"
    )]
    pairs: u64,
    /// Index shard actors (sharded mode). More shards apply events in parallel, but a lookup
    /// walks every shard whose workers hold the prefix.
    #[arg(long, env = "KVROUTER_SHARDS", default_value_t = 1)]
    shards: usize,
    /// sharded (shard actors, what a replica runs) or core (the bare index).
    #[arg(long, env = "KVROUTER_MODE", default_value = "sharded")]
    mode: IndexMode,
    /// Timed runs; each figure is the median.
    #[arg(long, env = "KVROUTER_RUNS", default_value_t = 3)]
    runs: usize,
    /// X: engine hash = sequence hash XOR X (decimal or 0x hex).
    #[arg(long, env = "KVROUTER_ENGINE_HASH_SALT", value_parser = super::parse_u64)]
    engine_hash_salt: Option<u64>,
    /// Write the stream as u64 little-endian records to this file.
    #[arg(long, env = "KVROUTER_EXPORT_STREAM")]
    export_stream: Option<PathBuf>,
    /// Timed loads of each pointer chase calibrating the machine (0: no calibration).
    #[arg(long, env = "KVROUTER_CHASE_LOADS", default_value_t = 10_000_000)]
    chase_loads: u64,
    /// Print one JSON object.
    #[arg(long, env = "KVROUTER_JSON")]
    json: bool,
}

#[derive(Args)]
pub struct GenTraceArgs {
    /// conversation (a chat service shaped like the public Mooncake conversation trace) or
    /// synthetic (long documents and follow-ups, like data/synthetic_trace.jsonl).
    #[arg(long, env = "KVROUTER_TRACE_KIND", default_value = "conversation")]
    kind: TraceKind,
    /// Requests to write (default: as many as the kind's public trace); the duration scales
    /// with it at the same request rate.
    #[arg(long, env = "KVROUTER_REQUESTS")]
    requests: Option<usize>,
    /// Random seed: the same seed writes the same trace.
    #[arg(long, env = "KVROUTER_SEED", default_value_t = 1)]
    seed: u64,
    /// Requests per second (default: the kind's public trace's).
    #[arg(long, env = "KVROUTER_RATE")]
    rate: Option<f64>,
    /// Write here instead of stdout.
    #[arg(long, env = "KVROUTER_OUT")]
    out: Option<PathBuf>,
    /// Do not print the trace's statistics to stderr.
    #[arg(long, short, env = "KVROUTER_QUIET")]
    quiet: bool,
}

#[derive(Args)]
pub struct TraceStatsArgs {
    /// Mooncake-format traces (JSONL); each is described on its own.
    #[arg(required = true)]
    traces: Vec<PathBuf>,
    /// Print one JSON object per trace.
    #[arg(long, env = "KVROUTER_JSON")]
    json: bool,
}

#[derive(Args)]
pub struct IndexerRssArgs {
    #[arg(long)]
    stream: PathBuf,
    #[arg(long, default_value = "sharded")]
    mode: IndexMode,
    #[arg(long, default_value_t = 1)]
    shards: usize,
    /// Measure the ruler (the plain radix tree) instead of the index.
    #[arg(long)]
    ruler: bool,
}

/// Runs a bench command; each picks its own runtime (the replay runs on a virtual clock).
pub fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Replay(args) => super::replay::run_replay(args),
        BenchCommand::Indexer(args) => super::runtime()?.block_on(indexer(args)),
        BenchCommand::RouteLatency(args) => {
            super::runtime()?.block_on(super::bench_route::run(args))
        }
        BenchCommand::Bridge(args) => super::runtime()?.block_on(super::bench_bridge::run(args)),
        BenchCommand::Frontend(args) => {
            super::runtime()?.block_on(super::bench_frontend::run(args))
        }
        BenchCommand::Epp(args) => super::runtime()?.block_on(super::bench_epp::run(args)),
        BenchCommand::Chaos(args) => super::runtime()?.block_on(super::bench_chaos::run(args)),
        BenchCommand::Hostile(args) => super::runtime()?.block_on(super::bench_hostile::run(args)),
        BenchCommand::GenTrace(args) => gen_trace(args),
        BenchCommand::TraceStats(args) => trace_stats(args),
        BenchCommand::IndexerRss(args) => {
            let figures = if args.ruler {
                measure_ruler_rss(&args.stream)?
            } else {
                super::runtime()?.block_on(measure_rss(&args.stream, args.mode, args.shards))?
            };
            println!("{}", serde_json::to_string(&figures)?);
            Ok(())
        }
    }
}

fn gen_trace(args: GenTraceArgs) -> anyhow::Result<()> {
    let mut model = ChatModel::for_kind(args.kind);
    if let Some(rate) = args.rate {
        if !(rate.is_finite() && rate > 0.0) {
            bail!("--rate must be a positive number of requests per second, not {rate}");
        }
        model.rate = rate;
    }
    let n = args
        .requests
        .unwrap_or_else(|| ChatModel::default_requests(args.kind));
    if n == 0 {
        bail!("--requests must be at least 1");
    }
    let trace = generate(&model, n, args.seed);
    match &args.out {
        Some(path) => {
            let file = std::fs::File::create(path)
                .with_context(|| format!("cannot create {}", path.display()))?;
            write_trace(&mut std::io::BufWriter::new(file), &trace)
                .with_context(|| format!("cannot write {}", path.display()))?;
        }
        None => write_trace(
            &mut std::io::BufWriter::new(std::io::stdout().lock()),
            &trace,
        )
        .context("cannot write the trace to stdout")?,
    }
    if !args.quiet {
        eprintln!(
            "{:?} trace, seed {}{}:\n{}",
            args.kind,
            args.seed,
            args.out
                .as_ref()
                .map(|p| format!(", written to {}", p.display()))
                .unwrap_or_default(),
            TraceStats::of(&trace).render()
        );
    }
    Ok(())
}

fn trace_stats(args: TraceStatsArgs) -> anyhow::Result<()> {
    for path in &args.traces {
        let trace = load_trace(path)?;
        let stats = TraceStats::of(&trace);
        if args.json {
            let mut v = serde_json::to_value(&stats)?;
            v["trace"] = serde_json::json!(path);
            println!("{v}");
        } else {
            println!("{}:\n{}", path.display(), stats.render());
        }
    }
    Ok(())
}

async fn indexer(args: IndexerArgs) -> anyhow::Result<()> {
    if args.runs == 0 {
        bail!("--runs must be at least 1");
    }
    if args.shards == 0 {
        bail!("--shards must be at least 1");
    }
    if args.scale {
        return indexer_scale(args).await;
    }
    let (Some(trace), Some(workers), Some(capacity_blocks), Some(sub_blocks)) = (
        args.trace.clone(),
        args.workers,
        args.capacity_blocks,
        args.sub_blocks,
    ) else {
        bail!(
            "--trace, --workers, --capacity-blocks and --sub-blocks are required without --scale"
        );
    };
    // The memory run reads the stream from a file in a fresh process, so the stream is
    // always written: to --export-stream, or to a temporary file.
    let temp;
    let stream_path = match &args.export_stream {
        Some(p) => p.clone(),
        None => {
            temp = tempfile::Builder::new()
                .prefix("kvrouter-stream-")
                .suffix(".bin")
                .tempfile()
                .context("cannot create a temporary stream file")?;
            temp.path().to_owned()
        }
    };
    let experiment = IndexerExperiment {
        trace,
        stream: StreamConfig {
            workers,
            capacity_blocks,
            sub_blocks,
            engine_hash_salt: args.engine_hash_salt,
        },
        mode: args.mode,
        shards: args.shards,
        runs: args.runs,
        stream_path,
        git_revision: env!("KVROUTER_GIT_REV").to_string(),
        chase_loads: args.chase_loads,
    };
    let report = experiment
        .run(|stream, of| {
            rss_in_child(stream, args.mode, args.shards, of)
                .map_err(|e| BenchError::MemoryRun(format!("{e:#}")))
        })
        .await?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", report.render());
    }
    Ok(())
}

async fn indexer_scale(args: IndexerArgs) -> anyhow::Result<()> {
    let cfg = ScaleConfig {
        workers: args.workers.unwrap_or(1000),
        ranks: args.ranks,
        pairs: args.pairs,
        ..ScaleConfig::default()
    };
    let mut runs = Vec::with_capacity(args.runs);
    for i in 0..args.runs {
        let f = run_scale(&cfg, args.mode, args.shards).await?;
        tracing::info!(
            run = i + 1,
            block_ops_per_s = f.block_ops_per_s,
            lookup_p99_us = f.lookup_p99_us,
            "scale run done"
        );
        runs.push(f);
    }
    let spread = |f: fn(&ScaleFigures) -> f64| Spread::of(runs.iter().map(f));
    let report = serde_json::json!({
        "scale": cfg,
        "mode": args.mode,
        "shards": if args.mode == IndexMode::Sharded { args.shards } else { 1 },
        "runs": runs,
        "block_ops_per_s": spread(|f| f.block_ops_per_s),
        "lookup_p50_us": spread(|f| f.lookup_p50_us),
        "lookup_p99_us": spread(|f| f.lookup_p99_us),
        "lookups_per_s": spread(|f| f.lookups_per_s),
        "bytes_per_pair": spread(|f| f.bytes_per_pair),
        "dump_ms": spread(|f| f.dump_ms),
        "rebuild_ms": spread(|f| f.rebuild_ms),
        "git_revision": env!("KVROUTER_GIT_REV"),
        "transparent_huge_pages": transparent_huge_pages(),
    });
    if args.json {
        println!("{report}");
        return Ok(());
    }
    let f = &runs[runs.len() / 2];
    let m = |k: &str| report[k]["median"].as_f64().unwrap_or(0.0);
    println!(
        "kvrouter bench indexer --scale: {} workers x {} ranks, {} live pairs, {} live blocks",
        cfg.workers, cfg.ranks, f.live_pairs, f.live_blocks
    );
    println!("  apply    {:.2} M block ops/s", m("block_ops_per_s") / 1e6);
    println!(
        "  lookup   p50 {:.2} µs, p99 {:.2} µs, {:.0} k lookups/s",
        m("lookup_p50_us"),
        m("lookup_p99_us"),
        m("lookups_per_s") / 1e3
    );
    println!(
        "  memory   {:.1} bytes per live pair (RSS +{:.2} GiB)",
        m("bytes_per_pair"),
        m("bytes_per_pair") * f.live_pairs as f64 / (1u64 << 30) as f64
    );
    println!(
        "  one rank of {} blocks: dump {:.1} ms, rebuild {:.1} ms",
        f.dump_blocks,
        m("dump_ms"),
        m("rebuild_ms")
    );
    println!(
        "  (median of {} runs; build {}, transparent huge pages {})",
        args.runs,
        env!("KVROUTER_GIT_REV"),
        transparent_huge_pages().as_deref().unwrap_or("unknown")
    );
    Ok(())
}

fn rss_in_child(
    stream: &std::path::Path,
    mode: IndexMode,
    shards: usize,
    of: RssOf,
) -> anyhow::Result<RssFigures> {
    let exe = std::env::current_exe().context("cannot find the kvrouter executable")?;
    let mode = match mode {
        IndexMode::Sharded => "sharded",
        IndexMode::Core => "core",
    };
    let mut cmd = std::process::Command::new(exe);
    cmd.args(["bench", "indexer-rss", "--mode", mode, "--shards"])
        .arg(shards.to_string())
        .arg("--stream")
        .arg(stream);
    if of == RssOf::Ruler {
        cmd.arg("--ruler");
    }
    let out = cmd
        .env("KVROUTER_LOG", "warn")
        .output()
        .context("cannot start the memory-measurement run")?;
    if !out.status.success() {
        bail!(
            "memory-measurement run failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    serde_json::from_slice(&out.stdout).context("memory-measurement run printed no figures")
}

/// Prints a fleet bench's report: as JSON with the build's revision and the verdict, or as
/// its text with the revision under it.
pub fn print_report(
    json: bool,
    report: serde_json::Value,
    passed: bool,
    text: impl FnOnce() -> String,
) -> anyhow::Result<()> {
    if json {
        let mut v = report;
        v["git_revision"] = serde_json::json!(env!("KVROUTER_GIT_REV"));
        v["passed"] = serde_json::json!(passed);
        println!("{v}");
    } else {
        print!("{}", text());
        println!("  (build {})", env!("KVROUTER_GIT_REV"));
    }
    Ok(())
}

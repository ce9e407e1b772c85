//! `kvrouter bench chaos`: a real fleet over a real nats-server under seeded faults; every
//! replica is checked against the workers' true caches. The run lives in
//! `kvrouter_bench::chaos`.

use anyhow::{bail, Context};
use clap::Args;
use kvrouter_bench::chaos::{run_chaos, ChaosConfig, EngineSpec, Timing};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Args)]
pub struct ChaosArgs {
    /// Seconds of traffic and faults (checkpoints add to the wall time).
    #[arg(long, env = "KVROUTER_DURATION", default_value_t = 60.0)]
    pub duration: f64,
    /// Seed of the fault schedule and the traffic: the same seed injects the same faults.
    #[arg(long, env = "KVROUTER_SEED", default_value_t = 1)]
    pub seed: u64,
    /// Router replicas: all but the last keep an index (--serve-indexer), the last uses
    /// theirs (--use-remote-indexer); all with --replica-sync.
    #[arg(long, env = "KVROUTER_REPLICAS", default_value_t = 3)]
    pub replicas: usize,
    /// `kvrouter mocker` processes (each killed and restarted as a whole).
    #[arg(long, env = "KVROUTER_MOCKERS", default_value_t = 2)]
    pub mockers: usize,
    /// Workers in each mocker process.
    #[arg(long, env = "KVROUTER_WORKERS", default_value_t = 2)]
    pub workers: u32,
    /// Data-parallel ranks per worker.
    #[arg(long, env = "KVROUTER_DP_SIZE", default_value_t = 2)]
    pub dp_size: u32,
    /// Emulated engines (`kvrouter mocker --emulate`), each behind its own `kvrouter bridge`:
    /// a comma-separated list of vllm and sglang ("" for none, which also leaves the
    /// bridge_kill and engine_kill faults out).
    #[arg(
        long,
        env = "KVROUTER_ENGINES",
        default_value = "vllm,sglang",
        value_delimiter = ','
    )]
    pub engines: Vec<String>,
    /// Data-parallel ranks of each emulated engine.
    #[arg(long, env = "KVROUTER_ENGINE_DP_SIZE", default_value_t = 2)]
    pub engine_dp_size: u32,
    /// The share of requests sent to the emulated engines (over HTTP, as a frontend does).
    #[arg(long, env = "KVROUTER_ENGINE_SHARE", default_value_t = 0.3)]
    pub engine_share: f64,
    /// KV cache capacity of each rank, in blocks (small, so blocks are evicted too).
    #[arg(long, env = "KVROUTER_CAPACITY_BLOCKS", default_value_t = 256)]
    pub capacity_blocks: u32,
    /// The mockers' simulated time runs this many times faster than the wall clock.
    #[arg(long, env = "KVROUTER_SPEEDUP", default_value_t = 100.0)]
    pub speedup: f64,
    /// Client tasks sending requests (each one at a time).
    #[arg(long, env = "KVROUTER_CONCURRENCY", default_value_t = 4)]
    pub concurrency: usize,
    /// Retries of a failed request (route + generate) before it counts as failed.
    #[arg(long, env = "KVROUTER_MAX_RETRIES", default_value_t = 3)]
    pub max_retries: u32,
    /// The replicas' --request-timeout-secs, serve's default: the sweep of requests nobody
    /// frees. A fleet that leaks none converges without it; a short one hides leaks as slow
    /// convergence.
    #[arg(long, env = "KVROUTER_REQUEST_TIMEOUT_SECS", default_value_t = 300)]
    pub request_timeout_secs: u64,
    /// Longest fault, in milliseconds (each lasts between an eighth of it and it).
    #[arg(long, env = "KVROUTER_MAX_DOWN_MS", default_value_t = 4000)]
    pub max_down_ms: u64,
    /// How long a checkpoint waits for every replica to agree with the truth, in seconds.
    #[arg(long, env = "KVROUTER_CONVERGE_TIMEOUT_SECS", default_value_t = 30)]
    pub converge_timeout_secs: u64,
    /// Write each child process's stderr to DIR/NAME.log.
    #[arg(long, env = "KVROUTER_LOG_DIR")]
    pub log_dir: Option<PathBuf>,
    /// Print one JSON object.
    #[arg(long, env = "KVROUTER_JSON")]
    pub json: bool,
}

pub async fn run(args: ChaosArgs) -> anyhow::Result<()> {
    if !(args.duration.is_finite() && args.duration > 0.0) {
        bail!("--duration must be a positive number of seconds");
    }
    if args.max_down_ms < 100 {
        bail!("--max-down-ms must be at least 100");
    }
    let mut engines = Vec::new();
    for name in args
        .engines
        .iter()
        .map(|e| e.trim())
        .filter(|e| !e.is_empty())
    {
        match EngineSpec::named(name, args.engine_dp_size) {
            Some(e) => engines.push(e),
            None => bail!("--engines takes vllm and sglang, not {name:?}"),
        }
    }
    let exe = std::env::current_exe().context("cannot find the kvrouter executable")?;
    let mut cfg = ChaosConfig::new(exe, Duration::from_secs_f64(args.duration), args.seed);
    cfg.replicas = args.replicas;
    cfg.mockers = args.mockers;
    cfg.workers_per_mocker = args.workers;
    cfg.dp_size = args.dp_size;
    cfg.engines = engines;
    cfg.engine_share = args.engine_share;
    cfg.capacity_blocks = args.capacity_blocks;
    cfg.speedup = args.speedup;
    cfg.concurrency = args.concurrency;
    cfg.max_retries = args.max_retries;
    cfg.request_timeout_secs = args.request_timeout_secs;
    cfg.converge_timeout = Duration::from_secs(args.converge_timeout_secs);
    cfg.log_dir = args.log_dir;
    cfg.timing = Timing {
        down_ms: (args.max_down_ms / 8, args.max_down_ms),
        ..Timing::default()
    };
    let report = run_chaos(cfg).await?;
    super::bench::print_report(
        args.json,
        serde_json::to_value(&report)?,
        report.passed(),
        || report.render(),
    )?;
    if !report.passed() {
        bail!(
            "the fleet diverged: {} faults did not converge, {} differences after convergence",
            report.faults_unconverged + usize::from(!report.end.converged),
            report.divergence_after_convergence
        );
    }
    Ok(())
}

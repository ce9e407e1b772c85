//! `kvrouter mocker`: a fleet of simulated engine workers on NATS.

use super::lifecycle::Lifecycle;
use super::nats_args::NatsArgs;
use anyhow::Context;
use clap::Args;
use kvrouter_mocker::emulate::{EmulateConfig, Emulated, EmulatedFleet, ZmqWire};
use kvrouter_mocker::{EngineConfig, FleetConfig, MockerFleet};
use kvrouter_protocol::WorkerRole;
use std::io::Write;
use std::time::Duration;

/// Random worker id bases stay below 2^53, so JSON tools that read numbers as doubles (jq,
/// JavaScript) see the exact ids.
const RANDOM_ID_LIMIT: u64 = 1 << 53;

#[derive(Args)]
pub struct MockerArgs {
    #[command(flatten)]
    nats: NatsArgs,
    /// Model the workers serve.
    #[arg(long, env = "KVROUTER_MODEL")]
    model: String,
    /// Number of workers.
    #[arg(long, env = "KVROUTER_WORKERS", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    workers: u32,
    /// Data-parallel ranks per worker (each with its own KV cache).
    #[arg(long, env = "KVROUTER_DP_SIZE", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    dp_size: u32,
    /// First data-parallel rank of each worker.
    #[arg(long, env = "KVROUTER_DP_START_RANK", default_value_t = 0)]
    dp_start_rank: u32,
    /// Tensor-parallel size (reported in registrations; each tp rank of a prefill or decode
    /// worker transfers KV and reports it on its own).
    #[arg(long, env = "KVROUTER_TP_SIZE", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    tp_size: u32,
    /// Worker role: aggregated, prefill or decode.
    #[arg(long, env = "KVROUTER_ROLE", default_value = "aggregated")]
    role: WorkerRole,
    /// Tokens per KV block.
    #[arg(long, env = "KVROUTER_BLOCK_SIZE", default_value_t = 64)]
    block_size: usize,
    /// KV cache capacity of each rank, in blocks.
    #[arg(long, env = "KVROUTER_CAPACITY_BLOCKS", default_value_t = 6400)]
    capacity_blocks: usize,
    /// Host-memory tier of each rank, in blocks: blocks the device evicts move there (and
    /// are reported with medium CPU); 0 for none.
    #[arg(long, env = "KVROUTER_HOST_CAPACITY_BLOCKS", default_value_t = 0)]
    host_capacity_blocks: usize,
    /// Disk tier of each rank, in blocks: what the host tier (or, without one, the device)
    /// evicts moves there (medium DISK); 0 for none.
    #[arg(long, env = "KVROUTER_DISK_CAPACITY_BLOCKS", default_value_t = 0)]
    disk_capacity_blocks: usize,
    /// Simulated time runs this many times faster than the wall clock.
    #[arg(long, env = "KVROUTER_SPEEDUP", default_value_t = 1.0)]
    speedup: f64,
    /// First worker id (decimal or 0x hex); the workers get consecutive ids. Default: random,
    /// so that several mocker processes do not collide.
    #[arg(long, env = "KVROUTER_WORKER_ID_START", value_parser = super::parse_u64)]
    worker_id_start: Option<u64>,
    /// Token budget of one engine step (decode tokens plus prefill chunks).
    #[arg(long, env = "KVROUTER_MAX_NUM_BATCHED_TOKENS", default_value_t = 8192)]
    max_num_batched_tokens: usize,
    /// Most requests running at once on a rank.
    #[arg(long, env = "KVROUTER_MAX_NUM_SEQS", default_value_t = 256)]
    max_num_seqs: usize,
    /// Heartbeat period in milliseconds.
    #[arg(long, env = "KVROUTER_HEARTBEAT_MS", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..))]
    heartbeat_ms: u64,
    /// Decode workers: simulated microseconds one tp rank takes to receive one prompt block
    /// of KV; the request starts decoding once every tp rank received.
    #[arg(long, env = "KVROUTER_KV_TRANSFER_US_PER_BLOCK", default_value_t = 100)]
    kv_transfer_us_per_block: u64,
    /// Decode workers: a request whose KV not every tp rank received within this many
    /// seconds (wall time) fails.
    #[arg(long, env = "KVROUTER_KV_RECEIVE_TIMEOUT_SECS", default_value_t = 30.0)]
    kv_receive_timeout_secs: f64,
    /// On SIGTERM or SIGINT, how long the whole shutdown may take: the workers stop and
    /// publish their last KV events, then deregister (the last 2 s are kept for that); past it
    /// the process exits with status 1. A second signal exits at once.
    #[arg(long, env = "KVROUTER_DRAIN_TIMEOUT_SECS", default_value_t = 10.0)]
    drain_timeout_secs: f64,
    /// Test hook: this tp rank of every worker finishes no KV transfer (a prefill tp rank
    /// never reports the KV sent, a decode tp rank never receives it).
    #[arg(long, env = "KVROUTER_SILENCE_TP_RANK")]
    silence_tp_rank: Option<u32>,
    /// Look like vllm or sglang from outside instead of joining the bus: KV events on
    /// ZeroMQ, OpenAI-compatible HTTP, /health and /metrics. A `kvrouter bridge` per worker
    /// connects them to the routers.
    #[arg(long, env = "KVROUTER_EMULATE", value_parser = ["vllm", "sglang"], requires_all = ["zmq_port", "http_port"])]
    emulate: Option<String>,
    /// With --emulate: worker i's rank r publishes KV events on PORT + 2·i·dp + r and serves
    /// replay on PORT + 2·i·dp + dp + r.
    #[arg(long, env = "KVROUTER_ZMQ_PORT")]
    zmq_port: Option<u16>,
    /// With --emulate: worker i serves HTTP on PORT + i.
    #[arg(long, env = "KVROUTER_HTTP_PORT")]
    http_port: Option<u16>,
    /// With --emulate: how batches and events are laid out: array-batch (events as maps in an
    /// array batch, vLLM after 0.23), array (events as arrays, older vLLM and SGLang) or map
    /// (a map batch of map events).
    #[arg(long, env = "KVROUTER_ZMQ_WIRE", default_value = "array-batch")]
    zmq_wire: ZmqWire,
    /// With --emulate: the interface to bind.
    #[arg(long, env = "KVROUTER_EMULATE_HOST", default_value = "127.0.0.1")]
    emulate_host: String,
    /// With --emulate: answers report their cached prompt tokens
    /// (`usage.prompt_tokens_details.cached_tokens`), as vLLM does with
    /// --enable-prompt-tokens-details and SGLang with --enable-cache-report; without it the
    /// details are null, as those engines answer by default.
    #[arg(long, env = "KVROUTER_CACHE_REPORT", requires = "emulate")]
    cache_report: bool,
}

impl MockerArgs {
    fn config(&self) -> anyhow::Result<FleetConfig> {
        let worker_id_start = match self.worker_id_start {
            Some(id) => id,
            None => random_worker_id_base(self.workers),
        };
        let config = FleetConfig {
            namespace: self.nats.namespace.clone(),
            model: self.model.clone(),
            workers: self.workers,
            worker_id_start,
            dp_size: self.dp_size,
            dp_start_rank: self.dp_start_rank,
            tp_size: self.tp_size,
            role: self.role,
            engine: EngineConfig {
                block_size: self.block_size,
                capacity_blocks: self.capacity_blocks,
                host_capacity_blocks: self.host_capacity_blocks,
                disk_capacity_blocks: self.disk_capacity_blocks,
                max_num_batched_tokens: self.max_num_batched_tokens,
                max_num_seqs: self.max_num_seqs,
                ..EngineConfig::default()
            },
            speedup: self.speedup,
            heartbeat_interval: Duration::from_millis(self.heartbeat_ms),
            kv_transfer_per_block: Duration::from_micros(self.kv_transfer_us_per_block),
            kv_receive_timeout: super::serve::secs(
                "kv-receive-timeout-secs",
                self.kv_receive_timeout_secs,
            )?,
            silence_tp_rank: self.silence_tp_rank,
            ..FleetConfig::default()
        };
        config.validate()?;
        Ok(config)
    }
}

/// A random first id such that `workers` consecutive ids stay below 2^53.
fn random_worker_id_base(workers: u32) -> u64 {
    let room = RANDOM_ID_LIMIT - u64::from(workers);
    uuid::Uuid::new_v4().as_u64_pair().0 % room
}

pub async fn run(args: MockerArgs) -> anyhow::Result<()> {
    let config = args.config()?;
    if let Some(engine) = &args.emulate {
        return emulate(&args, engine, config).await;
    }
    let drain_timeout = super::serve::secs("drain-timeout-secs", args.drain_timeout_secs)?;
    let mut life = Lifecycle::install("mocker", drain_timeout)?;
    let fleet = life
        .startup(async {
            let bus = args.nats.connect("kvrouter-mocker").await?;
            MockerFleet::start(bus, config)
                .await
                .context("cannot start the mocker fleet")
        })
        .await?;
    let worker_ids = fleet.worker_ids();
    let instance_ids: Vec<String> = worker_ids
        .iter()
        .filter_map(|&w| fleet.instance_id(w))
        .map(|u| u.to_string())
        .collect();
    tracing::info!(
        model = %fleet.config().model,
        ?worker_ids,
        dp_size = fleet.config().dp_size,
        dp_start_rank = fleet.config().dp_start_rank,
        speedup = fleet.config().speedup,
        "mocker fleet running"
    );
    // Written by hand to keep the field order: worker_ids first.
    let line = format!(
        "{{\"worker_ids\":{},\"instance_ids\":{}}}",
        serde_json::to_string(&worker_ids)?,
        serde_json::to_string(&instance_ids)?
    );
    {
        super::print_start_line(line)?;
    }
    life.wait().await;
    let drain_budget = life.drain_budget();
    let what = move || format!("stopping and deregistering workers {worker_ids:?}");
    life.shutdown(what, async {
        fleet
            .shutdown_within(drain_budget)
            .await
            .context("mocker shutdown did not complete cleanly")
    })
    .await
}

/// `--emulate`: workers that look like vLLM or SGLang from outside; one JSON line per worker
/// on stdout (base URL, ZMQ endpoints, metrics URL).
async fn emulate(args: &MockerArgs, engine: &str, fleet: FleetConfig) -> anyhow::Result<()> {
    let drain_timeout = super::serve::secs("drain-timeout-secs", args.drain_timeout_secs)?;
    let mut life = Lifecycle::install("mocker", drain_timeout)?;
    let config = EmulateConfig {
        engine: if engine == "sglang" {
            Emulated::Sglang
        } else {
            Emulated::Vllm
        },
        wire: args.zmq_wire,
        zmq_port: args.zmq_port.context("--emulate needs --zmq-port")?,
        http_port: args.http_port.context("--emulate needs --http-port")?,
        host: args.emulate_host.clone(),
        topic: String::new(),
        cache_report: args.cache_report,
        fleet,
    };
    let fleet = life
        .startup(async {
            EmulatedFleet::start(config)
                .await
                .context("cannot start the emulated engines")
        })
        .await?;
    {
        let mut out = std::io::stdout().lock();
        for w in &fleet.workers {
            writeln!(out, "{}", serde_json::to_string(w)?).context("cannot write to stdout")?;
        }
        out.flush().context("cannot write to stdout")?;
    }
    tracing::info!(
        engine,
        workers = fleet.workers.len(),
        "emulated engines running"
    );
    life.wait().await;
    let budget = life.drain_budget();
    life.shutdown(|| "stopping the emulated engines".to_string(), async move {
        fleet.shutdown_within(budget).await;
        Ok(())
    })
    .await
}

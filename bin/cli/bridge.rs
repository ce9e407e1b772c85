//! `kvrouter bridge`: a sidecar beside one vLLM or SGLang engine that reads its KV events
//! from ZeroMQ and speaks for it on the bus as a kvrouter worker.

use super::lifecycle::Lifecycle;
use super::nats_args::NatsArgs;
use anyhow::Context;
use clap::Args;
use kvrouter_bridge::{Bridge, BridgeConfig};
use kvrouter_protocol::{EngineKind, WorkerRole};
use std::net::SocketAddr;
use std::time::Duration;

#[derive(Args)]
pub struct BridgeArgs {
    #[command(flatten)]
    nats: NatsArgs,
    #[command(flatten)]
    http: super::http_args::HttpArgs,
    /// The engine: vllm or sglang.
    #[arg(long, env = "KVROUTER_ENGINE")]
    engine: EngineKind,
    /// The model the engine serves (as the router's requests name it).
    #[arg(long, env = "KVROUTER_MODEL")]
    model: String,
    /// Tokens per KV block: the engine's --block-size (vLLM) or --page-size (SGLang).
    #[arg(long, env = "KVROUTER_BLOCK_SIZE", value_parser = clap::value_parser!(u32).range(1..))]
    block_size: u32,
    /// The engine's KV event publisher for data-parallel rank 0, tcp://HOST:PORT. Rank r
    /// publishes on PORT + r (the engines offset the port by the global rank).
    #[arg(long, env = "KVROUTER_ZMQ_ENDPOINT")]
    zmq_endpoint: String,
    /// Bind --zmq-endpoint (rank r on PORT + r) and let the engine's publisher connect to it,
    /// rather than connecting to a publisher the engine binds. With vLLM, give it the same
    /// tcp://127.0.0.1:PORT: it connects to non-wildcard TCP endpoints, so its KV events
    /// (prompt token ids) never listen on the pod's network.
    #[arg(long, env = "KVROUTER_ZMQ_BIND")]
    zmq_bind: bool,
    /// The engine's replay endpoint for rank 0 (offset the same way). Without it, lost
    /// batches clear the rank instead of being replayed.
    #[arg(long, env = "KVROUTER_REPLAY_ENDPOINT")]
    replay_endpoint: Option<String>,
    /// The engine's ZMQ topic (a prefix; empty: every message).
    #[arg(long, env = "KVROUTER_TOPIC", default_value = "")]
    topic: String,
    /// Data-parallel ranks this engine runs.
    #[arg(long, env = "KVROUTER_DP_SIZE", default_value_t = 1)]
    dp_size: u32,
    /// The global rank of the engine's first data-parallel rank.
    #[arg(long, env = "KVROUTER_DP_START_RANK", default_value_t = 0)]
    dp_start_rank: u32,
    #[arg(long, env = "KVROUTER_TP_SIZE", default_value_t = 1)]
    tp_size: u32,
    /// aggregated, prefill or decode.
    #[arg(long, env = "KVROUTER_ROLE", default_value = "aggregated")]
    role: WorkerRole,
    /// KV cache capacity of each rank, in blocks (the engine logs it at start-up).
    #[arg(long, env = "KVROUTER_CAPACITY_BLOCKS")]
    capacity_blocks: u64,
    /// Host-memory blocks per rank the engine offloads to (vLLM's offloading connector,
    /// LMCache, SGLang's hierarchical cache): bounds the bridge's copy of that tier.
    #[arg(long, env = "KVROUTER_HOST_CAPACITY_BLOCKS")]
    host_capacity_blocks: Option<u64>,
    /// Disk blocks per rank the engine offloads to.
    #[arg(long, env = "KVROUTER_DISK_CAPACITY_BLOCKS")]
    disk_capacity_blocks: Option<u64>,
    /// Where frontends send this engine's requests, http://HOST:PORT.
    #[arg(long, env = "KVROUTER_BASE_URL")]
    base_url: String,
    /// The engine's Prometheus metrics [default: BASE_URL/metrics].
    #[arg(long, env = "KVROUTER_METRICS_URL")]
    metrics_url: Option<String>,
    /// The engine's health check [default: BASE_URL/health].
    #[arg(long, env = "KVROUTER_HEALTH_URL")]
    health_url: Option<String>,
    /// Worker id [default: stable, from model, base URL and first rank; see docs/operations.md].
    #[arg(long, env = "KVROUTER_WORKER_ID", value_parser = super::parse_u64)]
    worker_id: Option<u64>,
    /// Admin HTTP (/healthz, /readyz, /metrics), e.g. 0.0.0.0:9100.
    #[arg(long, env = "KVROUTER_ADMIN_ADDR")]
    admin_addr: Option<SocketAddr>,
    /// How often to check the engine's health.
    #[arg(long, env = "KVROUTER_HEALTH_INTERVAL_MS", default_value_t = 250)]
    health_interval_ms: u64,
    /// How often to scrape the engine's metrics into load reports.
    #[arg(long, env = "KVROUTER_METRICS_INTERVAL_MS", default_value_t = 200)]
    metrics_interval_ms: u64,
    /// Seconds the engine may run requests on a rank without one KV event batch before the
    /// bridge warns that its events go elsewhere (kvrouter_bridge_events_silent).
    #[arg(long, env = "KVROUTER_EVENTS_SILENT_SECS", default_value_t = 60.0)]
    events_silent_secs: f64,
    #[arg(long, env = "KVROUTER_HEARTBEAT_MS", default_value_t = 1000)]
    heartbeat_ms: u64,
    /// Seconds a shutdown may take (deregistering included).
    #[arg(long, env = "KVROUTER_DRAIN_TIMEOUT_SECS", default_value_t = 10.0)]
    drain_timeout_secs: f64,
}

impl BridgeArgs {
    fn config(&self) -> anyhow::Result<BridgeConfig> {
        let mut c = BridgeConfig::new(
            self.engine,
            self.model.clone(),
            self.zmq_endpoint.clone(),
            self.base_url.clone(),
        );
        c.namespace = self.nats.namespace.clone();
        c.block_size = self.block_size;
        c.zmq_bind = self.zmq_bind;
        c.replay_endpoint = self.replay_endpoint.clone();
        c.topic = self.topic.clone();
        c.dp_size = self.dp_size;
        c.dp_start_rank = self.dp_start_rank;
        c.tp_size = self.tp_size;
        c.role = self.role;
        c.capacity_blocks = self.capacity_blocks;
        c.host_capacity_blocks = self.host_capacity_blocks;
        c.disk_capacity_blocks = self.disk_capacity_blocks;
        c.metrics_url = self.metrics_url.clone();
        c.health_url = self.health_url.clone();
        c.worker_id = self.worker_id;
        c.admin_addr = self.admin_addr;
        c.http_limits = self.http.limits()?;
        c.health_interval = Duration::from_millis(self.health_interval_ms);
        c.metrics_interval = Duration::from_millis(self.metrics_interval_ms);
        c.events_silent_after = super::serve::secs("events-silent-secs", self.events_silent_secs)?;
        c.heartbeat_interval = Duration::from_millis(self.heartbeat_ms);
        Ok(c)
    }
}

pub async fn run(args: BridgeArgs) -> anyhow::Result<()> {
    let config = args.config()?;
    // Refuse bad flags before touching the bus.
    config.clone().resolve()?;
    let drain_timeout = super::serve::secs("drain-timeout-secs", args.drain_timeout_secs)?;
    let mut life = Lifecycle::install("bridge", drain_timeout)?;
    let bridge = life
        .startup(async {
            let bus = args.nats.connect("kvrouter-bridge").await?;
            Bridge::start(config, bus)
                .await
                .context("cannot start the bridge")
        })
        .await?;
    let worker_id = bridge.worker_id();
    let line = serde_json::json!({
        "worker_id": worker_id,
        "admin": bridge.admin_addr().map(|a| a.to_string()),
    });
    {
        super::print_start_line(line)?;
    }
    life.wait().await;
    let drain_budget = life.drain_budget();
    let what = move || format!("stopping and deregistering worker {worker_id}");
    life.shutdown(what, async {
        bridge
            .shutdown_within(drain_budget)
            .await
            .map_err(anyhow::Error::msg)
            .context("bridge shutdown did not complete cleanly")
    })
    .await
}

//! `kvrouter serve`: one router replica.

use super::cost_args::CostArgs;
use super::lifecycle::Lifecycle;
use super::nats_args::NatsArgs;
use super::renamed_env;
use anyhow::Context;
use clap::Args;
use kvrouter_replica::{IndexFlags, Replica, ReplicaConfig, SyncConfig};
use kvrouter_scheduler::{QueuePolicy, RoutingPolicy, SchedulerConfig};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    nats: NatsArgs,
    #[command(flatten)]
    http: super::http_args::HttpArgs,
    #[command(flatten)]
    http_auth: super::http_args::HttpAuthArgs,
    #[command(flatten)]
    traces: super::traces_args::TracesArgs,
    /// Model to serve (repeat, or comma-separate in the environment variable).
    #[arg(
        long = "model",
        env = "KVROUTER_MODEL",
        value_delimiter = ',',
        required = true
    )]
    models: Vec<String>,
    /// Admin HTTP address for /healthz, /readyz and /metrics (e.g. 0.0.0.0:9090).
    #[arg(long, env = "KVROUTER_ADMIN_ADDR")]
    admin_addr: Option<SocketAddr>,
    /// Address of the JSON API for peer routers (POST /v1/route, /v1/requests/ID/free ...;
    /// see docs/protocol.md); without it the admin address serves the API.
    #[arg(long, env = "KVROUTER_HTTP_ADDR")]
    http_addr: Option<SocketAddr>,
    /// Block size of a model, MODEL=TOKENS (repeatable); otherwise the first worker's.
    #[arg(long = "block-size", env = renamed_env::env("KVROUTER_MODEL_BLOCK_SIZE"), value_delimiter = ',', value_parser = parse_block_size)]
    block_sizes: Vec<(String, u32)>,
    /// Seconds without a heartbeat after which a worker is removed.
    #[arg(long, env = "KVROUTER_WORKER_LEASE_SECS", default_value_t = 3.0)]
    worker_lease_secs: f64,
    /// Active requests never freed are dropped after this many seconds.
    #[arg(long, env = "KVROUTER_REQUEST_TIMEOUT_SECS", default_value_t = 300.0)]
    request_timeout_secs: f64,
    #[command(flatten)]
    cost: CostArgs,
    /// A worker rank is busy when its active blocks reach this fraction of its capacity.
    #[arg(long, env = "KVROUTER_BUSY_ACTIVE_BLOCKS_FRAC")]
    busy_active_blocks_frac: Option<f64>,
    /// A worker rank is busy when its in-flight prefill tokens reach this.
    #[arg(long, env = "KVROUTER_BUSY_PREFILL_TOKENS")]
    busy_prefill_tokens: Option<u64>,
    /// A worker rank is busy when its engine reports this many waiting requests (engines
    /// behind `kvrouter bridge` report them from their metrics).
    #[arg(long, env = "KVROUTER_BUSY_WAITING_REQUESTS")]
    busy_waiting_requests: Option<u64>,
    /// Requests that may wait for a non-busy worker; beyond it, routes fail as overloaded.
    #[arg(long, env = "KVROUTER_MAX_QUEUED_REQUESTS", default_value_t = 1024)]
    max_queued_requests: usize,
    /// How long a queued request may wait for a worker that is not busy before it fails
    /// with queue_timeout; keep it under the callers' route timeout (kvrouter-client: 2 s).
    #[arg(long, env = "KVROUTER_MAX_QUEUE_WAIT_MS", default_value_t = 1500)]
    max_queue_wait_ms: u64,
    /// The largest priority_jump a route gets, in seconds: a larger one counts as this much
    /// (clamped). Jumps that are negative, NaN or infinite are refused (invalid_request).
    #[arg(
        long,
        env = "KVROUTER_MAX_PRIORITY_JUMP_SECS",
        default_value_t = kvrouter_protocol::limits::DEFAULT_MAX_PRIORITY_JUMP_SECS
    )]
    max_priority_jump_secs: f64,
    /// Longest prompt accepted, in tokens (bounded by the NATS max payload).
    #[arg(long, env = "KVROUTER_MAX_PROMPT_TOKENS", default_value_t = 131_072)]
    max_prompt_tokens: usize,
    /// Index shard actors per model.
    #[arg(long, env = "KVROUTER_INDEX_SHARDS", default_value_t = 1)]
    index_shards: usize,
    /// This replica's id in route answers (default: a fresh uuid).
    #[arg(long, env = "KVROUTER_REPLICA_ID")]
    replica_id: Option<String>,
    /// Take no routes until this many workers of each model are known (or the timeout
    /// below passes, with a warning): the first routes of a fleet starting up are not all
    /// piled on its first worker. 0: no wait.
    #[arg(long, env = "KVROUTER_MIN_INITIAL_WORKERS", default_value_t = 0)]
    min_initial_workers: usize,
    /// How long --min-initial-workers waits at most.
    #[arg(
        long,
        env = "KVROUTER_MIN_INITIAL_WORKERS_TIMEOUT_SECS",
        default_value_t = 60.0
    )]
    min_initial_workers_timeout_secs: f64,
    /// How long a rank's state fetch may stay silent before it is retried.
    #[arg(long, env = "KVROUTER_STATE_FETCH_TIMEOUT_MS", default_value_t = 2000)]
    state_fetch_timeout_ms: u64,
    /// On SIGTERM or SIGINT, how long the whole shutdown may take (in-flight requests get all
    /// but the last 2 s, kept for the final bus work); past it the process exits with status 1.
    /// A second signal exits at once.
    #[arg(long, env = "KVROUTER_DRAIN_TIMEOUT_SECS", default_value_t = 10.0)]
    drain_timeout_secs: f64,
    /// How workers are chosen: kv (cached prefix and load), or a baseline for comparisons:
    /// round-robin, random, least-loaded.
    #[arg(long, env = "KVROUTER_POLICY", default_value = "kv")]
    policy: RoutingPolicy,
    /// In which order requests queued because every worker was busy are retried: fcfs
    /// (first come, first served) or wspt (fewest uncached prompt tokens first).
    #[arg(long, env = "KVROUTER_QUEUE_POLICY", default_value = "fcfs")]
    queue_policy: QueuePolicy,
    /// Share active-sequence changes with the other replicas (and apply theirs), so every
    /// replica routes on the whole fleet's load; a late replica catches up from a peer.
    #[arg(long, env = "KVROUTER_REPLICA_SYNC")]
    replica_sync: bool,
    /// Replica sync: for this long after each decision, the picks the live peers would make
    /// for a like request at the same moment count as load, so replicas routing one burst
    /// spread it instead of piling onto the same workers (0: off).
    #[arg(long, env = "KVROUTER_REPLICA_SYNC_ECHO_MS", default_value_t = 1.0)]
    replica_sync_echo_ms: f64,
    /// Approximate mode: consume no KV events and fetch no worker state; a routed request's
    /// blocks count as cached on the chosen worker rank until --router-ttl-secs pass.
    #[arg(long, env = "KVROUTER_NO_KV_EVENTS")]
    no_kv_events: bool,
    /// Approximate mode, and a rank flagged silent (--events-silent-secs): how long a routed
    /// request's blocks count as cached on its worker rank.
    #[arg(long, env = "KVROUTER_ROUTER_TTL_SECS", default_value_t = 120.0)]
    router_ttl_secs: f64,
    /// Answer other replicas' overlap queries from this replica's index (per model, once every
    /// known worker rank is synced); with --no-kv-events, record the decisions they publish.
    #[arg(long, env = "KVROUTER_SERVE_INDEXER")]
    serve_indexer: bool,
    /// Keep no index and consume no KV events: ask a serving indexer (--serve-indexer) for
    /// each request's overlaps; when none answers in time, route on load alone.
    #[arg(long, env = "KVROUTER_USE_REMOTE_INDEXER")]
    use_remote_indexer: bool,
    /// How long a route waits for a serving indexer before routing on load alone.
    #[arg(long, env = "KVROUTER_REMOTE_INDEXER_TIMEOUT_MS", default_value_t = 50)]
    remote_indexer_timeout_ms: u64,
    /// Disaggregated requests: seconds a KV transfer may wait for every tp rank's report
    /// before it is logged and counted as overdue (kvrouter_transfers_overdue_total).
    #[arg(long, env = "KVROUTER_TRANSFER_TIMEOUT_SECS", default_value_t = 10.0)]
    transfer_timeout_secs: f64,
    /// Book routes that come without a lease (callers built before leases, format 5, know
    /// none) and let any caller end them: only while such callers are being replaced.
    #[arg(long, env = "KVROUTER_ALLOW_UNLEASED")]
    allow_unleased: bool,
    /// A worker rank sent (booked) prompts of a full block or more (at least 3) for this many seconds
    /// without one KV event from it is flagged silent: a warning naming the likely causes,
    /// kvrouter_worker_events_silent, `events_silent` in /v1/workers; until its events flow
    /// again its booked routes' blocks count as cached on it for --router-ttl-secs. 0: never.
    #[arg(long, env = "KVROUTER_EVENTS_SILENT_SECS", default_value_t = 60)]
    events_silent_secs: u64,
    /// Remote lookups timing out in a row (a hung serving indexer) after which routes skip
    /// them (overlap 0) until a probe is answered; 0 turns this breaker off.
    #[arg(
        long,
        env = "KVROUTER_REMOTE_INDEXER_BREAKER_FAILURES",
        default_value_t = 3
    )]
    remote_indexer_breaker_failures: u32,
    /// How long routes skip remote lookups once the breaker opens, before one probe; each
    /// failed probe doubles it, up to four times this.
    #[arg(
        long,
        env = "KVROUTER_REMOTE_INDEXER_BREAKER_COOLDOWN_MS",
        default_value_t = 1000
    )]
    remote_indexer_breaker_cooldown_ms: u64,
    /// Seed of the scheduler's tie-breaks and sampling.
    #[arg(long, env = "KVROUTER_SEED")]
    seed: Option<u64>,
}

fn parse_block_size(s: &str) -> Result<(String, u32), String> {
    let (model, size) = s
        .rsplit_once('=')
        .ok_or_else(|| format!("{s:?}: expected MODEL=TOKENS, e.g. Qwen/Qwen3-0.6B=16"))?;
    let size: u32 = size
        .parse()
        .map_err(|e| format!("{s:?}: block size {size:?} is not a number: {e}"))?;
    if model.is_empty() || size == 0 {
        return Err(format!("{s:?}: expected MODEL=TOKENS with TOKENS > 0"));
    }
    Ok((model.to_string(), size))
}

pub fn secs(name: &str, v: f64) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(v).with_context(|| format!("--{name} {v} is not a valid duration"))
}

pub fn millis(name: &str, v: f64) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(v / 1000.0)
        .with_context(|| format!("--{name} {v} is not a valid duration"))
}

impl ServeArgs {
    fn config(&self) -> anyhow::Result<ReplicaConfig> {
        let scheduler = self.cost.apply(SchedulerConfig {
            busy_active_blocks_frac: self.busy_active_blocks_frac,
            busy_prefill_tokens: self.busy_prefill_tokens,
            busy_waiting_requests: self.busy_waiting_requests,
            max_queued_requests: self.max_queued_requests,
            request_timeout: secs("request-timeout-secs", self.request_timeout_secs)?,
            queue_timeout: Duration::from_millis(self.max_queue_wait_ms),
            seed: self.seed.unwrap_or_else(fastrand_seed),
            policy: self.policy,
            queue_policy: self.queue_policy,
            max_priority_jump: self.max_priority_jump_secs,
            ..SchedulerConfig::default()
        });
        let block_sizes: HashMap<String, u32> = self.block_sizes.iter().cloned().collect();
        let index = IndexFlags {
            no_kv_events: self.no_kv_events,
            router_ttl: secs("router-ttl-secs", self.router_ttl_secs)?,
            serve_indexer: self.serve_indexer,
            use_remote_indexer: self.use_remote_indexer,
            remote_timeout: Duration::from_millis(self.remote_indexer_timeout_ms),
            breaker_failures: self.remote_indexer_breaker_failures,
            breaker_cooldown: Duration::from_millis(self.remote_indexer_breaker_cooldown_ms),
        }
        .source()?;
        Ok(ReplicaConfig {
            namespace: self.nats.namespace.clone(),
            replica_id: self.replica_id.clone(),
            models: self.models.clone(),
            block_sizes,
            worker_lease: secs("worker-lease-secs", self.worker_lease_secs)?,
            state_fetch_timeout: Duration::from_millis(self.state_fetch_timeout_ms),
            min_initial_workers: self.min_initial_workers,
            min_initial_workers_timeout: secs(
                "min-initial-workers-timeout-secs",
                self.min_initial_workers_timeout_secs,
            )?,
            max_prompt_tokens: self.max_prompt_tokens,
            scheduler,
            index_shards: self.index_shards,
            drain_timeout: secs("drain-timeout-secs", self.drain_timeout_secs)?,
            admin_addr: self.admin_addr,
            http_limits: kvrouter_admin::HttpLimits {
                auth: self.http_auth.auth(&self.http)?,
                ..self.http.limits()?
            },
            http_addr: self.http_addr,
            index,
            sync: self
                .replica_sync
                .then(|| -> anyhow::Result<SyncConfig> {
                    Ok(SyncConfig {
                        echo: millis("replica-sync-echo-ms", self.replica_sync_echo_ms)?,
                    })
                })
                .transpose()?,
            transfer_timeout: secs("transfer-timeout-secs", self.transfer_timeout_secs)?,
            allow_unleased: self.allow_unleased,
            traces: self.traces.config(),
            events_silent_after: Duration::from_secs(self.events_silent_secs),
            silent_rank_ttl: secs("router-ttl-secs", self.router_ttl_secs)?,
            ..ReplicaConfig::default()
        })
    }
}

fn fastrand_seed() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::process::id())
}

pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    renamed_env::log_warnings();
    let mut config = args.config()?;
    config.validate()?;
    let doors: Vec<SocketAddr> = config
        .admin_addr
        .into_iter()
        .chain(config.http_addr)
        .collect();
    super::http_args::log_doors(&config.http_limits.auth, &args.http, &doors);
    let mut life = Lifecycle::install("serve", config.drain_timeout)?;
    // The replica drains in-flight requests for what is left once the final bus work is
    // set aside, so the whole shutdown fits --drain-timeout-secs.
    config.drain_timeout = life.drain_budget();
    let (replica, bus) = life
        .startup(async {
            let bus = args.nats.connect("kvrouter-serve").await?;
            let replica = Replica::start(config, bus.clone())
                .await
                .context("cannot start the replica")?;
            anyhow::Ok((replica, bus))
        })
        .await?;
    life.wait().await;
    let what = || {
        let nats = if bus.is_connected() {
            "connected"
        } else {
            "disconnected, so the final flush cannot complete"
        };
        format!("draining in-flight requests and stopping the replica (NATS {nats})")
    };
    life.shutdown(what, async {
        replica.shutdown().await;
        if !bus.is_connected() {
            tracing::warn!(
                "NATS was down during the shutdown: the replica's last messages (answers, \
                 sync updates) may not have reached it"
            );
        }
        Ok(())
    })
    .await
}

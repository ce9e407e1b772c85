//! Replays requests through real router replicas and a mocker fleet on a bus.
//!
//! Everything runs through the production code paths: `MockerFleet` workers publish KV
//! events and load, `Replica`s route, and each request is sent the way a frontend sends it
//! (`KvRouterClient::generate`: route, run on the chosen rank, mark_prefill, free).
//!
//! On the in-process bus, run this inside a current-thread tokio runtime whose clock is
//! paused ([`virtual_runtime`]): time then advances only when every task waits, so the
//! replay takes as long as its CPU work, simulated latencies are exact, and a fixed seed
//! gives the same run every time. Over NATS the clock is real and `speedup` scales
//! simulated time against it.

use crate::requests::ReplayRequest;
use crate::{ClusterCounters, LoadSample, RequestResult, RunOutcome};
use kvrouter_bus::{Bus, NatsOptions};
use kvrouter_client::{GenerateParams, KvRouterClient};
use kvrouter_mocker::{EngineConfig, FleetConfig, MockerFleet};
use kvrouter_protocol::{decode, LoadReport, Subjects, WorkerKey, WorkerSubject};
use kvrouter_replica::{IndexSource, Replica, ReplicaConfig, SyncConfig};
use kvrouter_scheduler::{RoutingPolicy, SchedulerConfig};
use rustc_hash::FxHashMap;
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;
use tokio::time::Instant;

/// The model name the replayed fleet serves.
pub const REPLAY_MODEL: &str = "replay";

/// Fleet and router set-up shared by every run.
#[derive(Clone, Debug)]
pub struct ReplayConfig {
    pub workers: u32,
    pub dp_size: u32,
    pub block_size: usize,
    /// KV capacity of each rank, in blocks.
    pub capacity_blocks: usize,
    /// Host-memory and disk tiers of each rank, in blocks (0: none).
    pub host_capacity_blocks: usize,
    pub disk_capacity_blocks: usize,
    /// Simulated time per wall second (NATS only; the in-process replay runs on a virtual
    /// clock).
    pub speedup: f64,
    pub replicas: usize,
    /// `None`: the in-process bus.
    pub nats: Option<NatsOptions>,
    pub seed: u64,
    /// How often the workers' active blocks are sampled (simulated time).
    pub sample_every: Duration,
    /// The replicas' scheduling parameters (policy and seed are set per run).
    pub scheduler: SchedulerConfig,
    /// Replicas share their active sequences (`--replica-sync`).
    pub replica_sync: bool,
    /// Replica sync's peer-echo window (`--replica-sync-echo-ms`).
    pub replica_sync_echo: Duration,
    /// Each replica's index as `kvrouter serve` takes it: replica i runs `indexes[i]`
    /// (KV events or approximate mode, serving or not, or remote). Empty: every replica
    /// keeps its own index fed by KV events.
    pub indexes: Vec<IndexSource>,
    /// Each route carries the trace's output length as `expected_output_tokens`, so the
    /// router counts a request's whole decode from the start (`--expected-output`).
    pub expected_output: bool,
}

impl Default for ReplayConfig {
    fn default() -> Self {
        Self {
            workers: 8,
            dp_size: 1,
            block_size: 64,
            capacity_blocks: 8192,
            host_capacity_blocks: 0,
            disk_capacity_blocks: 0,
            speedup: 1.0,
            replicas: 2,
            nats: None,
            seed: 1,
            sample_every: Duration::from_millis(250),
            scheduler: SchedulerConfig::default(),
            replica_sync: false,
            replica_sync_echo: kvrouter_replica::DEFAULT_SYNC_ECHO,
            indexes: Vec::new(),
            expected_output: false,
        }
    }
}

impl ReplayConfig {
    /// Blocks the whole fleet can cache (the pooled ideal's capacity).
    pub fn fleet_capacity_blocks(&self) -> usize {
        self.capacity_blocks * self.workers as usize * self.dp_size as usize
    }

    /// Replica `i`'s index.
    pub fn index_of(&self, i: usize) -> IndexSource {
        self.indexes
            .get(i)
            .cloned()
            .unwrap_or(IndexSource::Events { serve: false })
    }

    /// How many replicas serve their index to the others.
    pub fn serving_indexers(&self) -> usize {
        self.indexes.iter().filter(|s| s.serves()).count()
    }

    /// Approximate mode: route decisions, not KV events, feed the indexes.
    pub fn approximate(&self) -> bool {
        self.indexes.iter().any(IndexSource::approximate)
    }

    pub fn validate(&self) -> Result<(), RunError> {
        let bad = |m: String| Err(RunError::Config(m));
        if self.workers == 0 || self.dp_size == 0 || self.replicas == 0 {
            return bad("workers, dp size and replicas must be at least 1".into());
        }
        if self.block_size == 0 || 512 % self.block_size != 0 {
            return bad(format!(
                "block size {} must divide 512 (a trace hash id stands for 512 tokens)",
                self.block_size
            ));
        }
        if !self.indexes.is_empty() && self.indexes.len() != self.replicas {
            return bad(format!(
                "{} index set-ups given for {} replicas",
                self.indexes.len(),
                self.replicas
            ));
        }
        if self.indexes.iter().any(|s| !s.keeps_index()) && self.serving_indexers() == 0 {
            return bad("remote indexers need a replica that serves its index".into());
        }
        if self.capacity_blocks == 0 {
            return bad("capacity must be at least 1 block".into());
        }
        if !(self.speedup.is_finite() && self.speedup > 0.0) {
            return bad(format!("speedup must be positive, got {}", self.speedup));
        }
        Ok(())
    }
}

#[derive(Debug, Error)]
pub enum RunError {
    #[error("invalid replay settings: {0}")]
    Config(String),
    #[error("cannot connect to NATS: {0}")]
    Bus(#[from] kvrouter_bus::BusError),
    #[error("cannot start the mocker fleet: {0}")]
    Fleet(String),
    #[error("cannot start a router replica: {0}")]
    Replica(String),
    #[error("the router replicas did not see every worker rank within {0:?}")]
    NotReady(Duration),
}

/// A current-thread runtime with a paused clock, for in-process replays.
pub fn virtual_runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
}

fn sim_us(wall: Duration, speedup: f64) -> u64 {
    (wall.as_secs_f64() * speedup * 1e6) as u64
}

/// Replays `requests` with one policy; `progress` is called after each request finishes.
pub async fn run_policy(
    config: &ReplayConfig,
    policy: RoutingPolicy,
    rate_scale: f64,
    requests: &[ReplayRequest],
    progress: &(dyn Fn(usize) + Sync),
) -> Result<RunOutcome, RunError> {
    config.validate()?;
    // Over NATS every run gets its own namespace, so nothing of an earlier run interferes.
    let (bus, namespace, speedup) = match &config.nats {
        None => (Bus::local(), "replay".to_string(), 1.0),
        Some(opts) => (
            Bus::connect(opts).await?,
            format!("replay-{}", uuid_like(config.seed, policy, rate_scale)),
            config.speedup,
        ),
    };
    let fleet = MockerFleet::start(
        bus.clone(),
        FleetConfig {
            namespace: namespace.clone(),
            model: REPLAY_MODEL.into(),
            workers: config.workers,
            worker_id_start: 1,
            dp_size: config.dp_size,
            engine: EngineConfig {
                block_size: config.block_size,
                capacity_blocks: config.capacity_blocks,
                host_capacity_blocks: config.host_capacity_blocks,
                disk_capacity_blocks: config.disk_capacity_blocks,
                ..EngineConfig::default()
            },
            speedup,
            ..FleetConfig::default()
        },
    )
    .await
    .map_err(|e| RunError::Fleet(e.to_string()))?;
    let mut replicas = Vec::with_capacity(config.replicas);
    for i in 0..config.replicas {
        let replica = Replica::start(
            ReplicaConfig {
                namespace: namespace.clone(),
                replica_id: Some(format!("replica-{i}")),
                models: vec![REPLAY_MODEL.into()],
                // No failures are simulated; a long lease keeps a busy machine from expiring
                // workers whose heartbeats are merely late.
                worker_lease: Duration::from_secs(60),
                scheduler: SchedulerConfig {
                    policy,
                    seed: config.seed.wrapping_add(i as u64),
                    ..config.scheduler.clone()
                },
                discovery_window: Duration::from_millis(100),
                // Every prompt the bus can carry (the traces hold prompts over 128k tokens).
                max_prompt_tokens: kvrouter_protocol::max_prompt_tokens_for(bus.max_payload()),
                index: config.index_of(i),
                sync: config.replica_sync.then_some(SyncConfig {
                    echo: config.replica_sync_echo,
                }),
                ..ReplicaConfig::default()
            },
            bus.clone(),
        )
        .await
        .map_err(|e| RunError::Replica(e.to_string()))?;
        replicas.push(replica);
    }
    let ranks = (config.workers * config.dp_size) as usize;
    let ready_within = Duration::from_secs(30);
    let deadline = Instant::now() + ready_within;
    for r in &replicas {
        loop {
            let m = &r.shared().models[REPLAY_MODEL].status;
            if r.is_ready() && m.ranks.load(std::sync::atomic::Ordering::Relaxed) == ranks {
                break;
            }
            if Instant::now() > deadline {
                return Err(RunError::NotReady(ready_within));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    // Load sampling: the latest report of every rank, read every `sample_every`.
    let subjects = Subjects::new(&namespace)
        .and_then(|s| s.model(REPLAY_MODEL))
        .map_err(|e| RunError::Config(e.to_string()))?;
    if config.serving_indexers() > 0 {
        // A serving indexer subscribes a moment after it turns ready: wait until one answers,
        // so no remote replica routes the first requests on load alone.
        let probe = kvrouter_protocol::encode(&kvrouter_protocol::IndexerQuery {
            block_size: config.block_size as u32,
            local_hashes: Vec::new(),
        })
        .map_err(|e| RunError::Config(e.to_string()))?;
        let subject = subjects.indexer_find_matches();
        while bus
            .request(&subject, probe.clone().into(), Duration::from_secs(1))
            .await
            .is_err()
        {
            if Instant::now() > deadline {
                return Err(RunError::NotReady(ready_within));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let mut load_sub = bus
        .subscribe(&subjects.every_worker(WorkerSubject::Load))
        .await?;
    let loads: Arc<parking_lot::Mutex<FxHashMap<WorkerKey, u64>>> = Arc::default();
    let loads_w = loads.clone();
    let load_task = tokio::spawn(async move {
        while let Some(msg) = load_sub.next().await {
            if let Ok(report) = decode::<LoadReport>(&msg.payload) {
                let mut l = loads_w.lock();
                for r in report.ranks {
                    l.insert(WorkerKey::new(report.worker_id, r.dp_rank), r.active_blocks);
                }
            }
        }
    });

    let client = KvRouterClient::new(bus.clone(), &namespace)
        .map_err(|e| RunError::Config(e.to_string()))?
        .with_timeout(Duration::from_secs(600))
        .with_generate_idle_timeout(Duration::from_secs(3600));
    let start = Instant::now();
    let sample_every = config.sample_every.div_f64(speedup);
    let samples: Arc<parking_lot::Mutex<Vec<LoadSample>>> = Arc::default();
    let sampler = {
        let (loads, samples) = (loads.clone(), samples.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(sample_every);
            loop {
                tick.tick().await;
                let mut active: Vec<(WorkerKey, u64)> =
                    loads.lock().iter().map(|(k, v)| (*k, *v)).collect();
                active.sort_unstable();
                samples.lock().push(LoadSample {
                    at_us: sim_us(start.elapsed(), speedup),
                    active_blocks: active.into_iter().map(|(_, v)| v).collect(),
                });
            }
        })
    };

    let real_clock = config.nats.is_some();
    let mut tasks = Vec::with_capacity(requests.len());
    for req in requests {
        let at = start + req.arrival.div_f64(speedup);
        tokio::time::sleep_until(at).await;
        let client = client.clone();
        let params = GenerateParams {
            request_id: Some(format!("r{}", req.index)),
            expected_output_tokens: config.expected_output.then_some(req.output_tokens),
            ..GenerateParams::new(REPLAY_MODEL, req.tokens.clone(), req.output_tokens)
        };
        let (index, arrival_us) = (req.index, req.arrival.as_micros() as u64);
        tasks.push(tokio::spawn(async move {
            let result = client.generate(&params).await;
            let done_us = sim_us(start.elapsed(), speedup);
            match result {
                Ok(o) => RequestResult {
                    index,
                    arrival_us,
                    done_us,
                    worker_id: o.decision.worker_id,
                    dp_rank: o.decision.dp_rank,
                    overlap_blocks: o.decision.overlap_blocks,
                    cached_blocks: o.cached_blocks,
                    host_blocks: o.tier_cached_blocks.host,
                    disk_blocks: o.tier_cached_blocks.disk,
                    prompt_blocks: o.prompt_blocks,
                    ttft_us: o.ttft_us,
                    itl_mean_us: o.mean_itl_us().unwrap_or(0.0),
                    e2e_us: o.e2e_us,
                    output_tokens: o.output_tokens,
                    route_wall_us: if real_clock { o.route_wall_us } else { 0 },
                    error: None,
                },
                Err(e) => RequestResult {
                    index,
                    arrival_us,
                    done_us,
                    error: Some(e.to_string()),
                    ..RequestResult::default()
                },
            }
        }));
    }
    let mut results = Vec::with_capacity(tasks.len());
    for t in tasks {
        match t.await {
            Ok(r) => results.push(r),
            Err(e) => results.push(RequestResult {
                error: Some(format!("replay task failed: {e}")),
                ..RequestResult::default()
            }),
        }
        progress(results.len());
    }
    let duration_us = sim_us(start.elapsed(), speedup);
    sampler.abort();
    load_task.abort();
    let samples = std::mem::take(&mut *samples.lock());
    let cluster = cluster_counters(&replicas);
    for r in replicas {
        r.shutdown().await;
    }
    let _ = fleet.shutdown().await;
    results.sort_by_key(|r| r.index);
    Ok(RunOutcome {
        policy: policy.as_str().to_string(),
        rate_scale,
        results,
        samples,
        duration_us,
        cluster,
        real_clock,
    })
}

fn cluster_counters(replicas: &[Replica]) -> ClusterCounters {
    let labels = kvrouter_replica::metrics::Metrics::model(REPLAY_MODEL);
    let mut c = ClusterCounters::default();
    for r in replicas {
        let m = &r.shared().metrics;
        let events = m.events_applied.get_or_create(&labels).get();
        c.kv_events_applied += events;
        c.replicas_applying_events += usize::from(events > 0);
        c.approx_records += m.approx_records.get_or_create(&labels).get();
        c.remote_lookups += m.remote_indexer_queries.get_or_create(&labels).get();
        c.remote_fallbacks += m.remote_indexer_fallbacks.get_or_create(&labels).get();
        c.sync_peers += m.sync_peers.get_or_create(&labels).get().max(0) as u64;
    }
    c
}

fn uuid_like(seed: u64, policy: RoutingPolicy, rate: f64) -> String {
    format!(
        "{seed:x}-{}-{}-{}",
        policy.as_str(),
        (rate * 1000.0) as u64,
        std::process::id()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrouter_replica::RemoteIndex;

    #[test]
    fn each_replica_runs_its_own_index_set_up() {
        let mut c = ReplayConfig {
            replicas: 3,
            ..ReplayConfig::default()
        };
        assert_eq!(c.index_of(2), IndexSource::Events { serve: false });
        assert_eq!((c.serving_indexers(), c.approximate()), (0, false));
        c.validate().unwrap();

        let remote = IndexSource::Remote(RemoteIndex::default());
        c.indexes = vec![remote.clone(), remote.clone(), remote.clone()];
        assert!(matches!(c.validate(), Err(RunError::Config(m)) if m.contains("serves")));
        c.indexes[0] = IndexSource::Events { serve: true };
        c.validate().unwrap();
        assert_eq!((c.serving_indexers(), c.index_of(1)), (1, remote));

        c.indexes.pop();
        assert!(matches!(c.validate(), Err(RunError::Config(m)) if m.contains("2 index set-ups")));
        c.indexes = vec![
            IndexSource::Approx {
                ttl: Duration::from_secs(1),
                serve: false,
            };
            3
        ];
        assert!(c.approximate());
    }
}

//! Starting, wiring and stopping a replica: actors per model, bus subscriptions, admin HTTP.

use crate::admin;
use crate::approx::DecisionRecorder;
use crate::breaker::BreakerConfig;
use crate::endpoints::{spawn_handler, Endpoint, InFlight};
use crate::fleet::{ask_who_is_there, FleetActor, FleetArgs, FleetMsg};
use crate::metrics::Metrics;
use crate::remote_indexer::{DecisionPublisher, RemoteIndexer};
use crate::route_gate::RouteGate;
use crate::scheduler_actor::{SchedulerActor, SchedulerArgs, SchedulerMsg, SyncLink};
use crate::served_indexer;
use crate::state::{ModelShared, ModelStatus, ReplicaShared};
use crate::sync_bus;
use kvrouter_bus::{Bus, BusError, Subscription};
use kvrouter_indexer::{ApproxConfig, RankDump, ShardedIndex, ShardedIndexConfig};
use kvrouter_protocol::Wire;
use kvrouter_protocol::{
    decode, Deregistration, Heartbeat, KvEventBatch, LoadReport, Registration, SubjectError,
    Subjects, WorkerKey,
};
use kvrouter_scheduler::SchedulerConfig;
use ractor::{Actor, ActorRef};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use thiserror::Error;
use tokio::task::JoinHandle;

/// Everything `kvrouter serve` configures.
#[derive(Clone, Debug)]
pub struct ReplicaConfig {
    pub namespace: String,
    /// Defaults to a fresh uuid.
    pub replica_id: Option<String>,
    pub models: Vec<String>,
    /// Block size per model, when not taken from the first worker.
    pub block_sizes: HashMap<String, u32>,
    /// A worker that sends nothing for this long is removed.
    pub worker_lease: Duration,
    /// How long a rank's state fetch may stay silent before it is retried.
    pub state_fetch_timeout: Duration,
    pub max_prompt_tokens: usize,
    /// Scheduling parameters (the block size is set per model).
    pub scheduler: SchedulerConfig,
    pub index_shards: usize,
    /// Time the first "who is there" gets before the replica may turn ready.
    pub discovery_window: Duration,
    /// How long shutdown waits for in-flight requests.
    pub drain_timeout: Duration,
    pub admin_addr: Option<SocketAddr>,
    /// Approximate mode: subscribe to no KV events and fetch no worker state; the index is
    /// fed by this replica's own route decisions, each expiring after `router_ttl`.
    pub no_kv_events: bool,
    /// Lifetime of a route decision's blocks in approximate mode.
    pub router_ttl: Duration,
    /// Share active-sequence changes with peer replicas and apply theirs, so every replica
    /// routes on the whole fleet's load.
    pub replica_sync: bool,
    /// Replica sync: how long this replica's guesses of its peers' simultaneous decisions
    /// count as load (the scheduler's peer echo; zero turns it off). About the time a
    /// decision takes to reach the peers.
    pub replica_sync_echo: Duration,
    /// Answer other replicas' overlap queries from this replica's index (`--serve-indexer`).
    pub serve_indexer: bool,
    /// Keep no index: ask a serving indexer for each request's overlaps, routing on load alone
    /// when none answers within `remote_indexer_timeout` (`--use-remote-indexer`).
    pub use_remote_indexer: bool,
    pub remote_indexer_timeout: Duration,
    /// How long a disaggregated request may wait for its KV transfer reports before it is
    /// logged and counted as overdue (`--transfer-timeout-secs`).
    pub transfer_timeout: Duration,
    /// Consecutive remote lookup failures that open the breaker (0: never open it).
    pub remote_indexer_breaker_failures: u32,
    /// How long an open breaker skips remote lookups before probing (doubled by each failed
    /// probe, up to four times this).
    pub remote_indexer_breaker_cooldown: Duration,
}

/// Longest `router_ttl` accepted: deadlines are `now + ttl`, and no cache keeps a block longer.
pub const MAX_ROUTER_TTL: Duration = Duration::from_secs(24 * 3600);

/// Default of [`ReplicaConfig::replica_sync_echo`]: several NATS hops on a LAN (about
/// 0.1 ms each); measured best of 1, 2 and 5 ms in the bursty replay (docs/benchmarks.md).
pub const DEFAULT_SYNC_ECHO: Duration = Duration::from_millis(1);

impl Default for ReplicaConfig {
    fn default() -> Self {
        Self {
            namespace: "kvrouter".into(),
            replica_id: None,
            models: Vec::new(),
            block_sizes: HashMap::new(),
            worker_lease: Duration::from_secs(3),
            state_fetch_timeout: Duration::from_secs(2),
            max_prompt_tokens: 131_072,
            scheduler: SchedulerConfig::default(),
            index_shards: 1,
            discovery_window: Duration::from_millis(500),
            drain_timeout: Duration::from_secs(10),
            admin_addr: None,
            replica_sync: false,
            replica_sync_echo: DEFAULT_SYNC_ECHO,
            no_kv_events: false,
            router_ttl: kvrouter_indexer::approx::DEFAULT_TTL,
            serve_indexer: false,
            use_remote_indexer: false,
            remote_indexer_timeout: crate::remote_indexer::DEFAULT_TIMEOUT,
            transfer_timeout: crate::disagg::TRANSFER_TIMEOUT,
            remote_indexer_breaker_failures: crate::breaker::DEFAULT_FAILURES,
            remote_indexer_breaker_cooldown: crate::breaker::DEFAULT_COOLDOWN,
        }
    }
}

#[derive(Debug, Error)]
pub enum ReplicaError {
    #[error("no model to serve: give at least one --model")]
    NoModels,
    #[error("model {0:?} is given twice")]
    DuplicateModel(String),
    #[error("--block-size names model {0:?}, which is not served (add --model {0})")]
    BlockSizeForUnknownModel(String),
    #[error("invalid block size 0 for model {0:?}")]
    ZeroBlockSize(String),
    #[error("--max-prompt-tokens {tokens} does not fit the bus's {max_payload}-byte message limit: use at most {fits}")]
    PromptLimitTooLarge {
        tokens: usize,
        max_payload: usize,
        fits: usize,
    },
    #[error("--router-ttl-secs must be above 0 (it is how long a routed request's blocks count as cached)")]
    ZeroRouterTtl,
    #[error("--router-ttl-secs must be at most {} (a day; engines evict long before)", MAX_ROUTER_TTL.as_secs())]
    RouterTtlTooLong,
    #[error("--transfer-timeout-secs must be above 0 (it is how long a KV transfer may take before it is reported overdue)")]
    ZeroTransferTimeout,
    #[error("--serve-indexer and --use-remote-indexer cannot be combined: a replica either serves its index or asks another replica's")]
    ServeAndUseRemoteIndexer,
    #[error("--serve-indexer with --overlap-credit 0: a serving indexer exists to share overlaps, which this replica would ignore (give --overlap-credit above 0)")]
    ServeIndexerWithoutOverlap,
    #[error("--remote-indexer-timeout-ms must be above 0 (it is how long a route waits for a serving indexer)")]
    ZeroRemoteIndexerTimeout,
    #[error("--remote-indexer-breaker-cooldown-ms must be above 0 (give --remote-indexer-breaker-failures 0 to turn the breaker off)")]
    ZeroBreakerCooldown,
    #[error("invalid replica id {0:?}: use letters, digits, '-' and '_'")]
    ReplicaId(String),
    #[error(transparent)]
    Subject(#[from] SubjectError),
    #[error("invalid scheduler settings: {0}")]
    Scheduler(String),
    #[error("cannot start the {what}: {reason}")]
    Start { what: String, reason: String },
    #[error("cannot subscribe to {subject}: {source}")]
    Subscribe { subject: String, source: BusError },
    #[error("cannot bind the admin address {addr}: {source}")]
    Admin {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

struct ModelRuntime {
    name: String,
    index: Arc<ShardedIndex>,
    scheduler: ActorRef<SchedulerMsg>,
    fleet: ActorRef<FleetMsg>,
    handles: Vec<JoinHandle<()>>,
}

/// A running replica.
pub struct Replica {
    shared: Arc<ReplicaShared>,
    inflight: Arc<InFlight>,
    /// Route, overlap and potential-load loops: stopped first on shutdown.
    front: Vec<JoinHandle<()>>,
    /// Everything else (events, discovery, mark_prefill/free, admin).
    back: Vec<JoinHandle<()>>,
    models: Vec<ModelRuntime>,
    admin_addr: Option<SocketAddr>,
    drain_timeout: Duration,
}

fn start_err(what: impl Into<String>, e: impl std::fmt::Display) -> ReplicaError {
    ReplicaError::Start {
        what: what.into(),
        reason: e.to_string(),
    }
}

/// Subscribes (in a queue group when given), naming the subject in the error.
pub(crate) async fn subscribe(
    bus: &Bus,
    subject: String,
    group: Option<&str>,
) -> Result<Subscription, ReplicaError> {
    let r = match group {
        Some(g) => bus.queue_subscribe(&subject, g).await,
        None => bus.subscribe(&subject).await,
    };
    r.map_err(|source| ReplicaError::Subscribe { subject, source })
}

/// Decodes every message of a subscription and hands it on; undecodable ones are logged
/// (at most every 10 s per subject) and dropped.
fn forward<T: Wire + Send + 'static>(
    mut sub: Subscription,
    what: &'static str,
    mut to: impl FnMut(T) + Send + 'static,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut dropped = 0u64;
        let mut last_warn: Option<Instant> = None;
        while let Some(msg) = sub.next().await {
            match decode::<T>(&msg.payload) {
                Ok(v) => to(v),
                Err(e) => {
                    dropped += 1;
                    if last_warn.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                        tracing::warn!(subject = %msg.subject, error = %e, dropped, "undecodable {what} dropped");
                        last_warn = Some(Instant::now());
                    }
                }
            }
        }
    })
}

fn valid_replica_id(id: &str) -> bool {
    !id.is_empty()
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

impl ReplicaConfig {
    /// Every check that needs no bus: `kvrouter serve` runs it before connecting, so a bad
    /// flag is refused at once whether or not NATS is reachable.
    pub fn validate(&self) -> Result<(), ReplicaError> {
        let subjects = Subjects::new(&self.namespace)?;
        if self.models.is_empty() {
            return Err(ReplicaError::NoModels);
        }
        for (i, m) in self.models.iter().enumerate() {
            if self.models[..i].contains(m) {
                return Err(ReplicaError::DuplicateModel(m.clone()));
            }
            subjects.model(m)?;
        }
        for (m, &b) in &self.block_sizes {
            if !self.models.contains(m) {
                return Err(ReplicaError::BlockSizeForUnknownModel(m.clone()));
            }
            if b == 0 {
                return Err(ReplicaError::ZeroBlockSize(m.clone()));
            }
        }
        if self.no_kv_events && self.router_ttl.is_zero() {
            return Err(ReplicaError::ZeroRouterTtl);
        }
        if self.router_ttl > MAX_ROUTER_TTL {
            return Err(ReplicaError::RouterTtlTooLong);
        }
        if self.transfer_timeout.is_zero() {
            return Err(ReplicaError::ZeroTransferTimeout);
        }
        if self.serve_indexer && self.use_remote_indexer {
            return Err(ReplicaError::ServeAndUseRemoteIndexer);
        }
        if self.serve_indexer && self.scheduler.overlap_credit == 0.0 {
            return Err(ReplicaError::ServeIndexerWithoutOverlap);
        }
        if self.use_remote_indexer && self.remote_indexer_timeout.is_zero() {
            return Err(ReplicaError::ZeroRemoteIndexerTimeout);
        }
        if self.use_remote_indexer
            && self.remote_indexer_breaker_failures > 0
            && self.remote_indexer_breaker_cooldown.is_zero()
        {
            return Err(ReplicaError::ZeroBreakerCooldown);
        }
        self.scheduler
            .validate()
            .map_err(|e| ReplicaError::Scheduler(e.to_string()))?;
        if let Some(id) = &self.replica_id {
            if !valid_replica_id(id) {
                return Err(ReplicaError::ReplicaId(id.clone()));
            }
        }
        Ok(())
    }
}

impl Replica {
    pub async fn start(config: ReplicaConfig, bus: Bus) -> Result<Self, ReplicaError> {
        config.validate()?;
        let subjects = Subjects::new(&config.namespace)?;
        let fits = kvrouter_protocol::max_prompt_tokens_for(bus.max_payload());
        if config.max_prompt_tokens > fits {
            return Err(ReplicaError::PromptLimitTooLarge {
                tokens: config.max_prompt_tokens,
                max_payload: bus.max_payload(),
                fits,
            });
        }
        let replica_id = config
            .replica_id
            .clone()
            .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string());

        let metrics = Arc::new(Metrics::new());
        let mut sync_tasks = Vec::new();
        let mut models = Vec::new();
        let mut shared_models = HashMap::new();
        for (i, name) in config.models.iter().enumerate() {
            let model_subjects = subjects.model(name)?;
            let status = Arc::new(ModelStatus::default());
            let block_size = config.block_sizes.get(name).copied();
            if let Some(b) = block_size {
                status.block_size.store(b, Ordering::Relaxed);
            }
            let mut sched_config = config.scheduler.clone();
            sched_config.block_size = block_size.unwrap_or(sched_config.block_size);
            sched_config.seed = sched_config.seed.wrapping_add(i as u64);
            let sync = config.replica_sync.then(|| {
                let (out, task) = sync_bus::spawn_publisher(
                    bus.clone(),
                    subjects.sync(),
                    replica_id.clone(),
                    name.clone(),
                );
                sync_tasks.push(task);
                SyncLink {
                    out,
                    inbox: Arc::default(),
                    catch_up: true,
                    echo_window: config.replica_sync_echo,
                }
            });
            let peer_inbox = sync.as_ref().map(|s| s.inbox.clone());
            let (scheduler, sched_join) = Actor::spawn(
                None,
                SchedulerActor,
                SchedulerArgs {
                    model: name.clone(),
                    replica_id: replica_id.clone(),
                    config: sched_config,
                    metrics: metrics.clone(),
                    sync,
                },
            )
            .await
            .map_err(|e| start_err(format!("scheduler of model {name:?}"), e))?;
            let (gap_tx, mut gap_rx) = tokio::sync::mpsc::unbounded_channel();
            let index = Arc::new(
                ShardedIndex::start(ShardedIndexConfig {
                    shards: config.index_shards,
                    approx: config.no_kv_events.then(|| ApproxConfig {
                        ttl: config.router_ttl,
                        ..ApproxConfig::default()
                    }),
                    recovery: Some(gap_tx),
                })
                .await
                .map_err(|e| start_err(format!("index of model {name:?}"), e))?,
            );
            let (fleet, fleet_join) = Actor::spawn(
                None,
                FleetActor,
                FleetArgs {
                    model: name.clone(),
                    block_size,
                    lease: config.worker_lease,
                    fetch_timeout: config.state_fetch_timeout,
                    index: index.clone(),
                    scheduler: scheduler.clone(),
                    subjects: model_subjects.clone(),
                    bus: bus.clone(),
                    replica_id: replica_id.clone(),
                    status: status.clone(),
                    metrics: metrics.clone(),
                    // A remote-indexer replica keeps no index: no events, no state fetches.
                    no_kv_events: config.no_kv_events || config.use_remote_indexer,
                },
            )
            .await
            .map_err(|e| start_err(format!("fleet tracker of model {name:?}"), e))?;
            let gap_fleet = fleet.clone();
            let gaps = tokio::spawn(async move {
                while let Some(key) = gap_rx.recv().await {
                    let _ = gap_fleet.send_message(FleetMsg::IndexGap(key));
                }
            });
            let joins = tokio::spawn(async move {
                let _ = sched_join.await;
                let _ = fleet_join.await;
            });
            let indexer_find = model_subjects.indexer_find_matches();
            let indexer_record = model_subjects.indexer_record();
            shared_models.insert(
                name.clone(),
                Arc::new(ModelShared {
                    name: name.clone(),
                    subjects: model_subjects,
                    status,
                    index: index.reader(),
                    recorder: config.no_kv_events.then(|| {
                        let r = DecisionRecorder::new(name, index.clone(), metrics.clone());
                        if config.serve_indexer || config.use_remote_indexer {
                            r.publishing(DecisionPublisher::new(bus.clone(), indexer_record))
                        } else {
                            r
                        }
                    }),
                    remote_index: config.use_remote_indexer.then(|| {
                        Arc::new(RemoteIndexer::new(
                            bus.clone(),
                            name,
                            indexer_find,
                            config.remote_indexer_timeout,
                            BreakerConfig::new(
                                config.remote_indexer_breaker_failures,
                                config.remote_indexer_breaker_cooldown,
                                config.remote_indexer_timeout,
                            ),
                            metrics.clone(),
                        ))
                    }),
                    scheduler: scheduler.clone(),
                    peer_inbox,
                    fleet: fleet.clone(),
                }),
            );
            models.push(ModelRuntime {
                name: name.clone(),
                index,
                scheduler,
                fleet,
                handles: vec![gaps, joins],
            });
        }

        let shared = Arc::new(ReplicaShared {
            replica_id: replica_id.clone(),
            bus: bus.clone(),
            metrics,
            models: shared_models,
            draining: Default::default(),
            replica_sync: config.replica_sync,
            sync_caught_up: Default::default(),
            routes_open: Default::default(),
        });
        let inflight = Arc::new(InFlight::default());
        let mut back = sync_tasks;
        let mut front = Vec::new();
        if config.replica_sync {
            let sub = subscribe(&bus, subjects.sync(), None).await?;
            back.push(sync_bus::spawn_peer_listener(shared.clone(), sub));
            back.push(sync_bus::spawn_catch_up(shared.clone(), subjects.clone()));
        }

        // Worker-facing subscriptions, per model.
        for m in shared.models.values() {
            let s = &m.subjects;
            let f = m.fleet.clone();
            back.push(forward(
                subscribe(&bus, s.register(), None).await?,
                "registration",
                move |r: Registration| {
                    let _ = f.send_message(FleetMsg::Registration(r));
                },
            ));
            let f = m.fleet.clone();
            back.push(forward(
                subscribe(&bus, s.heartbeat(), None).await?,
                "heartbeat",
                move |h: Heartbeat| {
                    let _ = f.send_message(FleetMsg::Heartbeat(h));
                },
            ));
            let f = m.fleet.clone();
            back.push(forward(
                subscribe(&bus, s.deregister(), None).await?,
                "deregistration",
                move |d: Deregistration| {
                    let _ = f.send_message(FleetMsg::Deregistration(d));
                },
            ));
            if !config.no_kv_events && !config.use_remote_indexer {
                let f = m.fleet.clone();
                back.push(forward(
                    subscribe(&bus, s.kv_events(), None).await?,
                    "KV event batch",
                    move |b: KvEventBatch| {
                        let _ = f.send_message(FleetMsg::Events(b));
                    },
                ));
            }
            let f = m.fleet.clone();
            back.push(forward(
                subscribe(&bus, s.load(), None).await?,
                "load report",
                move |l: LoadReport| {
                    let _ = f.send_message(FleetMsg::Load(l));
                },
            ));
        }

        // Served indexer: queries once synced; published decisions in approximate mode.
        if config.serve_indexer {
            for rt in &models {
                let m = shared.models[&rt.name].clone();
                if config.no_kv_events {
                    let records = subscribe(&bus, m.subjects.indexer_record(), None).await?;
                    // The record subscription must reach the server before the dump request.
                    if let Err(e) = bus.flush().await {
                        tracing::warn!(error = %e, "cannot flush subscriptions");
                    }
                    back.push(served_indexer::spawn_approx(
                        served_indexer::ApproxServing {
                            model: m.clone(),
                            records,
                            index: rt.index.clone(),
                            bus: bus.clone(),
                            metrics: shared.metrics.clone(),
                            replica_id: replica_id.clone(),
                            fetch_timeout: config.state_fetch_timeout,
                        },
                    ));
                    back.push(served_indexer::spawn_dumps(
                        m.clone(),
                        rt.index.clone(),
                        bus.clone(),
                    ));
                }
                front.push(served_indexer::spawn_queries(
                    m,
                    bus.clone(),
                    shared.metrics.clone(),
                ));
            }
        }

        // Router endpoints: updates to this replica at once; the queue-group ones (any
        // replica may answer) once the route gate opens.
        let max_prompt = config.max_prompt_tokens;
        let mut gate = RouteGate::default();
        for (subject, endpoint) in [
            (subjects.mark_prefill(&replica_id), Endpoint::MarkPrefill),
            (subjects.free(&replica_id), Endpoint::Free),
        ] {
            let mut sub = subscribe(&bus, subject, None).await?;
            let (shared, inflight) = (shared.clone(), inflight.clone());
            back.push(tokio::spawn(async move {
                while let Some(msg) = sub.next().await {
                    spawn_handler(shared.clone(), &inflight, max_prompt, endpoint, msg);
                }
            }));
        }
        for (subject, endpoint) in [
            (subjects.route(), Endpoint::Route),
            (subjects.overlap_scores(), Endpoint::OverlapScores),
            (subjects.potential_loads(), Endpoint::PotentialLoads),
        ] {
            let sub = gate.subscribe_later(subject);
            let (shared, inflight) = (shared.clone(), inflight.clone());
            front.push(tokio::spawn(async move {
                let Ok(mut sub) = sub.await else { return };
                while let Some(msg) = sub.next().await {
                    spawn_handler(shared.clone(), &inflight, max_prompt, endpoint, msg);
                }
            }));
        }
        // Disaggregated prefill/decode: route_disagg and KV transfer reports.
        let (disagg_front, disagg_back) = crate::disagg::start(
            &shared,
            &inflight,
            max_prompt,
            config.transfer_timeout,
            &subjects,
            &mut gate,
        )
        .await?;
        front.extend(disagg_front);
        back.extend(disagg_back);
        if let Err(e) = bus.flush().await {
            tracing::warn!(error = %e, "cannot flush subscriptions");
        }

        // Roll call, then readiness may follow once every rank found is synced.
        for m in shared.models.values() {
            ask_who_is_there(&bus, &m.subjects, &replica_id).await;
        }
        let window = config.discovery_window;
        let s = shared.clone();
        back.push(tokio::spawn(async move {
            tokio::time::sleep(window).await;
            for m in s.models.values() {
                m.status.discovered.store(true, Ordering::Relaxed);
            }
        }));
        back.push(gate.spawn(
            shared.clone(),
            config.discovery_window + config.state_fetch_timeout,
        ));

        let admin_addr = match config.admin_addr {
            Some(addr) => {
                let (local, task) = admin::serve(addr, shared.clone())
                    .await
                    .map_err(|source| ReplicaError::Admin { addr, source })?;
                back.push(task);
                Some(local)
            }
            None => None,
        };
        tracing::info!(
            replica_id = %replica_id,
            namespace = %config.namespace,
            models = ?config.models,
            admin = ?admin_addr,
            no_kv_events = config.no_kv_events,
            serve_indexer = config.serve_indexer,
            use_remote_indexer = config.use_remote_indexer,
            "replica started"
        );
        Ok(Self {
            shared,
            inflight,
            front,
            back,
            models,
            admin_addr,
            drain_timeout: config.drain_timeout,
        })
    }

    pub fn replica_id(&self) -> &str {
        &self.shared.replica_id
    }

    pub fn shared(&self) -> &Arc<ReplicaShared> {
        &self.shared
    }

    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin_addr
    }

    pub fn is_ready(&self) -> bool {
        self.shared.readiness().0
    }

    /// Waits until ready or `timeout`; returns readiness.
    pub async fn wait_ready(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while !self.is_ready() {
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        true
    }

    /// The index's view of one rank, as events that rebuild it (after every event already
    /// handed to the index); `None` for an unknown model or rank.
    pub async fn dump_rank(&self, model: &str, key: WorkerKey) -> Option<RankDump> {
        let m = self.models.iter().find(|m| m.name == model)?;
        m.index.dump(key).await.ok().flatten()
    }

    /// Stops taking new requests, waits (up to the drain timeout) for the ones in flight,
    /// then stops everything.
    pub async fn shutdown(self) {
        self.shared.draining.store(true, Ordering::Relaxed);
        for t in &self.front {
            t.abort();
        }
        let deadline = Instant::now() + self.drain_timeout;
        while self.inflight.count() > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let left = self.inflight.count();
        if left > 0 {
            tracing::warn!(
                left,
                "drain timeout: answering queued requests with unavailable"
            );
            for m in &self.models {
                let _ = m.scheduler.send_message(SchedulerMsg::RejectQueued);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for t in &self.back {
            t.abort();
        }
        let _ = self.shared.bus.flush().await;
        for m in self.models {
            m.fleet.stop(None);
            m.scheduler.stop(None);
            for h in m.handles {
                h.abort();
            }
            if let Ok(index) = Arc::try_unwrap(m.index) {
                index.stop().await;
            }
        }
        tracing::info!("replica stopped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn valid() -> ReplicaConfig {
        ReplicaConfig {
            models: vec!["m".into()],
            ..ReplicaConfig::default()
        }
    }

    #[test]
    fn validate_names_what_is_wrong_without_a_bus() {
        assert!(valid().validate().is_ok());
        type Change = fn(&mut ReplicaConfig);
        let cases: Vec<(Change, &str)> = vec![
            (|c| c.models.clear(), "--model"),
            (|c| c.models.push("m".into()), "given twice"),
            (|c| c.namespace = "a b".into(), "a b"),
            (|c| _ = c.block_sizes.insert("x".into(), 16), "--block-size"),
            (|c| _ = c.block_sizes.insert("m".into(), 0), "block size 0"),
            (
                |c| c.router_ttl = MAX_ROUTER_TTL + Duration::from_secs(1),
                "--router-ttl-secs",
            ),
            (|c| c.replica_id = Some("a.b".into()), "replica id"),
            (
                |c| (c.serve_indexer, c.use_remote_indexer) = (true, true),
                "--use-remote-indexer",
            ),
        ];
        for (change, words) in cases {
            let mut c = valid();
            change(&mut c);
            let e = c.validate().expect_err(words).to_string();
            assert!(e.contains(words), "{words:?} not in {e:?}");
        }
    }
}

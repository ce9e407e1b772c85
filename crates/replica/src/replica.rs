//! Starting, wiring and stopping a replica: per model a pipeline of actors around plain
//! cores, then the bus handlers on top (see docs/architecture.md).

use crate::admin;
use crate::approx::DecisionRecorder;
use crate::breaker::BreakerConfig;
use crate::config::{ReplicaConfig, ReplicaError};
use crate::endpoints::{self, Endpoint};
use crate::metrics::Metrics;
use crate::rank_silence::RankSilence;
use crate::remote_indexer::{DecisionPublisher, RemoteIndexer};
use crate::replica_sync_bus;
use crate::route_gate::RouteGate;
use crate::scheduler_actor::{SchedulerActor, SchedulerArgs, SchedulerMsg, SyncLink};
use crate::serve::{follow_workers, forward, subscribe, InFlight, Server};
use crate::served_indexer;
use crate::state::{ModelShared, ReplicaShared};
use crate::status::ModelStatus;
use crate::worker_tracker::{ask_who_is_there, TrackerArgs, TrackerMsg, WorkerTracker};
use kvrouter_bus::Bus;
use kvrouter_indexer::{ApproxConfig, RankDump, ShardedIndex, ShardedIndexConfig};
use kvrouter_protocol::{
    FromWorker, IndexerAnnouncement, Subjects, Wire, WorkerKey, WorkerSubject,
};
use ractor::{Actor, ActorRef};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;

struct ModelRuntime {
    name: String,
    index: Arc<ShardedIndex>,
    scheduler: ActorRef<SchedulerMsg>,
    tracker: ActorRef<TrackerMsg>,
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
    http_addr: Option<SocketAddr>,
    drain_timeout: Duration,
    /// Sends the route spans still queued at shutdown.
    exporter: Option<kvrouter_otlp::Exporter>,
}

fn start_err(what: impl Into<String>, e: impl std::fmt::Display) -> ReplicaError {
    ReplicaError::Start {
        what: what.into(),
        reason: e.to_string(),
    }
}

/// Keeps `kvrouter_bus_connected` and the disconnect count current, and logs each change of
/// the connection once. The bus counts losses itself, so a reconnect quicker than the poll
/// is still counted.
fn watch_bus(shared: Arc<ReplicaShared>) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut up = shared.bus.is_connected();
        shared.metrics.bus_connected.set(i64::from(up));
        let mut every = tokio::time::interval(Duration::from_millis(250));
        loop {
            every.tick().await;
            shared.refresh_bus_metrics();
            let now_up = shared.bus.is_connected();
            if now_up != up {
                up = now_up;
                shared.metrics.bus_connected.set(i64::from(up));
                if up {
                    tracing::info!("bus connection restored");
                } else {
                    tracing::warn!("bus connection lost: not ready until it is back");
                }
            }
        }
    })
}

/// One model's pipeline: scheduler actor, index, worker tracker, and what the handlers read.
async fn start_model(
    config: &ReplicaConfig,
    i: usize,
    name: &str,
    subjects: &Subjects,
    bus: &Bus,
    replica_id: &str,
    metrics: &Arc<Metrics>,
) -> Result<(ModelRuntime, Arc<ModelShared>), ReplicaError> {
    let model_subjects = subjects.model(name)?;
    let mut handles = Vec::new();
    let status = Arc::new(ModelStatus::with_min_initial_workers(
        config.min_initial_workers,
    ));
    let block_size = config.block_sizes.get(name).copied();
    if let Some(b) = block_size {
        status.block_size.store(b, Ordering::Relaxed);
    }
    let mut sched_config = config.scheduler.clone();
    sched_config.block_size = block_size.unwrap_or(sched_config.block_size);
    sched_config.seed = sched_config.seed.wrapping_add(i as u64);
    let mut resync_rx = None;
    let sync = config.sync.as_ref().map(|sync| {
        let (resync, rx) = tokio::sync::mpsc::unbounded_channel();
        resync_rx = Some(rx);
        let publisher = replica_sync_bus::spawn_publisher(
            bus.clone(),
            subjects.sync_of(replica_id),
            replica_id.to_string(),
            name.to_string(),
        );
        handles.push(publisher.task);
        SyncLink {
            out: publisher.changes,
            inbox: Arc::default(),
            catch_up: true,
            echo_window: sync.echo,
            resync,
            published: publisher.published,
        }
    });
    let peer_inbox = sync.as_ref().map(|s| s.inbox.clone());
    let (scheduler, sched_join) = Actor::spawn(
        None,
        SchedulerActor,
        SchedulerArgs {
            model: name.to_string(),
            replica_id: replica_id.to_string(),
            config: sched_config,
            metrics: metrics.clone(),
            sync,
        },
    )
    .await
    .map_err(|e| start_err(format!("scheduler of model {name:?}"), e))?;
    if let Some(rx) = resync_rx {
        handles.push(replica_sync_bus::spawn_resync(
            bus.clone(),
            subjects.clone(),
            replica_id.to_string(),
            name.to_string(),
            rx,
            scheduler.clone(),
        ));
    }
    let index = Arc::new(
        ShardedIndex::start(ShardedIndexConfig {
            shards: config.index_shards,
            approx: config.index.approx_ttl().map(|ttl| ApproxConfig {
                ttl,
                ..ApproxConfig::default()
            }),
            fallback: watches_silence(config).then(|| ApproxConfig {
                ttl: config.silent_rank_ttl,
                ..ApproxConfig::default()
            }),
            // Worker-state sync alone decides when a rank is fetched again.
            recovery: None,
        })
        .await
        .map_err(|e| start_err(format!("index of model {name:?}"), e))?,
    );
    let silence = Arc::new(parking_lot::Mutex::new(RankSilence::new(
        config.events_silent_after,
    )));
    let (tracker, tracker_join) = Actor::spawn(
        None,
        WorkerTracker,
        TrackerArgs {
            silence: silence.clone(),
            model: name.to_string(),
            block_size,
            lease: config.worker_lease,
            fetch_timeout: config.state_fetch_timeout,
            index: index.clone(),
            scheduler: scheduler.clone(),
            subjects: model_subjects.clone(),
            bus: bus.clone(),
            replica_id: replica_id.to_string(),
            status: status.clone(),
            metrics: metrics.clone(),
            follows_events: config.index.follows_events(),
        },
    )
    .await
    .map_err(|e| start_err(format!("worker tracker of model {name:?}"), e))?;
    handles.push(tokio::spawn(async move {
        let _ = sched_join.await;
        let _ = tracker_join.await;
    }));
    let recorder = config.index.approximate().then(|| {
        let r = DecisionRecorder::new(name, index.clone(), metrics.clone());
        if config.index.serves() || config.index.remote().is_some() {
            r.publishing(DecisionPublisher::new(
                bus.clone(),
                model_subjects.indexer_record(),
            ))
        } else {
            r
        }
    });
    // A silent rank's booked routes feed the local index until its events flow again.
    let fallback = watches_silence(config)
        .then(|| DecisionRecorder::new(name, index.clone(), metrics.clone()));
    let remote_index = config.index.remote().map(|r| {
        Arc::new(RemoteIndexer::new(
            bus.clone(),
            name,
            model_subjects.indexer_find_matches(),
            r.timeout,
            BreakerConfig::new(r.breaker_failures, r.breaker_cooldown, r.timeout),
            metrics.clone(),
        ))
    });
    let shared = Arc::new(ModelShared {
        name: name.to_string(),
        subjects: model_subjects,
        status,
        index: index.reader(),
        sharded: index.clone(),
        recorder,
        remote_index,
        scheduler: scheduler.clone(),
        peer_inbox,
        tracker: tracker.clone(),
        silence,
        fallback,
    });
    let runtime = ModelRuntime {
        name: name.to_string(),
        index,
        scheduler,
        tracker,
        handles,
    };
    Ok((runtime, shared))
}

/// Ranks are watched for silence (and a silent one's routes recorded) when the replica
/// follows KV events into an index of its own.
fn watches_silence(config: &ReplicaConfig) -> bool {
    config.index.follows_events() && !config.events_silent_after.is_zero()
}

/// Hands each decoded message to the worker tracker.
fn to_tracker<T: 'static>(
    tracker: &ActorRef<TrackerMsg>,
    wrap: fn(T) -> TrackerMsg,
) -> impl FnMut(T) + Clone + Send + 'static {
    let tracker = tracker.clone();
    move |v| {
        let _ = tracker.send_message(wrap(v));
    }
}

/// `what` every worker publishes, handed to the model's worker tracker.
async fn follow<T: Wire + FromWorker + Send + 'static>(
    bus: &Bus,
    m: &ModelShared,
    metrics: &Arc<Metrics>,
    what: WorkerSubject,
    kind: &'static str,
    wrap: fn(T) -> TrackerMsg,
    back: &mut Vec<JoinHandle<()>>,
) -> Result<(), ReplicaError> {
    let to = to_tracker(&m.tracker, wrap);
    follow_workers(bus, &m.subjects, what, metrics, kind, to, back).await
}

/// What workers publish, handed to the model's worker tracker.
async fn subscribe_workers(
    config: &ReplicaConfig,
    m: &ModelShared,
    bus: &Bus,
    metrics: &Arc<Metrics>,
    back: &mut Vec<JoinHandle<()>>,
) -> Result<(), ReplicaError> {
    use WorkerSubject as W;
    follow(
        bus,
        m,
        metrics,
        W::Register,
        "registration",
        TrackerMsg::Registration,
        back,
    )
    .await?;
    follow(
        bus,
        m,
        metrics,
        W::Heartbeat,
        "heartbeat",
        TrackerMsg::Heartbeat,
        back,
    )
    .await?;
    follow(
        bus,
        m,
        metrics,
        W::Deregister,
        "deregistration",
        TrackerMsg::Deregistration,
        back,
    )
    .await?;
    if config.index.follows_events() {
        follow(
            bus,
            m,
            metrics,
            W::KvEvents,
            "kv_events",
            TrackerMsg::Events,
            back,
        )
        .await?;
        let marks = TrackerMsg::Marks;
        follow(bus, m, metrics, W::EventMarks, "event_marks", marks, back).await?;
    }
    follow(bus, m, metrics, W::Load, "load", TrackerMsg::Load, back).await?;
    let s = &m.subjects;
    if let Some(remote) = &m.remote_index {
        let remote = remote.clone();
        back.push(forward(
            subscribe(bus, s.indexer_announce(), None).await?,
            metrics.clone(),
            "indexer_announce",
            move |a: IndexerAnnouncement| remote.on_announcement(&a.replica_id),
        ));
    }
    Ok(())
}

/// `--serve-indexer`: answer lookups once synced; in approximate mode also record every
/// replica's published decisions and answer peers' dump requests.
#[allow(clippy::too_many_arguments)]
async fn start_served_indexer(
    config: &ReplicaConfig,
    rt: &ModelRuntime,
    m: &Arc<ModelShared>,
    server: &Server,
    replica_id: &str,
    front: &mut Vec<JoinHandle<()>>,
    back: &mut Vec<JoinHandle<()>>,
) -> Result<(), ReplicaError> {
    let bus = &server.bus;
    if config.index.approximate() {
        let records = subscribe(bus, m.subjects.indexer_record(), None).await?;
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
                metrics: server.metrics.clone(),
                replica_id: replica_id.to_string(),
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
        m.clone(),
        server.clone(),
        replica_id.to_string(),
    ));
    Ok(())
}

/// The router's endpoints: updates addressed to this replica at once; the queue-group ones
/// (any replica may answer) once the route gate opens.
async fn serve_router_endpoints(
    config: &ReplicaConfig,
    subjects: &Subjects,
    shared: &Arc<ReplicaShared>,
    server: &Server,
    gate: &mut RouteGate,
    front: &mut Vec<JoinHandle<()>>,
    back: &mut Vec<JoinHandle<()>>,
) -> Result<(), ReplicaError> {
    let (bus, replica_id) = (&server.bus, &shared.replica_id);
    let max_prompt = config.max_prompt_tokens;
    for (subject, endpoint) in [
        (subjects.mark_prefill(replica_id), Endpoint::MarkPrefill),
        (subjects.free(replica_id), Endpoint::Free),
        (subjects.add_output_block(replica_id), Endpoint::OutputBlock),
        (subjects.abandon(), Endpoint::Abandon),
    ] {
        let sub = subscribe(bus, subject, None).await?;
        back.push(endpoints::spawn(
            endpoint,
            sub,
            server.clone(),
            shared.clone(),
            max_prompt,
        ));
    }
    for (subject, endpoint) in [
        (subjects.route(), Endpoint::Route),
        (subjects.overlap_scores(), Endpoint::OverlapScores),
        (subjects.potential_loads(), Endpoint::PotentialLoads),
    ] {
        let sub = gate.subscribe_later(subject);
        let (server, shared) = (server.clone(), shared.clone());
        front.push(tokio::spawn(async move {
            let Ok(sub) = sub.await else { return };
            endpoints::serve(endpoint, sub, server, shared, max_prompt).await;
        }));
    }
    let (disagg_front, disagg_back) = crate::disagg::start(
        shared,
        server,
        max_prompt,
        config.transfer_timeout,
        subjects,
        gate,
    )
    .await?;
    front.extend(disagg_front);
    back.extend(disagg_back);
    Ok(())
}

/// Roll call, then the route gate: readiness may follow once every rank found is synced.
async fn begin_discovery(
    config: &ReplicaConfig,
    shared: &Arc<ReplicaShared>,
    gate: RouteGate,
    back: &mut Vec<JoinHandle<()>>,
) {
    for m in shared.models.values() {
        ask_who_is_there(&shared.bus, &m.subjects, &shared.replica_id).await;
    }
    let window = config.discovery_window;
    let s = shared.clone();
    back.push(tokio::spawn(async move {
        tokio::time::sleep(window).await;
        for m in s.models.values() {
            m.status.discovered.store(true, Ordering::Relaxed);
        }
    }));
    if config.min_initial_workers > 0 {
        let (s, wait, min) = (
            shared.clone(),
            config.min_initial_workers_timeout,
            config.min_initial_workers,
        );
        back.push(tokio::spawn(async move {
            tokio::time::sleep(wait).await;
            for m in s.models.values() {
                if let Some(known) = m.status.waive_min_workers() {
                    tracing::warn!(model = %m.name, known, min_initial_workers = min, waited_secs = wait.as_secs_f64(), "taking routes with fewer workers than --min-initial-workers: the wait timed out");
                }
            }
        }));
    }
    // The gate waits as long as readiness may: for the first syncs, and for the initial
    // workers if asked to.
    let mut bound = config.discovery_window + config.state_fetch_timeout;
    if config.min_initial_workers > 0 {
        bound = bound.max(config.min_initial_workers_timeout + Duration::from_secs(1));
    }
    back.push(gate.spawn(shared.clone(), bound));
}

/// Ticks the stall watch; a stall past the threshold is logged once it ends.
fn watch_stalls(shared: Arc<ReplicaShared>) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_millis(100));
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            if let Some(stalled) = shared.stall.tick(crate::clock::now()) {
                tracing::warn!(stalled_ms = stalled.as_millis() as u64, "this process was stalled (stopped, frozen or starved of CPU); turning away the routes that waited through it");
            }
        }
    })
}

impl Replica {
    pub async fn start(config: ReplicaConfig, bus: Bus) -> Result<Self, ReplicaError> {
        config.validate()?;
        let subjects = Subjects::new(&config.namespace)?;
        config.check_fits(bus.max_payload())?;
        let replica_id = config
            .replica_id
            .clone()
            .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string());
        let metrics = Arc::new(Metrics::for_models(config.models.iter().cloned()));
        let mut models = Vec::new();
        let mut shared_models = HashMap::new();
        for (i, name) in config.models.iter().enumerate() {
            let (rt, m) =
                start_model(&config, i, name, &subjects, &bus, &replica_id, &metrics).await?;
            shared_models.insert(name.clone(), m);
            models.push(rt);
        }
        let inflight = Arc::new(InFlight::default());
        let (tracer, exporter) = config.traces.start(
            kvrouter_otlp::ServiceInfo {
                name: "kvrouter-replica".into(),
                instance_id: replica_id.clone(),
            },
            metrics.traces.clone(),
        );
        let shared = Arc::new(ReplicaShared {
            replica_id: replica_id.clone(),
            bus: bus.clone(),
            subjects: subjects.clone(),
            max_prompt_tokens: config.max_prompt_tokens,
            inflight: inflight.clone(),
            metrics: metrics.clone(),
            http_stats: Default::default(),
            models: shared_models,
            draining: Default::default(),
            replica_sync: config.sync.is_some(),
            sync_caught_up: Default::default(),
            allow_unleased: config.allow_unleased,
            routes_open: Default::default(),
            stall: crate::stall::StallWatch::new(crate::clock::now()),
            tracer,
            policy: config.scheduler.policy.as_str(),
        });
        let server = Server {
            bus: bus.clone(),
            inflight: inflight.clone(),
            metrics: metrics.clone(),
        };
        let (mut front, mut back) = (
            Vec::new(),
            vec![watch_bus(shared.clone()), watch_stalls(shared.clone())],
        );
        if config.sync.is_some() {
            let peers = subscribe(&bus, subjects.sync_all(), None).await?;
            let legacy = subscribe(&bus, subjects.legacy_sync(), None).await?;
            back.push(replica_sync_bus::spawn_peer_listener(
                shared.clone(),
                subjects.clone(),
                peers,
                legacy,
            ));
            let own = subscribe(&bus, subjects.sync_own(&replica_id), None).await?;
            back.push(replica_sync_bus::spawn_own_state_responder(
                shared.clone(),
                own,
            ));
            back.push(replica_sync_bus::spawn_catch_up(
                shared.clone(),
                subjects.clone(),
            ));
        }
        for m in shared.models.values() {
            subscribe_workers(&config, m, &bus, &metrics, &mut back).await?;
        }
        if config.index.serves() {
            for rt in &models {
                let m = &shared.models[&rt.name];
                start_served_indexer(&config, rt, m, &server, &replica_id, &mut front, &mut back)
                    .await?;
            }
        }

        let mut gate = RouteGate::default();
        serve_router_endpoints(
            &config, &subjects, &shared, &server, &mut gate, &mut front, &mut back,
        )
        .await?;
        if let Err(e) = bus.flush().await {
            tracing::warn!(error = %e, "cannot flush subscriptions");
        }
        begin_discovery(&config, &shared, gate, &mut back).await;

        let admin_addr = match config.admin_addr {
            Some(addr) => {
                let (local, task) = admin::serve(addr, config.http_limits.clone(), shared.clone())
                    .await
                    .map_err(|source| ReplicaError::Admin { addr, source })?;
                back.push(task);
                Some(local)
            }
            None => None,
        };
        // The admin listener serves the JSON API too; --http-addr adds a listener of its own.
        let http_addr = match config.http_addr {
            Some(addr) if config.admin_addr != Some(addr) => {
                let (local, task) = admin::serve(addr, config.http_limits.clone(), shared.clone())
                    .await
                    .map_err(|source| ReplicaError::Http { addr, source })?;
                back.push(task);
                Some(local)
            }
            _ => admin_addr,
        };
        tracing::info!(
            replica_id = %replica_id,
            namespace = %config.namespace,
            models = ?config.models,
            admin = ?admin_addr,
            http_api = ?http_addr,
            index = config.index.describe(),
            replica_sync = config.sync.is_some(),
            "replica started"
        );
        Ok(Self {
            shared,
            inflight,
            front,
            back,
            models,
            admin_addr,
            http_addr,
            drain_timeout: config.drain_timeout,
            exporter,
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

    /// Where the JSON API for peer routers listens (`--http-addr`, else the admin address).
    pub fn http_addr(&self) -> Option<SocketAddr> {
        self.http_addr
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
        // Bounded: with the bus down a flush would wait for a reconnect that may never come.
        let _ = self
            .shared
            .bus
            .flush_within(kvrouter_bus::SHUTDOWN_FLUSH_TIMEOUT)
            .await;
        for m in self.models {
            m.tracker.stop(None);
            m.scheduler.stop(None);
            for h in m.handles {
                h.abort();
            }
            if let Ok(index) = Arc::try_unwrap(m.index) {
                let _ = tokio::time::timeout(Duration::from_secs(1), index.stop()).await;
            }
        }
        if let Some(e) = self.exporter {
            e.shutdown(Duration::from_secs(2)).await;
        }
        tracing::info!("replica stopped");
    }
}

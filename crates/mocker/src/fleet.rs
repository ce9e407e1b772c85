//! [`MockerFleet`]: N simulated workers × D data-parallel ranks in one process, on the bus.
//!
//! Each worker speaks the worker side of docs/protocol.md:
//! - **discovery**: a `Registration` on start and at once on every `WhoIsThere`, a
//!   `Heartbeat` every `heartbeat_interval` with its live ranks, a `Deregistration` on
//!   [`MockerFleet::shutdown`];
//! - **KV events** (`KvEventBatch`, per rank in event-id order, chunked under the bus payload
//!   limit) and **load reports** (`LoadReport`), batched every `event_batch_interval`;
//! - **generate** (`GenerateRequest` → stream of `GenerateEvent`), **state** (`StateQuery` →
//!   stream of `Reply<StateChunk>`, consistent with the event stream) and the
//!   **drop_events** test hook (an encoded `u64`: drop that many of the next event batches;
//!   with a reply subject it is answered `Reply<()>` once the publisher has the order), and
//!   the **rank_live** test hook (a `RankLiveness`: [`MockerFleet::set_rank_live`] over the
//!   bus, for a fleet in another process).
//!
//! Every rank is a tokio task owning its [`RankEngine`](crate::RankEngine); simulated time
//! runs `speedup` times faster than the wall clock (see [`crate::rank_task`]).
//!
//! ```no_run
//! # async fn demo() -> Result<(), kvrouter_mocker::FleetError> {
//! use kvrouter_mocker::{FleetConfig, MockerFleet};
//! let bus = kvrouter_bus::Bus::local();
//! let config = FleetConfig { workers: 2, dp_size: 2, speedup: 100.0, ..FleetConfig::new("my-model") };
//! let fleet = MockerFleet::start(bus, config).await?;
//! println!("workers {:?}", fleet.worker_ids());
//! fleet.shutdown().await?;
//! # Ok(()) }
//! ```

use crate::config::{ConfigError, EngineConfig};
use crate::engine::RankEngine;
use crate::mock_info::{MockInfo, TransferConfig};
use crate::rank_task::{RankCmd, RankTask};
use crate::worker::{EndpointSubs, Endpoints};
use kvrouter_bus::{Bus, BusError, SHUTDOWN_FLUSH_TIMEOUT};
use kvrouter_protocol::{
    DpRank, EventId, ModelSubjects, SubjectError, Subjects, WorkerId, WorkerKey, WorkerRole,
};
use kvrouter_worker::{
    deregister_within, discovery_task, publish_msg, Publisher, WorkerInfo, WorkerSpec,
};
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use uuid::Uuid;

/// How long [`MockerFleet::shutdown`] waits for its tasks before aborting them.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// What a fleet runs.
#[derive(Clone, Debug, PartialEq)]
pub struct FleetConfig {
    /// Subject namespace (default `kvrouter`).
    pub namespace: String,
    /// Model every worker serves.
    pub model: String,
    /// Number of workers (default 1).
    pub workers: u32,
    /// Worker ids are `worker_id_start .. worker_id_start + workers` (default 0).
    pub worker_id_start: WorkerId,
    /// Data-parallel ranks per worker (default 1), each with its own KV cache.
    pub dp_size: u32,
    /// First rank of each worker (default 0).
    pub dp_start_rank: DpRank,
    /// Tensor-parallel size (default 1): in registrations, and each tp rank of a prefill or
    /// decode worker transfers KV and sends its own transfer report (see `disagg`).
    pub tp_size: u32,
    pub role: WorkerRole,
    /// Engine of every rank (block size, capacity per rank, batching limits, timing).
    pub engine: EngineConfig,
    /// Simulated time runs this many times faster than the wall clock (default 1).
    pub speedup: f64,
    /// Heartbeat period (default 1 s).
    pub heartbeat_interval: Duration,
    /// KV events wait at most this long (wall) to be batched (default 5 ms).
    pub event_batch_interval: Duration,
    /// Load reports go out this often when something changed (default 100 ms), and at most
    /// one `event_batch_interval` after a change.
    pub load_report_interval: Duration,
    /// Simulated time one tp rank of a decode worker takes to receive one prompt block of KV
    /// (default [`DEFAULT_KV_TRANSFER_PER_BLOCK`]).
    pub kv_transfer_per_block: Duration,
    /// A decode worker's request fails when not every tp rank received its KV within this
    /// long (wall time, default 30 s).
    pub kv_receive_timeout: Duration,
    /// Test hook: this tp rank of every worker never finishes a transfer (a prefill tp rank
    /// never reports its KV sent, a decode tp rank never receives). Change it at run time
    /// with [`MockerFleet::silence_tp_rank`].
    pub silence_tp_rank: Option<u32>,
}

/// One prompt block's KV (64 tokens of an 8B model, 8 MiB) over a link of about 80 GB/s.
pub const DEFAULT_KV_TRANSFER_PER_BLOCK: Duration = Duration::from_micros(100);
/// How long a decode worker waits for every tp rank to receive a request's KV.
pub const DEFAULT_KV_RECEIVE_TIMEOUT: Duration = Duration::from_secs(30);

impl Default for FleetConfig {
    fn default() -> Self {
        Self {
            namespace: "kvrouter".into(),
            model: String::new(),
            workers: 1,
            worker_id_start: 0,
            dp_size: 1,
            dp_start_rank: 0,
            tp_size: 1,
            role: WorkerRole::Aggregated,
            engine: EngineConfig::default(),
            speedup: 1.0,
            heartbeat_interval: Duration::from_secs(1),
            event_batch_interval: Duration::from_millis(5),
            load_report_interval: Duration::from_millis(100),
            kv_transfer_per_block: DEFAULT_KV_TRANSFER_PER_BLOCK,
            kv_receive_timeout: DEFAULT_KV_RECEIVE_TIMEOUT,
            silence_tp_rank: None,
        }
    }
}

impl FleetConfig {
    /// The defaults, serving `model`.
    pub fn new(model: impl Into<String>) -> Self {
        Self {
            model: model.into(),
            ..Self::default()
        }
    }

    /// Checks that the fleet can run.
    pub fn validate(&self) -> Result<(), FleetError> {
        let bad = |m: String| Err(FleetError::Config(m));
        self.engine.validate()?;
        Subjects::new(&self.namespace)?.model(&self.model)?;
        if self.workers == 0 {
            return bad("workers must be at least 1".into());
        }
        if self
            .worker_id_start
            .checked_add(u64::from(self.workers) - 1)
            .is_none()
        {
            return bad(format!(
                "worker ids {} + {} workers overflow u64",
                self.worker_id_start, self.workers
            ));
        }
        if self.dp_size == 0 {
            return bad("dp_size must be at least 1".into());
        }
        if self.dp_start_rank.checked_add(self.dp_size).is_none() {
            return bad(format!(
                "dp_start_rank {} + dp_size {} overflows u32",
                self.dp_start_rank, self.dp_size
            ));
        }
        if self.tp_size == 0 {
            return bad("tp_size must be at least 1".into());
        }
        if u32::try_from(self.engine.block_size).is_err() {
            return bad(format!(
                "block_size {} does not fit u32",
                self.engine.block_size
            ));
        }
        if !(self.speedup.is_finite() && self.speedup > 0.0) {
            return bad(format!(
                "speedup must be a positive number, not {}",
                self.speedup
            ));
        }
        if self.heartbeat_interval.is_zero() {
            return bad("heartbeat_interval must be positive".into());
        }
        if self.load_report_interval.is_zero() {
            return bad("load_report_interval must be positive".into());
        }
        if self.kv_receive_timeout.is_zero() {
            return bad("kv_receive_timeout must be positive".into());
        }
        if let Some(tp) = self.silence_tp_rank.filter(|&tp| tp >= self.tp_size) {
            return bad(format!(
                "silence_tp_rank {tp} is not a tp rank (tp_size {})",
                self.tp_size
            ));
        }
        Ok(())
    }
}

/// Why a fleet could not start, or a fleet operation failed.
#[derive(Debug, Error)]
pub enum FleetError {
    #[error("invalid fleet configuration: {0}")]
    Config(String),
    #[error("invalid engine configuration: {0}")]
    Engine(#[from] ConfigError),
    #[error(transparent)]
    Subject(#[from] SubjectError),
    #[error(transparent)]
    Bus(#[from] BusError),
    #[error("worker {0} is not part of this fleet")]
    UnknownWorker(WorkerId),
    #[error("worker {worker_id} has no rank {dp_rank}")]
    InvalidRank {
        worker_id: WorkerId,
        dp_rank: DpRank,
    },
    #[error("tp rank {tp_rank} is not a tp rank of worker {worker_id} (tp_size {tp_size})")]
    InvalidTpRank {
        worker_id: WorkerId,
        tp_rank: u32,
        tp_size: u32,
    },
    #[error("the fleet is shutting down")]
    Stopped,
    #[error("the fleet's shutdown left work undone: {0}")]
    ShutdownIncomplete(String),
}

/// One worker as the fleet handle sees it.
struct WorkerHandle {
    info: Arc<MockInfo>,
    ranks: Vec<mpsc::UnboundedSender<RankCmd>>,
}

/// A running fleet of simulated workers. Stop it with [`shutdown`](Self::shutdown) (which
/// deregisters every worker); dropping it stops the tasks without deregistering.
pub struct MockerFleet {
    bus: Bus,
    config: FleetConfig,
    subjects: ModelSubjects,
    workers: Vec<WorkerHandle>,
    shutdown: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for MockerFleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MockerFleet")
            .field("model", &self.config.model)
            .field("worker_ids", &self.worker_ids())
            .field("dp_size", &self.config.dp_size)
            .finish()
    }
}

impl MockerFleet {
    /// Starts every worker and rank, subscribes their endpoints, then publishes their
    /// registrations.
    pub async fn start(bus: Bus, config: FleetConfig) -> Result<MockerFleet, FleetError> {
        config.validate()?;
        let subjects = Subjects::new(&config.namespace)?.model(&config.model)?;
        let (shutdown, _) = watch::channel(false);
        let mut fleet = MockerFleet {
            bus: bus.clone(),
            subjects: subjects.clone(),
            workers: Vec::with_capacity(config.workers as usize),
            shutdown,
            tasks: Vec::new(),
            config,
        };
        // On error, dropping `fleet` stops whatever was started.
        for i in 0..fleet.config.workers {
            let worker_id = fleet.config.worker_id_start + u64::from(i);
            fleet.start_worker(worker_id).await?;
        }
        let who = bus.subscribe(&subjects.who_is_there()).await?;
        let infos: Vec<Arc<WorkerInfo>> = fleet
            .workers
            .iter()
            .map(|w| w.info.worker.clone())
            .collect();
        fleet.tasks.push(tokio::spawn(discovery_task(
            bus.clone(),
            subjects.clone(),
            infos.clone(),
            who,
            fleet.config.heartbeat_interval,
            fleet.shutdown.subscribe(),
        )));
        for info in &infos {
            tracing::info!(
                worker_id = info.worker_id,
                instance_id = %info.instance_id(),
                model = %info.model,
                dp_start_rank = info.dp_start_rank,
                dp_size = info.dp_size,
                "mocker worker started"
            );
            publish_msg(
                &bus,
                &subjects.register(info.worker_id),
                &info.registration(),
            )
            .await;
        }
        Ok(fleet)
    }

    async fn start_worker(&mut self, worker_id: WorkerId) -> Result<(), FleetError> {
        let c = &self.config;
        let spec = WorkerSpec {
            worker_id,
            model: c.model.clone(),
            role: c.role,
            // Validated to fit.
            block_size: u32::try_from(c.engine.block_size).unwrap_or(u32::MAX),
            dp_size: c.dp_size,
            dp_start_rank: c.dp_start_rank,
            tp_size: c.tp_size,
            capacity_blocks: c.engine.capacity_blocks as u64,
            heartbeat_interval_ms: u32::try_from(c.heartbeat_interval.as_millis())
                .unwrap_or(u32::MAX),
            engine: kvrouter_protocol::EngineKind::Mocker,
            base_url: String::new(),
        };
        let transfer = TransferConfig {
            per_block: c.kv_transfer_per_block,
            receive_timeout: c.kv_receive_timeout,
            speedup: c.speedup,
        };
        let info = Arc::new(MockInfo::new(WorkerInfo::new(spec), transfer));
        info.set_silenced_tp_rank(c.silence_tp_rank);
        let subs = EndpointSubs {
            generate: self
                .bus
                .subscribe(&self.subjects.generate(worker_id))
                .await?,
            state: self.bus.subscribe(&self.subjects.state(worker_id)).await?,
            drop_events: self
                .bus
                .subscribe(&self.subjects.drop_events(worker_id))
                .await?,
            rank_live: self
                .bus
                .subscribe(&self.subjects.rank_live(worker_id))
                .await?,
        };
        let (pub_tx, pub_rx) = mpsc::unbounded_channel();
        let mut ranks = Vec::with_capacity(c.dp_size as usize);
        for index in 0..c.dp_size {
            let key = WorkerKey::new(worker_id, c.dp_start_rank + index);
            let engine = RankEngine::new(key, c.engine.clone())?;
            let (tx, rx) = mpsc::unbounded_channel();
            let task = RankTask::new(
                engine,
                index as usize,
                info.clone(),
                pub_tx.clone(),
                c.speedup,
            );
            self.tasks
                .push(tokio::spawn(task.run(rx, self.shutdown.subscribe())));
            ranks.push(tx);
        }
        let publisher = Publisher {
            bus: self.bus.clone(),
            info: info.worker.clone(),
            kv_events_subject: self.subjects.kv_events(worker_id),
            load_subject: self.subjects.load(worker_id),
            event_marks_subject: self.subjects.event_marks(worker_id),
            batch_interval: c.event_batch_interval,
            load_interval: c.load_report_interval,
        };
        self.tasks.push(tokio::spawn(
            publisher.run(pub_rx, self.shutdown.subscribe()),
        ));
        let endpoints = Endpoints {
            bus: self.bus.clone(),
            info: info.clone(),
            ranks: ranks.clone(),
            publisher: pub_tx,
            subjects: self.subjects.clone(),
        };
        self.tasks
            .push(tokio::spawn(endpoints.run(subs, self.shutdown.subscribe())));
        self.workers.push(WorkerHandle { info, ranks });
        Ok(())
    }

    /// The worker ids, in order.
    pub fn worker_ids(&self) -> Vec<WorkerId> {
        self.workers.iter().map(|w| w.info.worker_id).collect()
    }

    /// The instance id of a worker of this fleet (new on every start).
    pub fn instance_id(&self, worker_id: WorkerId) -> Option<Uuid> {
        self.worker(worker_id).ok().map(|w| w.info.instance_id())
    }

    /// The configuration the fleet runs.
    pub fn config(&self) -> &FleetConfig {
        &self.config
    }

    /// The subjects of the fleet's model.
    pub fn subjects(&self) -> &ModelSubjects {
        &self.subjects
    }

    /// The live ranks of a worker.
    pub fn live_ranks(&self, worker_id: WorkerId) -> Result<Vec<DpRank>, FleetError> {
        Ok(self.worker(worker_id)?.info.live_ranks())
    }

    fn worker(&self, worker_id: WorkerId) -> Result<&WorkerHandle, FleetError> {
        worker_id
            .checked_sub(self.config.worker_id_start)
            .and_then(|i| usize::try_from(i).ok())
            .and_then(|i| self.workers.get(i))
            .ok_or(FleetError::UnknownWorker(worker_id))
    }

    fn rank_index(
        &self,
        worker_id: WorkerId,
        dp_rank: DpRank,
    ) -> Result<(&WorkerHandle, usize), FleetError> {
        let w = self.worker(worker_id)?;
        let index = w
            .info
            .rank_index(dp_rank)
            .ok_or(FleetError::InvalidRank { worker_id, dp_rank })?;
        Ok((w, index))
    }

    /// Takes a rank in or out of service. A dead rank is left out of `live_ranks` (in
    /// heartbeats, registrations and load reports) and refuses generate and state queries;
    /// its cache and running requests are kept. A change is announced at once with a
    /// registration and a heartbeat.
    pub async fn set_rank_live(
        &self,
        worker_id: WorkerId,
        dp_rank: DpRank,
        live: bool,
    ) -> Result<(), FleetError> {
        let (w, index) = self.rank_index(worker_id, dp_rank)?;
        kvrouter_worker::set_rank_live(&self.bus, &self.subjects, &w.info.worker, index, live)
            .await;
        Ok(())
    }

    /// Test hook: silences one tp rank of a worker (`None`: none). A silenced prefill tp
    /// rank never reports a transfer sent; a silenced decode tp rank never receives, so
    /// requests arriving meanwhile fail after the receive timeout. Transfers under way see
    /// the change when their tp rank would finish.
    pub fn silence_tp_rank(
        &self,
        worker_id: WorkerId,
        tp_rank: Option<u32>,
    ) -> Result<(), FleetError> {
        let w = self.worker(worker_id)?;
        if let Some(tp) = tp_rank.filter(|&tp| tp >= w.info.tp_size) {
            return Err(FleetError::InvalidTpRank {
                worker_id,
                tp_rank: tp,
                tp_size: w.info.tp_size,
            });
        }
        tracing::info!(worker_id, ?tp_rank, "silenced tp rank set (test hook)");
        w.info.set_silenced_tp_rank(tp_rank);
        Ok(())
    }

    /// Drops a rank's prefix cache, emitting a `Cleared` event; returns its event id.
    pub async fn clear_rank(
        &self,
        worker_id: WorkerId,
        dp_rank: DpRank,
    ) -> Result<EventId, FleetError> {
        let (w, index) = self.rank_index(worker_id, dp_rank)?;
        let (tx, rx) = oneshot::channel();
        w.ranks[index]
            .send(RankCmd::Clear { reply: tx })
            .map_err(|_| FleetError::Stopped)?;
        rx.await.map_err(|_| FleetError::Stopped)
    }

    /// Stops every rank (requests in flight get an `Unavailable` error), publishes the KV
    /// events still buffered, deregisters every worker and flushes the bus; bounded as
    /// [`shutdown_within`](Self::shutdown_within) with a 5 s stop timeout.
    pub async fn shutdown(self) -> Result<(), FleetError> {
        self.shutdown_within(STOP_TIMEOUT).await
    }

    /// [`shutdown`](Self::shutdown) that ends in bounded time whatever the bus does (NATS may
    /// be down): the tasks get `stop_timeout` together to stop and hand over their last KV
    /// events, then are aborted; the deregistrations and the final flush get
    /// [`SHUTDOWN_FLUSH_TIMEOUT`] together. Fails with [`FleetError::ShutdownIncomplete`]
    /// naming what was left undone.
    pub async fn shutdown_within(mut self, stop_timeout: Duration) -> Result<(), FleetError> {
        let _ = self.shutdown.send(true);
        let mut undone = Vec::new();
        let deadline = Instant::now() + stop_timeout;
        let mut aborted = 0;
        for mut task in std::mem::take(&mut self.tasks) {
            if tokio::time::timeout_at(deadline, &mut task).await.is_err() {
                task.abort();
                aborted += 1;
            }
        }
        if aborted > 0 {
            tracing::warn!(
                aborted,
                ?stop_timeout,
                "mocker tasks did not stop in time (publishing to a NATS that is down?); \
                 aborted them, their last KV events are lost"
            );
            undone.push(format!(
                "{aborted} task(s) aborted after {stop_timeout:?}, their last KV events lost"
            ));
        }

        let workers: Vec<&WorkerInfo> = self.workers.iter().map(|w| &*w.info.worker).collect();
        if let Err(e) =
            deregister_within(&self.bus, &self.subjects, &workers, SHUTDOWN_FLUSH_TIMEOUT).await
        {
            undone.push(e);
        }
        if undone.is_empty() {
            Ok(())
        } else {
            Err(FleetError::ShutdownIncomplete(undone.join("; ")))
        }
    }
}

impl Drop for MockerFleet {
    fn drop(&mut self) {
        let _ = self.shutdown.send(true);
    }
}

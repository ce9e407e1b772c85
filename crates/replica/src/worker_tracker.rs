//! The worker tracker of one model: discovery, event ingest and worker-state sync.
//!
//! It owns the [`Discovery`] and [`WorkerStateSync`] cores, writes the model's index (through
//! its shard actors, never waiting on them) and tells the scheduler actor which worker ranks
//! are routable and how loaded their engines say they are. A rank becomes routable once its
//! state is synced (with KV events; at once otherwise). State fetches run as tasks that
//! report back as messages, as many at once as the core allows.

use crate::discovery::{Change, Discovery};
use crate::layouts::WorkerLayout;
use crate::metrics::{KeyLabels, Metrics, ModelLabels};
use crate::rank_silence::{RankSilence, SilenceChange};
use crate::scheduler_actor::SchedulerMsg;
use crate::status::ModelStatus;
use crate::worker_state::{EventOutcome, FetchLimits, StateBound, WorkerStateSync};
use bytes::Bytes;
use kvrouter_bus::Bus;
use kvrouter_indexer::{block_limit_for_capacity, RankDump, ShardedIndex};
use kvrouter_protocol::{
    decode, encode, Deregistration, EventId, EventMarks, Heartbeat, KvEvent, KvEventBatch,
    LoadReport, ModelSubjects, Registration, Reply, StateChunk, StateQuery, WhoIsThere, WorkerKey,
};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use rustc_hash::FxHashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use uuid::Uuid;

/// How often leases are checked and failed fetches retried.
const TICK: Duration = Duration::from_millis(250);
/// Least time between two "who is there" calls caused by unknown senders.
const ROLL_CALL_EVERY: Duration = Duration::from_secs(1);

pub enum TrackerMsg {
    Registration(Registration),
    Heartbeat(Heartbeat),
    Deregistration(Deregistration),
    Events(KvEventBatch),
    Marks(EventMarks),
    Load(LoadReport),
    /// A state fetch finished.
    Snapshot {
        key: WorkerKey,
        instance_id: Uuid,
        result: Result<(Option<EventId>, Vec<KvEvent>), String>,
    },
    Tick,
}

pub struct TrackerArgs {
    pub model: String,
    pub block_size: Option<u32>,
    pub lease: Duration,
    pub fetch_timeout: Duration,
    pub index: Arc<ShardedIndex>,
    pub scheduler: ActorRef<SchedulerMsg>,
    pub subjects: ModelSubjects,
    pub bus: Bus,
    pub replica_id: String,
    pub status: Arc<ModelStatus>,
    pub metrics: Arc<Metrics>,
    /// KV events and state fetches; otherwise (approximate mode, remote indexer) a rank is
    /// routable as soon as it joins.
    pub follows_events: bool,
    /// Which ranks are routed to without publishing (ranks are watched only when the
    /// replica follows events).
    pub silence: Arc<parking_lot::Mutex<RankSilence>>,
}

pub struct TrackerState {
    args: TrackerArgs,
    labels: ModelLabels,
    discovery: Discovery,
    sync: WorkerStateSync,
    /// Ranks the scheduler routes to (without KV events: every live rank).
    routable: FxHashMap<WorkerKey, u64>,
    last_roll_call: Option<Instant>,
    /// When the ranks' silence gauges were last exported.
    silence_exported: Option<Instant>,
}

pub struct WorkerTracker;

impl TrackerState {
    fn metrics<R>(&self, f: impl FnOnce(&Metrics) -> R) -> R {
        f(&self.args.metrics)
    }

    /// Publishes the counts readiness and metrics read.
    fn publish_status(&self) {
        let st = &self.args.status;
        let ranks = self.discovery.keys().count();
        st.ranks.store(ranks, Ordering::Relaxed);
        st.set_workers(self.discovery.worker_count());
        st.unsynced.store(self.sync.unsynced(), Ordering::Relaxed);
        let now = Instant::now();
        st.first_syncs
            .store(self.sync.first_syncs(now), Ordering::Relaxed);
        let unroutable = self.sync.unroutable(now);
        self.args
            .metrics
            .unroutable_ranks
            .get_or_create(&self.labels)
            .set(unroutable.len() as i64);
        *st.unroutable.write() = unroutable;
        if let Some(b) = self.discovery.block_size() {
            st.block_size.store(b, Ordering::Relaxed);
        }
        let m = &self.args.metrics;
        m.workers
            .get_or_create(&self.labels)
            .set(self.discovery.worker_count() as i64);
        m.worker_ranks.get_or_create(&self.labels).set(ranks as i64);
        m.unsynced_ranks
            .get_or_create(&self.labels)
            .set(self.sync.unsynced() as i64);
    }

    async fn roll_call(&mut self, force: bool) {
        let now = Instant::now();
        if !force
            && self
                .last_roll_call
                .is_some_and(|t| now.duration_since(t) < ROLL_CALL_EVERY)
        {
            return;
        }
        self.last_roll_call = Some(now);
        ask_who_is_there(&self.args.bus, &self.args.subjects, &self.args.replica_id).await;
    }

    /// Starts every fetch the core says is due (within its limits).
    fn start_due_fetches(&mut self, myself: &ActorRef<TrackerMsg>) {
        for key in self.sync.due_fetches(Instant::now()) {
            let Some(instance_id) = self.discovery.instance(key.worker_id) else {
                self.sync.remove(key);
                continue;
            };
            tracing::debug!(model = %self.args.model, worker = key.worker_id, dp_rank = key.dp_rank, "fetching rank state");
            let bus = self.args.bus.clone();
            let subject = self.args.subjects.state(key.worker_id);
            let timeout = self.args.fetch_timeout;
            let myself = myself.clone();
            let bound = StateBound::for_capacity(
                self.discovery
                    .capacity_blocks(key.worker_id)
                    .unwrap_or_default(),
            );
            tokio::spawn(async move {
                let result = fetch_state(&bus, &subject, key, instance_id, timeout, bound).await;
                let _ = myself.send_message(TrackerMsg::Snapshot {
                    key,
                    instance_id,
                    result,
                });
            });
        }
    }

    /// Puts a rank in the scheduler's candidates.
    fn make_routable(&mut self, key: WorkerKey, capacity_blocks: u64) {
        if self.routable.insert(key, capacity_blocks).is_none() {
            let _ = self.args.scheduler.send_message(SchedulerMsg::AddKey {
                key,
                capacity_blocks,
                block_size: self.discovery.block_size(),
            });
        }
    }

    async fn apply_changes(&mut self, changes: Vec<Change>, myself: &ActorRef<TrackerMsg>) {
        let model = self.args.model.clone();
        for change in changes {
            match change {
                Change::RankAdded {
                    key,
                    capacity_blocks,
                } => {
                    tracing::info!(%model, worker = key.worker_id, dp_rank = key.dp_rank, capacity_blocks, "worker rank joined");
                    let limit = usize::try_from(capacity_blocks)
                        .ok()
                        .map(block_limit_for_capacity);
                    if let Err(e) = self.args.index.set_block_limit(key.worker_id, limit) {
                        tracing::error!(%model, error = %e, "index shard unavailable");
                    }
                    if self.args.follows_events {
                        // Routable once its state is synced (see on_snapshot).
                        self.sync.add(key, Instant::now());
                        self.args.silence.lock().joined(key, Instant::now());
                    } else {
                        self.make_routable(key, capacity_blocks);
                    }
                }
                Change::RankRemoved(key) => {
                    tracing::info!(%model, worker = key.worker_id, dp_rank = key.dp_rank, "worker rank left");
                    self.sync.remove(key);
                    self.args.silence.lock().left(key);
                    self.routable.remove(&key);
                    let _ = self.args.index.remove_worker_rank(key);
                    let _ = self
                        .args
                        .scheduler
                        .send_message(SchedulerMsg::RemoveKey(key));
                }
                Change::WorkerRemoved { worker_id, reason } => {
                    tracing::info!(%model, worker = worker_id, reason, "worker left");
                    self.args.status.layouts.remove(worker_id);
                    self.sync.remove_worker(worker_id);
                    self.args.silence.lock().left_worker(worker_id);
                    self.routable.retain(|k, _| k.worker_id != worker_id);
                    let _ = self.args.index.remove_worker(worker_id);
                    let _ = self
                        .args
                        .scheduler
                        .send_message(SchedulerMsg::RemoveWorker(worker_id));
                }
                Change::Refused {
                    worker_id,
                    reason,
                    first,
                } => {
                    if first {
                        tracing::warn!(%model, worker = worker_id, %reason, "worker registration refused (its heartbeats and events are ignored; logged again in a minute if it is still there)");
                        self.metrics(|m| m.refused_workers.get_or_create(&self.labels).inc());
                    } else {
                        tracing::debug!(%model, worker = worker_id, %reason, "worker registration refused again");
                    }
                }
                Change::InstanceTakeover {
                    worker_id,
                    old,
                    new,
                } => {
                    tracing::warn!(%model, worker = worker_id, old_instance = %old, new_instance = %new, "a new instance took over a live worker id (a restart, or two engines sharing one id); dropping the old instance's state");
                    self.metrics(|m| m.instance_takeovers.get_or_create(&self.labels).inc());
                }
                Change::Unknown { worker_id } => {
                    tracing::debug!(%model, worker = worker_id, "message from an unregistered worker; asking who is there");
                    self.roll_call(false).await;
                }
            }
        }
        self.start_due_fetches(myself);
        self.publish_status();
    }

    async fn on_events(&mut self, batch: KvEventBatch, myself: &ActorRef<TrackerMsg>) {
        if self.discovery.instance(batch.worker_id) != Some(batch.instance_id) {
            if self
                .discovery
                .is_refused(batch.worker_id, batch.instance_id, Instant::now())
            {
                return;
            }
            // Unregistered worker or a new instance we have not heard from yet.
            self.roll_call(false).await;
            return;
        }
        let mut apply = Vec::with_capacity(batch.events.len());
        let (mut stale, mut gaps) = (0u64, Vec::new());
        for ev in batch.events {
            if ev.key.worker_id != batch.worker_id {
                continue; // a worker speaks only for its own ranks
            }
            match self.sync.on_event(&ev) {
                EventOutcome::Apply => apply.push(ev),
                EventOutcome::Stale => stale += 1,
                EventOutcome::Gap { missing } => {
                    tracing::warn!(model = %self.args.model, worker = ev.key.worker_id, dp_rank = ev.key.dp_rank, missing, "KV events lost; fetching the rank's state");
                    gaps.push(ev.key);
                }
                EventOutcome::Buffered | EventOutcome::Untracked => {}
            }
        }
        let applied = apply.len() as u64;
        self.heard_from(&apply);
        if !apply.is_empty() {
            if let Err(e) = self.args.index.apply_batch(apply) {
                tracing::error!(model = %self.args.model, error = %e, "index shard unavailable");
            }
        }
        let gap_count = gaps.len() as u64;
        if gap_count > 0 {
            self.start_due_fetches(myself);
        }
        self.metrics(|m| {
            m.events_applied.get_or_create(&self.labels).inc_by(applied);
            m.events_stale.get_or_create(&self.labels).inc_by(stale);
            m.event_gaps.get_or_create(&self.labels).inc_by(gap_count);
        });
        if gap_count > 0 {
            self.publish_status();
        }
    }

    /// Events applied: their ranks publish (a silent one resumed).
    fn heard_from(&self, events: &[KvEvent]) {
        let now = Instant::now();
        let mut last: Option<WorkerKey> = None;
        for ev in events {
            let key = ev.key;
            self.metrics(|m| {
                (m.rank_events)
                    .get_or_create(&KeyLabels::new(&self.args.model, key))
                    .inc()
            });
            if last == Some(key) {
                continue; // a batch is mostly one rank's
            }
            last = Some(key);
            let change = self.args.silence.lock().events(key, now);
            if let Some(SilenceChange::Resumed { quiet_for, .. }) = change {
                tracing::info!(model = %self.args.model, worker = key.worker_id, dp_rank = key.dp_rank, quiet_secs = quiet_for.as_secs(), "a silent worker rank publishes KV events again: its own events say what it caches (the blocks predicted from its routes are dropped)");
                if let Err(e) = self.args.index.drop_recorded(key) {
                    tracing::error!(model = %self.args.model, error = %e, "index shard unavailable");
                }
                self.metrics(|m| {
                    (m.events_silent)
                        .get_or_create(&KeyLabels::new(&self.args.model, key))
                        .set(0)
                });
            }
        }
    }

    /// Ranks routed to without publishing: flagged and warned about once; every watched
    /// rank's event age exported (once a second).
    fn check_silence(&mut self, now: Instant) {
        let watch = self.args.silence.clone();
        let mut silence = watch.lock();
        for change in silence.check(now) {
            let SilenceChange::Silent {
                key,
                quiet_for,
                routes,
                never_published,
            } = change
            else {
                continue;
            };
            self.metrics(|m| {
                (m.events_silent)
                    .get_or_create(&KeyLabels::new(&self.args.model, key))
                    .set(1)
            });
            let since = if never_published {
                "since it joined"
            } else {
                "since its last one"
            };
            tracing::warn!(
                model = %self.args.model,
                worker = key.worker_id,
                dp_rank = key.dp_rank,
                routes,
                quiet_secs = quiet_for.as_secs(),
                never_published,
                "worker rank is sent requests but no KV event came from it {since}: until its events flow, the blocks of its booked routes count as cached on it for --router-ttl-secs (approximate mode for this rank). Likely: its engine publishes elsewhere (the engine's KV events endpoint or topic differ from its bridge's --zmq-endpoint / --topic, or it connects where it should bind), KV events are off on the engine, or its bridge is stuck (see kvrouter_bridge_events_silent and the bridge's log)"
            );
        }
        if self
            .silence_exported
            .is_some_and(|at| now.duration_since(at) < Duration::from_secs(1))
        {
            return;
        }
        self.silence_exported = Some(now);
        self.metrics(|m| {
            for (key, q) in silence.all(now) {
                let labels = KeyLabels::new(&self.args.model, key);
                (m.since_last_event)
                    .get_or_create(&labels)
                    .set(q.since_last_event.as_secs_f64());
                m.events_silent
                    .get_or_create(&labels)
                    .set(i64::from(q.silent));
            }
        });
    }

    fn on_marks(&mut self, marks: EventMarks, myself: &ActorRef<TrackerMsg>) {
        if self.discovery.instance(marks.worker_id) != Some(marks.instance_id) {
            return; // an instance we do not follow (yet): its registration comes first
        }
        let mut gaps = 0u64;
        for m in marks.ranks {
            let key = WorkerKey::new(marks.worker_id, m.dp_rank);
            if let Some(missing) = self.sync.on_mark(key, m.last_event_id) {
                tracing::warn!(model = %self.args.model, worker = key.worker_id, dp_rank = key.dp_rank, missing, "KV events lost (the worker's mark is ahead of what arrived); fetching the rank's state");
                gaps += 1;
            }
        }
        if gaps > 0 {
            self.metrics(|m| m.event_gaps.get_or_create(&self.labels).inc_by(gaps));
            self.start_due_fetches(myself);
            self.publish_status();
        }
    }

    fn on_snapshot(
        &mut self,
        key: WorkerKey,
        instance_id: Uuid,
        result: Result<(Option<EventId>, Vec<KvEvent>), String>,
        myself: &ActorRef<TrackerMsg>,
    ) {
        if self.discovery.instance(key.worker_id) != Some(instance_id)
            || !self.discovery.has_key(key)
        {
            return; // the rank or its instance is gone; a newer fetch is (or is not) under way
        }
        let (last_event_id, events) = match result {
            Ok(v) => v,
            Err(e) => {
                if let Some(f) = self.sync.on_fetch_failed(key, Instant::now()) {
                    let retry_in_ms = f.retry_in.as_millis() as u64;
                    if f.worth_a_warning() {
                        tracing::warn!(model = %self.args.model, worker = key.worker_id, dp_rank = key.dp_rank, error = %e, rank_failures = f.failures, worker_failures = f.worker_failures, retry_in_ms, "rank state fetch failed; the rank gets no routes until it syncs (retrying)");
                    } else {
                        tracing::debug!(model = %self.args.model, worker = key.worker_id, dp_rank = key.dp_rank, error = %e, rank_failures = f.failures, "rank state fetch failed again");
                    }
                    self.metrics(|m| m.recovery_failures.get_or_create(&self.labels).inc());
                }
                self.start_due_fetches(myself);
                self.publish_status();
                return;
            }
        };
        let Some(after) = self.sync.on_snapshot(key, last_event_id) else {
            return;
        };
        // Queued, not awaited: other ranks' events keep flowing while the shard loads it,
        // and events sent after it are applied after it.
        let dump = RankDump {
            key,
            last_event_id,
            events,
        };
        if let Err(e) = self.args.index.queue_load_rank(dump) {
            tracing::error!(model = %self.args.model, error = %e, "index shard unavailable");
        }
        if !after.apply.is_empty() {
            let _ = self.args.index.apply_batch(after.apply);
        }
        self.metrics(|m| m.recoveries.get_or_create(&self.labels).inc());
        tracing::info!(model = %self.args.model, worker = key.worker_id, dp_rank = key.dp_rank, ?last_event_id, first_sync = after.first_sync, "rank state synced");
        if after.first_sync {
            if let Some(capacity) = self.discovery.capacity_blocks(key.worker_id) {
                self.make_routable(key, capacity);
            }
        }
        self.start_due_fetches(myself);
        self.publish_status();
    }
}

/// Fetches one rank's state as a stream of chunks, refusing it (and stopping to read) once
/// it passes what the worker's registered capacity explains ([`StateBound`]).
async fn fetch_state(
    bus: &Bus,
    subject: &str,
    key: WorkerKey,
    instance_id: Uuid,
    timeout: Duration,
    mut bound: StateBound,
) -> Result<(Option<EventId>, Vec<KvEvent>), String> {
    let query = encode(&StateQuery {
        dp_rank: key.dp_rank,
    })
    .map_err(|e| e.to_string())?;
    let mut stream = bus
        .request_stream(subject, Bytes::from(query), timeout)
        .await
        .map_err(|e| e.to_string())?;
    let mut events = Vec::new();
    let mut last = None;
    let mut chunks = 0usize;
    while let Some(item) = stream.next().await {
        let bytes = item.map_err(|e| e.to_string())?;
        let chunk: StateChunk = decode::<Reply<StateChunk>>(&bytes)
            .map_err(|e| format!("undecodable state chunk: {e}"))?
            .into_result()
            .map_err(|e| format!("worker refused the state query: {e}"))?;
        if chunk.key != key || chunk.instance_id != instance_id {
            return Err(format!(
                "state chunk for {} (instance {}) while fetching {key} (instance {instance_id})",
                chunk.key, chunk.instance_id
            ));
        }
        if chunks > 0 && chunk.last_event_id != last {
            return Err("state chunks disagree on the last event id".into());
        }
        last = chunk.last_event_id;
        chunks += 1;
        bound.count(&chunk.events)?;
        events.extend(chunk.events.into_iter().filter(|e| e.key == key));
    }
    if chunks == 0 {
        return Err("the worker sent no state".into());
    }
    Ok((last, events))
}

impl Actor for WorkerTracker {
    type Msg = TrackerMsg;
    type State = TrackerState;
    type Arguments = TrackerArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<TrackerMsg>,
        args: TrackerArgs,
    ) -> Result<TrackerState, ActorProcessingErr> {
        myself.send_interval(TICK, || TrackerMsg::Tick);
        Ok(TrackerState {
            labels: Metrics::model(&args.model),
            discovery: Discovery::new(&args.model, args.block_size, args.lease),
            // Readiness waits for a first sync as long as one fetch may stay silent.
            sync: WorkerStateSync::new(FetchLimits::default(), args.fetch_timeout),
            routable: FxHashMap::default(),
            last_roll_call: None,
            silence_exported: None,
            args,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<TrackerMsg>,
        msg: TrackerMsg,
        state: &mut TrackerState,
    ) -> Result<(), ActorProcessingErr> {
        let now = Instant::now();
        match msg {
            TrackerMsg::Registration(reg) => {
                let changes = state.discovery.on_registration(&reg, now);
                state.apply_changes(changes, &myself).await;
                if state.discovery.instance(reg.worker_id) == Some(reg.instance_id) {
                    let layout = WorkerLayout::of(&reg);
                    state
                        .args
                        .status
                        .layouts
                        .set(reg.worker_id, layout, &reg.base_url);
                }
            }
            TrackerMsg::Heartbeat(hb) => {
                let changes = state.discovery.on_heartbeat(&hb, now);
                state.apply_changes(changes, &myself).await;
            }
            TrackerMsg::Deregistration(d) => {
                let changes = state
                    .discovery
                    .on_deregistration(d.worker_id, d.instance_id);
                state.apply_changes(changes, &myself).await;
            }
            TrackerMsg::Events(batch) => state.on_events(batch, &myself).await,
            TrackerMsg::Marks(marks) => state.on_marks(marks, &myself),
            TrackerMsg::Load(report) => {
                if state.discovery.instance(report.worker_id) == Some(report.instance_id) {
                    let _ = state
                        .args
                        .scheduler
                        .send_message(SchedulerMsg::ReportedLoad(report));
                }
            }
            TrackerMsg::Snapshot {
                key,
                instance_id,
                result,
            } => state.on_snapshot(key, instance_id, result, &myself),
            TrackerMsg::Tick => {
                let changes = state.discovery.expire(now);
                if !changes.is_empty() {
                    state.apply_changes(changes, &myself).await;
                }
                state.start_due_fetches(&myself);
                state.publish_status();
                if state.args.follows_events {
                    state.check_silence(now);
                }
            }
        }
        Ok(())
    }
}

/// Starts a roll call on behalf of a model (the replica's first "who is there").
pub async fn ask_who_is_there(bus: &Bus, subjects: &ModelSubjects, replica_id: &str) {
    if let Ok(bytes) = encode(&WhoIsThere {
        replica_id: replica_id.to_string(),
    }) {
        if let Err(e) = bus
            .publish(&subjects.who_is_there(), Bytes::from(bytes))
            .await
        {
            tracing::warn!(error = %e, "cannot ask who is there");
        }
    }
}

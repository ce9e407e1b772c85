//! The fleet actor of one model: discovery, event ingest and state sync.
//!
//! It owns the [`Discovery`] and [`RankSync`] cores, writes the model's index (through its
//! shard actors) and tells the scheduler actor which worker ranks exist and how loaded their
//! engines say they are. State fetches run as tasks that report back as messages.

use crate::discovery::{Change, Discovery};
use crate::metrics::{Metrics, ModelLabels};
use crate::rank_sync::{EventOutcome, RankSync};
use crate::scheduler_actor::SchedulerMsg;
use crate::state::ModelStatus;
use bytes::Bytes;
use kvrouter_bus::Bus;
use kvrouter_indexer::{block_limit_for_capacity, RankDump, ShardedIndex};
use kvrouter_protocol::{
    decode, encode, Deregistration, EventId, Heartbeat, KvEvent, KvEventBatch, LoadReport,
    ModelSubjects, Registration, Reply, StateChunk, StateQuery, WhoIsThere, WorkerKey,
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
/// Wait before retrying a failed state fetch; doubled by each further failure in a row.
const FETCH_RETRY: Duration = Duration::from_millis(500);
/// The longest wait between retries of one rank's fetch.
const FETCH_RETRY_MAX: Duration = Duration::from_secs(8);

/// Wait before the next fetch of a rank whose last `failures` fetches failed (≥ 1): 0.5 s,
/// doubling, at most [`FETCH_RETRY_MAX`], so a worker whose state endpoint is broken is not
/// asked (and logged) twice a second forever.
fn fetch_retry_delay(failures: u32) -> Duration {
    FETCH_RETRY
        .saturating_mul(1 << failures.saturating_sub(1).min(5))
        .min(FETCH_RETRY_MAX)
}

pub enum FleetMsg {
    Registration(Registration),
    Heartbeat(Heartbeat),
    Deregistration(Deregistration),
    Events(KvEventBatch),
    Load(LoadReport),
    /// A state fetch finished.
    Snapshot {
        key: WorkerKey,
        instance_id: Uuid,
        result: Result<(Option<EventId>, Vec<KvEvent>), String>,
    },
    /// The index saw an event-id gap that event ingest did not (a safety net).
    IndexGap(WorkerKey),
    Tick,
}

pub struct FleetArgs {
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
    /// Approximate mode: no KV events and no state fetches; a rank is synced once it joins.
    pub no_kv_events: bool,
}

pub struct FleetState {
    args: FleetArgs,
    labels: ModelLabels,
    discovery: Discovery,
    sync: RankSync,
    /// Fetches waiting for a retry: (key, not before).
    retries: Vec<(WorkerKey, Instant)>,
    /// Failed fetches in a row, per rank (cleared when one succeeds or the rank leaves).
    fetch_failures: FxHashMap<WorkerKey, u32>,
    last_roll_call: Option<Instant>,
}

pub struct FleetActor;

impl FleetState {
    fn metrics<R>(&self, f: impl FnOnce(&Metrics) -> R) -> R {
        f(&self.args.metrics)
    }

    /// Publishes the counts readiness and metrics read.
    fn publish_status(&self) {
        let st = &self.args.status;
        let ranks = self.discovery.keys().count();
        st.ranks.store(ranks, Ordering::Relaxed);
        st.unsynced.store(self.sync.unsynced(), Ordering::Relaxed);
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

    fn start_fetch(&mut self, key: WorkerKey, myself: &ActorRef<FleetMsg>) {
        self.sync.start_fetch(key);
        self.retries.retain(|(k, _)| *k != key);
        let Some(instance_id) = self.discovery.instance(key.worker_id) else {
            return;
        };
        tracing::debug!(model = %self.args.model, worker = key.worker_id, dp_rank = key.dp_rank, "fetching rank state");
        let bus = self.args.bus.clone();
        let subject = self.args.subjects.state(key.worker_id);
        let timeout = self.args.fetch_timeout;
        let myself = myself.clone();
        tokio::spawn(async move {
            let result = fetch_state(&bus, &subject, key, instance_id, timeout).await;
            let _ = myself.send_message(FleetMsg::Snapshot {
                key,
                instance_id,
                result,
            });
        });
    }

    async fn apply_changes(&mut self, changes: Vec<Change>, myself: &ActorRef<FleetMsg>) {
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
                    let _ = self.args.scheduler.send_message(SchedulerMsg::AddKey {
                        key,
                        capacity_blocks,
                        block_size: self.discovery.block_size(),
                    });
                    if !self.args.no_kv_events {
                        self.start_fetch(key, myself);
                    }
                }
                Change::RankRemoved(key) => {
                    tracing::info!(%model, worker = key.worker_id, dp_rank = key.dp_rank, "worker rank left");
                    self.sync.remove(key);
                    self.retries.retain(|(k, _)| *k != key);
                    self.fetch_failures.remove(&key);
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
                    self.retries.retain(|(k, _)| k.worker_id != worker_id);
                    self.fetch_failures.retain(|k, _| k.worker_id != worker_id);
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
                Change::Unknown { worker_id } => {
                    tracing::debug!(%model, worker = worker_id, "message from an unregistered worker; asking who is there");
                    self.roll_call(false).await;
                }
            }
        }
        self.publish_status();
    }

    async fn on_events(&mut self, batch: KvEventBatch, myself: &ActorRef<FleetMsg>) {
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
        if !apply.is_empty() {
            if let Err(e) = self.args.index.apply_batch(apply) {
                tracing::error!(model = %self.args.model, error = %e, "index shard unavailable");
            }
        }
        let gap_count = gaps.len() as u64;
        for key in gaps {
            self.start_fetch(key, myself);
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

    async fn on_snapshot(
        &mut self,
        key: WorkerKey,
        instance_id: Uuid,
        result: Result<(Option<EventId>, Vec<KvEvent>), String>,
    ) {
        if self.discovery.instance(key.worker_id) != Some(instance_id)
            || !self.discovery.has_key(key)
        {
            return; // the rank or its instance is gone; a newer fetch is (or is not) under way
        }
        let (last_event_id, events) = match result {
            Ok(v) => v,
            Err(e) => {
                let failures = self.fetch_failures.entry(key).or_insert(0);
                *failures += 1;
                let (failures, wait) = (*failures, fetch_retry_delay(*failures));
                // Logged on the 1st, 2nd, 4th, 8th... failure in a row.
                if failures.is_power_of_two() {
                    tracing::warn!(model = %self.args.model, worker = key.worker_id, dp_rank = key.dp_rank, error = %e, failures, retry_in_ms = wait.as_millis() as u64, "rank state fetch failed; retrying");
                } else {
                    tracing::debug!(model = %self.args.model, worker = key.worker_id, dp_rank = key.dp_rank, error = %e, failures, "rank state fetch failed again");
                }
                self.metrics(|m| m.recovery_failures.get_or_create(&self.labels).inc());
                self.retries.push((key, Instant::now() + wait));
                return;
            }
        };
        let Some(after) = self.sync.on_snapshot(key, last_event_id) else {
            return;
        };
        let dump = RankDump {
            key,
            last_event_id,
            events,
        };
        if let Err(e) = self.args.index.load_rank(dump).await {
            tracing::warn!(model = %self.args.model, worker = key.worker_id, error = %e, "rank state partly refused by the index");
        }
        if !after.apply.is_empty() {
            let _ = self.args.index.apply_batch(after.apply);
        }
        self.metrics(|m| m.recoveries.get_or_create(&self.labels).inc());
        let failed_before = self.fetch_failures.remove(&key).unwrap_or(0);
        tracing::info!(model = %self.args.model, worker = key.worker_id, dp_rank = key.dp_rank, ?last_event_id, failed_before, "rank state synced");
        if after.refetch {
            self.retries.push((key, Instant::now()));
        }
        self.publish_status();
    }
}

/// Fetches one rank's state as a stream of chunks.
async fn fetch_state(
    bus: &Bus,
    subject: &str,
    key: WorkerKey,
    instance_id: Uuid,
    timeout: Duration,
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
        events.extend(chunk.events.into_iter().filter(|e| e.key == key));
    }
    if chunks == 0 {
        return Err("the worker sent no state".into());
    }
    Ok((last, events))
}

impl Actor for FleetActor {
    type Msg = FleetMsg;
    type State = FleetState;
    type Arguments = FleetArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<FleetMsg>,
        args: FleetArgs,
    ) -> Result<FleetState, ActorProcessingErr> {
        myself.send_interval(TICK, || FleetMsg::Tick);
        Ok(FleetState {
            labels: Metrics::model(&args.model),
            discovery: Discovery::new(&args.model, args.block_size, args.lease),
            sync: RankSync::default(),
            retries: Vec::new(),
            fetch_failures: FxHashMap::default(),
            last_roll_call: None,
            args,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<FleetMsg>,
        msg: FleetMsg,
        state: &mut FleetState,
    ) -> Result<(), ActorProcessingErr> {
        let now = Instant::now();
        match msg {
            FleetMsg::Registration(reg) => {
                let changes = state.discovery.on_registration(&reg, now);
                state.apply_changes(changes, &myself).await;
                if state.discovery.instance(reg.worker_id) == Some(reg.instance_id) {
                    let layout = crate::disagg::WorkerLayout::of(&reg);
                    state.args.status.layouts.set(reg.worker_id, layout);
                }
            }
            FleetMsg::Heartbeat(hb) => {
                let changes = state.discovery.on_heartbeat(&hb, now);
                state.apply_changes(changes, &myself).await;
            }
            FleetMsg::Deregistration(d) => {
                let changes = state
                    .discovery
                    .on_deregistration(d.worker_id, d.instance_id);
                state.apply_changes(changes, &myself).await;
            }
            FleetMsg::Events(batch) => state.on_events(batch, &myself).await,
            FleetMsg::Load(report) => {
                if state.discovery.instance(report.worker_id) == Some(report.instance_id) {
                    let _ = state
                        .args
                        .scheduler
                        .send_message(SchedulerMsg::ReportedLoad(report));
                }
            }
            FleetMsg::Snapshot {
                key,
                instance_id,
                result,
            } => state.on_snapshot(key, instance_id, result).await,
            FleetMsg::IndexGap(key) => {
                if state.sync.is_synced(key) {
                    state.start_fetch(key, &myself);
                    state.publish_status();
                }
            }
            FleetMsg::Tick => {
                let changes = state.discovery.expire(now);
                if !changes.is_empty() {
                    state.apply_changes(changes, &myself).await;
                }
                let due: Vec<WorkerKey> = state
                    .retries
                    .iter()
                    .filter(|(_, t)| *t <= now)
                    .map(|(k, _)| *k)
                    .collect();
                for key in due {
                    if state.discovery.has_key(key) {
                        state.start_fetch(key, &myself);
                    } else {
                        state.retries.retain(|(k, _)| *k != key);
                    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fetch_retries_back_off_to_a_cap() {
        let ms = |n| fetch_retry_delay(n).as_millis();
        assert_eq!(
            (1..=7).map(ms).collect::<Vec<_>>(),
            vec![500, 1000, 2000, 4000, 8000, 8000, 8000]
        );
        assert_eq!(fetch_retry_delay(u32::MAX), FETCH_RETRY_MAX);
    }
}

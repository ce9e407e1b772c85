//! The scheduler actor of one model: owns its [`Scheduler`] core.
//!
//! Route requests arrive already hashed and with their overlaps (the endpoint reads the index
//! directly), so a decision costs one actor hop. Requests that find every worker busy wait in
//! the core's bounded queue with their reply channel and are answered when load drops.

use crate::metrics::{KeyLabels, Metrics, ModelLabels};
use kvrouter_protocol::{ErrorKind, ErrorReply, LoadReport, SequenceHash, WorkerId, WorkerKey};
use kvrouter_scheduler::{
    PotentialLoad, Queued, ReportedLoad, RouteQuery, ScheduleError, Scheduler, SchedulerConfig,
    Selection,
};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use rustc_hash::FxHashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// How often timed-out requests are swept and load gauges refreshed.
const TICK: Duration = Duration::from_millis(500);

pub type RouteReply = oneshot::Sender<Result<Selection, ErrorReply>>;

/// A route request, hashed and scored against the index, with its reply channel: the same
/// value waits in the core's queue when every worker is busy.
pub type RouteJob = Queued<RouteReply>;

pub enum SchedulerMsg {
    Route(RouteJob),
    /// Replies whether the request was known.
    MarkPrefill(String, oneshot::Sender<bool>),
    Free(String, oneshot::Sender<bool>),
    PotentialLoads {
        prompt_tokens: usize,
        sequence_hashes: Vec<SequenceHash>,
        overlaps: Vec<(WorkerKey, u32)>,
        reply: oneshot::Sender<Vec<PotentialLoad>>,
    },
    AddKey {
        key: WorkerKey,
        capacity_blocks: u64,
    },
    RemoveKey(WorkerKey),
    RemoveWorker(WorkerId),
    ReportedLoad(LoadReport),
    /// Answers every queued request with `Unavailable` (shutdown).
    RejectQueued,
    Tick,
}

/// Maps a scheduling failure to the error a client sees.
pub fn schedule_error_reply(e: &ScheduleError) -> ErrorReply {
    let kind = match e {
        ScheduleError::NoWorkers => ErrorKind::NoWorkers,
        ScheduleError::NoAllowedWorkers => ErrorKind::NoAllowedWorkers,
        ScheduleError::UnknownWorker(_) => ErrorKind::UnknownWorker,
        ScheduleError::InvalidRank { .. } => ErrorKind::InvalidRank,
        ScheduleError::AllBusy | ScheduleError::Overloaded { .. } => ErrorKind::Overloaded,
        ScheduleError::DuplicateRequest(_) => ErrorKind::DuplicateRequest,
        ScheduleError::QueueTimeout => ErrorKind::QueueTimeout,
        ScheduleError::InvalidConfig(_) => ErrorKind::Internal,
    };
    ErrorReply::new(kind, e.to_string())
}

pub struct SchedulerArgs {
    pub model: String,
    pub config: SchedulerConfig,
    pub metrics: Arc<Metrics>,
}

pub struct SchedulerState {
    core: Scheduler<RouteReply>,
    model: String,
    labels: ModelLabels,
    metrics: Arc<Metrics>,
    /// Keys whose load series exist, so departed ones can be dropped.
    exported: FxHashSet<WorkerKey>,
}

impl SchedulerState {
    fn route(&mut self, job: RouteJob, now: Instant) {
        let result = self.core.route(
            &job.query(),
            &job.overlaps,
            job.request_id.clone(),
            job.update_states,
            now,
        );
        match result {
            Err(ScheduleError::AllBusy) => {
                if let Err(full) = self.core.enqueue(job) {
                    let reply = schedule_error_reply(&full.error());
                    let _ = full.into_token().send(Err(reply));
                }
            }
            other => {
                let _ = job.token.send(other.map_err(|e| schedule_error_reply(&e)));
            }
        }
    }

    /// Answers queued requests that can be placed now (or that failed meanwhile).
    fn drain(&mut self, now: Instant) {
        if self.core.queue_len() == 0 {
            return;
        }
        for (reply, result) in self.core.drain_ready(now) {
            let _ = reply.send(result.map_err(|e| schedule_error_reply(&e)));
        }
    }

    fn forget(&mut self, key: WorkerKey) {
        if self.exported.remove(&key) {
            self.metrics.forget_key(&self.model, key);
        }
    }

    fn export_loads(&mut self) {
        let m = &self.metrics;
        for (key, load) in self.core.loads() {
            let labels = KeyLabels::new(&self.model, key);
            m.active_blocks
                .get_or_create(&labels)
                .set(load.active_blocks as i64);
            m.prefill_tokens
                .get_or_create(&labels)
                .set(load.prefill_tokens as i64);
            m.active_requests
                .get_or_create(&labels)
                .set(load.active_requests as i64);
            self.exported.insert(key);
        }
        m.queued_requests
            .get_or_create(&self.labels)
            .set(self.core.queue_len() as i64);
    }
}

pub struct SchedulerActor;

impl Actor for SchedulerActor {
    type Msg = SchedulerMsg;
    type State = SchedulerState;
    type Arguments = SchedulerArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<SchedulerMsg>,
        args: SchedulerArgs,
    ) -> Result<SchedulerState, ActorProcessingErr> {
        let core = Scheduler::new(args.config)?;
        myself.send_interval(TICK, || SchedulerMsg::Tick);
        Ok(SchedulerState {
            core,
            labels: Metrics::model(&args.model),
            model: args.model,
            metrics: args.metrics,
            exported: FxHashSet::default(),
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<SchedulerMsg>,
        msg: SchedulerMsg,
        state: &mut SchedulerState,
    ) -> Result<(), ActorProcessingErr> {
        let now = Instant::now();
        match msg {
            SchedulerMsg::Route(job) => state.route(job, now),
            SchedulerMsg::MarkPrefill(id, reply) => {
                let _ = reply.send(state.core.mark_prefill(&id));
                state.drain(now);
            }
            SchedulerMsg::Free(id, reply) => {
                let _ = reply.send(state.core.free(&id));
                state.drain(now);
            }
            SchedulerMsg::PotentialLoads {
                prompt_tokens,
                sequence_hashes,
                overlaps,
                reply,
            } => {
                let query = RouteQuery::new(prompt_tokens, &sequence_hashes);
                let _ = reply.send(state.core.potential_loads(&query, &overlaps));
            }
            SchedulerMsg::AddKey {
                key,
                capacity_blocks,
            } => {
                state.core.add_worker_key(key, capacity_blocks);
                state.drain(now);
                state.export_loads();
            }
            SchedulerMsg::RemoveKey(key) => {
                state.core.remove_worker_key(key);
                state.forget(key);
                state.drain(now);
            }
            SchedulerMsg::RemoveWorker(worker_id) => {
                state.core.remove_worker(worker_id);
                let gone: Vec<WorkerKey> = state
                    .exported
                    .iter()
                    .filter(|k| k.worker_id == worker_id)
                    .copied()
                    .collect();
                for key in gone {
                    state.forget(key);
                }
                state.drain(now);
            }
            SchedulerMsg::ReportedLoad(report) => {
                for r in &report.ranks {
                    state.core.set_reported_load(
                        WorkerKey::new(report.worker_id, r.dp_rank),
                        ReportedLoad {
                            active_blocks: r.active_blocks,
                            waiting_requests: r.waiting_requests,
                        },
                    );
                }
                state.drain(now);
            }
            SchedulerMsg::RejectQueued => {
                for q in state.core.take_queued() {
                    let _ = q.token.send(Err(ErrorReply::new(
                        ErrorKind::Unavailable,
                        "the replica is shutting down; retry on another replica",
                    )));
                }
            }
            SchedulerMsg::Tick => {
                state.core.sweep(now);
                state.drain(now);
                state.export_loads();
            }
        }
        Ok(())
    }
}

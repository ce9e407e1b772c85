//! The scheduler actor of one model: owns its [`Scheduler`] core.
//!
//! Route requests arrive already hashed and with their overlaps (the endpoint reads the index
//! directly), so a decision costs one actor hop. Requests that find every worker busy wait in
//! the core's bounded queue with their reply channel and are answered when load drops.

use crate::abandoned::Abandoned;
use crate::metrics::{KeyLabels, Metrics, ModelLabels};
use crate::replica_sync::{self, ReplicaSync, SeqCheck};
use kvrouter_indexer::OverlapScores;
use kvrouter_protocol::{
    ErrorKind, ErrorReply, Lease, LoadReport, SeqChange, SequenceHash, SyncBatch, WorkerId,
    WorkerKey,
};
use kvrouter_scheduler::{
    KeyLoad, PotentialLoad, Queued, ReportedLoad, RouteQuery, ScheduleError, Scheduler,
    SchedulerConfig, Selection,
};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use rustc_hash::FxHashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// How often timed-out requests are swept and load gauges refreshed.
const TICK: Duration = Duration::from_millis(500);

pub type RouteReply = oneshot::Sender<Result<Selection, ErrorReply>>;

/// What a queued request carries besides its data: where to answer, and (for replica sync)
/// its id, to announce the decision once it is placed.
pub struct RouteToken {
    pub reply: RouteReply,
    pub request_id: String,
    /// The caller's route call (0: none), to turn away a copy of an abandoned one.
    pub call_id: u64,
    /// The call's lease: only an abandon under it turns the call away.
    pub lease: Lease,
}

/// Who asks to mark, extend or free a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Asker {
    /// This replica's own bookkeeping (disaggregation, KV transfers).
    Replica,
    /// A caller presenting this lease (from the request's route decision).
    Holder(Lease),
}

/// What became of an update: done, or why not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Held {
    Done,
    /// Not an active request here.
    Unknown,
    /// Active, under another lease than the one presented (refused, counted).
    WrongLease,
}

/// A route request, hashed and scored against the index, with its reply channel: the same
/// value waits in the core's queue when every worker is busy.
pub type RouteJob = Queued<RouteToken>;

/// A route job with no filter (set its `filters` as needed), and
/// where its answer will arrive.
pub fn route_job(
    request_id: String,
    prompt_tokens: usize,
    sequence_hashes: Vec<kvrouter_protocol::SequenceHash>,
    overlaps: OverlapScores,
    update_states: bool,
) -> (RouteJob, oneshot::Receiver<Result<Selection, ErrorReply>>) {
    let (tx, rx) = oneshot::channel();
    let job = RouteJob {
        request_id,
        prompt_tokens,
        sequence_hashes,
        filters: Default::default(),
        overrides: Default::default(),
        overlaps: overlaps.scores,
        lower_tiers: overlaps.tiers,
        shared_blocks: overlaps.shared_blocks,
        update_states,
        priority_jump: 0.0,
        expected_output_tokens: None,
        lease: Lease::NONE,
        fallbacks: 0,
        enqueued_at: crate::clock::now(),
        order: 0.0, // set by the scheduler's queue policy if it is queued
        token: RouteToken {
            reply: tx,
            request_id: String::new(),
            call_id: 0,
            lease: Lease::NONE,
        },
    };
    (job, rx)
}

/// Peers' sync batches waiting for one model's scheduler actor. The sync listener puts them
/// here rather than in the mailbox, so a decision first applies every batch that has
/// arrived, even one that arrived behind queued route requests: otherwise a replica handed
/// part of a burst routes its whole share before it sees any of its peers' shares, and
/// they all pile onto the same workers.
#[derive(Default)]
pub struct PeerInbox(parking_lot::Mutex<Vec<SyncBatch>>);

impl PeerInbox {
    /// Queues a batch; true if the inbox was empty (the actor then needs a
    /// [`SchedulerMsg::PeerBatches`] to wake it).
    pub fn push(&self, batch: SyncBatch) -> bool {
        let mut q = self.0.lock();
        q.push(batch);
        q.len() == 1
    }

    fn take(&self) -> Vec<SyncBatch> {
        std::mem::take(&mut *self.0.lock())
    }
}

/// Where replica sync sends this replica's changes (a task publishes them in order).
pub struct SyncLink {
    pub out: tokio::sync::mpsc::UnboundedSender<Vec<SeqChange>>,
    /// Where peers' batches arrive.
    pub inbox: Arc<PeerInbox>,
    /// Buffer peers' changes until the catch-up snapshot arrives.
    pub catch_up: bool,
    /// How long guesses of peers' simultaneous decisions count (the core's peer echo).
    pub echo_window: Duration,
    /// Peers to fetch own requests from again, after one of their batches was lost (the
    /// answer comes back as [`SchedulerMsg::PeerResync`]).
    pub resync: tokio::sync::mpsc::UnboundedSender<String>,
    /// The publisher's last batch number.
    pub published: Arc<std::sync::atomic::AtomicU64>,
}

// Route is nearly every message, so the mailbox's slots are its size whatever the rest;
// boxing it would only add an allocation per decision.
#[allow(clippy::large_enum_variant)]
pub enum SchedulerMsg {
    Route(RouteJob),
    /// Replies whether it was done (the request known, the asker its lease holder).
    MarkPrefill(String, Asker, oneshot::Sender<Held>),
    Free(String, Asker, oneshot::Sender<Held>),
    /// The caller of a route call kept another replica's answer (or none): drop ours (if
    /// booked under its lease), now and if a copy of the call arrives later
    /// ([`kvrouter_protocol::Abandon`]).
    Abandon {
        request_id: String,
        call_id: u64,
        lease: Lease,
    },
    /// `add_output_block`: replies whether it was done.
    OutputBlock {
        request_id: String,
        decay_fraction: Option<f64>,
        asker: Asker,
        reply: oneshot::Sender<Held>,
    },
    PotentialLoads {
        prompt_tokens: usize,
        sequence_hashes: Vec<SequenceHash>,
        overlaps: OverlapScores,
        reply: oneshot::Sender<Vec<PotentialLoad>>,
    },
    AddKey {
        key: WorkerKey,
        capacity_blocks: u64,
        /// The model's block size as discovery knows it (the first worker's, unless
        /// configured): the cost counts blocks of that size.
        block_size: Option<u32>,
    },
    RemoveKey(WorkerKey),
    RemoveWorker(WorkerId),
    ReportedLoad(LoadReport),
    /// Answers every queued request with `Unavailable` (shutdown).
    RejectQueued,
    /// Replica sync: peers' changes wait in the [`PeerInbox`] (this only wakes the actor),
    /// the catch-up snapshot, and a request for ours.
    PeerBatches,
    PeerSnapshot(Vec<SeqChange>),
    /// A peer's own requests, fetched again after one of its batches was lost, with the
    /// last batch the answer covers (`None`: it did not answer).
    PeerResync {
        peer: String,
        answer: Option<(u64, Vec<SeqChange>)>,
    },
    /// Active sequences as `Add`s: all of them, or those `origin` routed; with the last
    /// sync batch number given out so far (what the answer covers).
    ExportActive {
        origin: Option<String>,
        reply: oneshot::Sender<(u64, Vec<SeqChange>)>,
    },
    /// Every live worker key's load as the scheduler counts it (the JSON API's workers).
    Loads(oneshot::Sender<Vec<(WorkerKey, KeyLoad)>>),
    Tick,
}

/// The answer to a copy of an abandoned call (its caller no longer listens).
fn abandoned_reply() -> ErrorReply {
    ErrorReply::new(
        ErrorKind::Unavailable,
        "this route call was abandoned by its caller (it kept another replica's answer)",
    )
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
    pub replica_id: String,
    pub config: SchedulerConfig,
    pub metrics: Arc<Metrics>,
    pub sync: Option<SyncLink>,
}

pub struct SchedulerState {
    core: Scheduler<RouteToken>,
    /// Request ids in the core are global (`"{replica}:{request}"`), so peers' requests
    /// never collide with ours.
    ids: ReplicaSync,
    sync_out: Option<tokio::sync::mpsc::UnboundedSender<Vec<SeqChange>>>,
    resync: Option<tokio::sync::mpsc::UnboundedSender<String>>,
    published: Option<Arc<std::sync::atomic::AtomicU64>>,
    inbox: Option<Arc<PeerInbox>>,
    model: String,
    labels: ModelLabels,
    metrics: Arc<Metrics>,
    /// Keys whose load series exist, so departed ones can be dropped.
    exported: FxHashSet<WorkerKey>,
    echo_window: Duration,
    /// Route calls whose callers went elsewhere, by global request id.
    abandoned: Abandoned,
    /// What `ids` had refused when last counted in `kvrouter_replica_sync_refused_total`.
    sync_refused: [u64; 4],
}

impl SchedulerState {
    fn route(&mut self, mut job: RouteJob, now: Instant) {
        job.request_id = self.ids.global_id(&job.request_id);
        job.token.request_id.clone_from(&job.request_id);
        job.token.lease = job.lease;
        if job.update_states && self.is_abandoned(&job.token, now) {
            let _ = job.token.reply.send(Err(abandoned_reply()));
            return;
        }
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
                    let _ = full.into_token().reply.send(Err(reply));
                }
            }
            other => self.answer(job.token, other),
        }
    }

    /// Sends a decision to its route endpoint and tells peers about it; a request placed
    /// for an endpoint that is gone (its task ended) is freed at once, not left as load
    /// nobody will free.
    fn answer(&mut self, token: RouteToken, result: Result<Selection, ScheduleError>) {
        let placed = result.is_ok();
        // Queued while its caller abandoned it.
        if placed && self.is_abandoned(&token, crate::clock::now()) {
            self.core.free(&token.request_id);
            let _ = token.reply.send(Err(abandoned_reply()));
            return;
        }
        let delivered = token
            .reply
            .send(result.map_err(|e| schedule_error_reply(&e)))
            .is_ok();
        if placed {
            if delivered {
                self.announce(&token.request_id);
            } else if self.core.free(&token.request_id) {
                tracing::debug!(model = %self.model, request_id = %token.request_id, "placed a request whose caller is gone: freed");
            }
        }
    }

    /// Tells peers about our requests the core dropped by itself (replica sync).
    fn tell_dropped(&mut self, global_ids: &[String]) {
        if self.sync_out.is_some() {
            for id in global_ids {
                self.ids.dropped_global(id);
            }
        }
    }

    /// Whether the call is a copy of one its caller abandoned (counted and logged if so).
    fn is_abandoned(&mut self, token: &RouteToken, now: Instant) -> bool {
        if !self
            .abandoned
            .contains(&token.request_id, token.call_id, token.lease, now)
        {
            return false;
        }
        tracing::info!(model = %self.model, request_id = %token.request_id, "a route call arrived after its caller abandoned it (it asked another replica): not booked");
        self.metrics
            .routes_abandoned
            .get_or_create(&self.labels)
            .inc();
        true
    }

    /// Drops our booking of an abandoned call (and of its prefill half) if held under the
    /// abandon's lease, and remembers the call so a late copy of it is turned away.
    fn abandon(&mut self, request_id: &str, call_id: u64, lease: Lease, now: Instant) {
        self.abandoned
            .insert(&self.ids.global_id(request_id), call_id, lease, now);
        let mut freed = 0;
        for local in [
            request_id.to_string(),
            kvrouter_protocol::prefill_request_id(request_id),
        ] {
            let global = self.ids.global_id(&local);
            if self.held(&global, Asker::Holder(lease), "abandon") == Held::Done
                && self.core.free(&global)
            {
                freed += 1;
                if self.sync_out.is_some() {
                    self.ids.freed(&local);
                }
            }
        }
        if freed > 0 {
            tracing::info!(model = %self.model, request_id, "route booked for a caller that went elsewhere (its answer came too late or was lost): freed");
            self.metrics
                .routes_abandoned
                .get_or_create(&self.labels)
                .inc();
            self.drain(now);
        }
    }

    /// Whether `asker` may act on the request `global_id` (a refusal is counted and logged).
    fn held(&self, global_id: &str, asker: Asker, endpoint: &'static str) -> Held {
        let presented = match asker {
            Asker::Replica => Lease::NONE,
            Asker::Holder(lease) => lease,
        };
        match self.core.lease_admits(global_id, presented) {
            None => Held::Unknown,
            Some(true) => Held::Done,
            Some(false) if asker == Asker::Replica => Held::Done,
            Some(false) => {
                tracing::info!(model = %self.model, request_id = %global_id, endpoint, "refused: the caller does not hold the request's lease");
                self.metrics
                    .lease_refused
                    .get_or_create(&crate::metrics::EndpointLabels {
                        model: self.labels.model.clone(),
                        endpoint,
                    })
                    .inc();
                Held::WrongLease
            }
        }
    }

    /// Tells peers about a request the core just added (replica sync).
    fn announce(&mut self, global_id: &str) {
        if self.sync_out.is_none() {
            return;
        }
        let found = self
            .core
            .active_sequence(global_id)
            .map(|(key, hashes, prefill)| (key, hashes.to_vec(), prefill));
        if let Some((key, hashes, prefill)) = found {
            let output = self.core.output_blocks(global_id).unwrap_or(0);
            self.ids
                .added_global(global_id, key, hashes, prefill, output);
        }
    }

    /// Answers queued requests that can be placed now (or that failed meanwhile).
    fn drain(&mut self, now: Instant) {
        if self.core.queue_len() == 0 {
            return;
        }
        for (token, result) in self.core.drain_ready(now) {
            self.answer(token, result);
        }
    }

    /// Applies every peer batch that has arrived, in arrival order.
    fn apply_inbox(&mut self, now: Instant) {
        let Some(inbox) = &self.inbox else { return };
        for mut batch in inbox.take() {
            match self
                .ids
                .check_seq(&batch.replica_id, batch.instance_id, batch.seq)
            {
                SeqCheck::InOrder => {}
                SeqCheck::Restarted { unheard } => {
                    let dropped = self.drop_requests_of(&batch.replica_id);
                    tracing::info!(model = %self.model, peer = %batch.replica_id, dropped_sequences = dropped, "peer replica restarted: the sequences of its previous instance are dropped");
                    if unheard {
                        self.ids.start_resync(&batch.replica_id);
                        self.send_fetches();
                    }
                }
                SeqCheck::Unheard => {
                    tracing::debug!(model = %self.model, peer = %batch.replica_id, "first heard from a peer mid-sequence: fetching its active sequences");
                    self.ids.start_resync(&batch.replica_id);
                    self.send_fetches();
                }
                // Applied already; it still shows the peer is alive.
                SeqCheck::Stale => batch.changes.clear(),
                SeqCheck::Lost { missed } => {
                    self.metrics
                        .sync_batches_lost
                        .get_or_create(&self.labels)
                        .inc_by(missed);
                    tracing::warn!(model = %self.model, peer = %batch.replica_id, missed, "lost replica-sync batches from a peer: fetching its active sequences again");
                    self.ids.start_resync(&batch.replica_id);
                    self.send_fetches();
                }
            }
            let (changes, new_peer) = self
                .ids
                .on_peer_batch(&batch.replica_id, batch.changes, now);
            if new_peer {
                tracing::info!(model = %self.model, peer = %batch.replica_id, "peer replica live");
                self.update_echo();
            }
            self.apply_peer(changes, now);
        }
    }

    /// Asks the resync task for the peers' own requests `ids` wants fetched again.
    fn send_fetches(&mut self) {
        for peer in self.ids.take_fetches() {
            if let Some(tx) = &self.resync {
                let _ = tx.send(peer);
            }
        }
    }

    /// Applies peers' changes (idempotent: see `replica_sync`), then retries the queue.
    fn apply_peer(&mut self, changes: Vec<SeqChange>, now: Instant) {
        replica_sync::apply_changes(&mut self.core, changes, now);
        self.count_sync_refusals();
        self.drain(now);
    }

    /// Adds what the sync core refused since last time to its counters.
    fn count_sync_refusals(&mut self) {
        let now = [
            self.ids.dropped(),
            self.ids.refused(),
            self.ids.foreign(),
            self.ids.jumps(),
        ];
        const REASONS: [&str; 4] = ["buffer_full", "id_too_long", "not_its_own", "sequence_jump"];
        for ((reason, seen), total) in REASONS.into_iter().zip(&mut self.sync_refused).zip(now) {
            if total > *seen {
                self.metrics
                    .sync_refused
                    .get_or_create(&crate::metrics::ReasonLabels {
                        model: self.labels.model.clone(),
                        reason,
                    })
                    .inc_by(total - *seen);
                *seen = total;
            }
        }
    }

    /// Sends this replica's pending changes to the sync publisher (an empty batch keeps
    /// an idle replica live for its peers).
    fn flush_sync(&mut self, now: Instant) {
        if let Some(out) = &self.sync_out {
            let _ = out.send(self.ids.take_outgoing(now));
        }
    }

    /// A peer joined or left: the core's peer echo follows the number of live peers.
    fn update_echo(&mut self) {
        let peers = self.ids.live_peers();
        let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        self.core.set_peer_echo(
            count(peers),
            count(self.ids.live_peers_ahead()),
            self.echo_window,
        );
        self.metrics
            .sync_peers
            .get_or_create(&self.labels)
            .set(peers as i64);
    }

    /// Frees every active sequence `peer` routed (it is gone, or a new instance of it is
    /// here); returns how many.
    fn drop_requests_of(&mut self, peer: &str) -> usize {
        let ids: Vec<String> = self
            .core
            .active_sequences()
            .filter(|(id, ..)| ReplicaSync::is_from(id, peer))
            .map(|(id, ..)| id.clone())
            .collect();
        for id in &ids {
            self.core.free(id);
        }
        ids.len()
    }

    /// Drops peers silent past their lease, with the sequences they routed.
    fn expire_peers(&mut self, now: Instant) {
        let gone = self.ids.expire_peers(now);
        if gone.is_empty() {
            return;
        }
        for peer in &gone {
            let dropped = self.drop_requests_of(peer);
            tracing::warn!(model = %self.model, peer = %peer, dropped_sequences = dropped, "peer replica silent past its lease: its active sequences are dropped");
            self.metrics
                .sync_peers_lost
                .get_or_create(&self.labels)
                .inc();
        }
        self.update_echo();
        self.drain(now);
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
        let catch_up = args.sync.as_ref().is_some_and(|s| s.catch_up);
        let echo_window = args.sync.as_ref().map_or(Duration::ZERO, |s| s.echo_window);
        Ok(SchedulerState {
            core,
            ids: ReplicaSync::new(&args.replica_id, catch_up),
            inbox: args.sync.as_ref().map(|s| s.inbox.clone()),
            resync: args.sync.as_ref().map(|s| s.resync.clone()),
            published: args.sync.as_ref().map(|s| s.published.clone()),
            sync_out: args.sync.map(|s| s.out),
            labels: Metrics::model(&args.model),
            model: args.model,
            metrics: args.metrics,
            exported: FxHashSet::default(),
            echo_window,
            abandoned: Abandoned::default(),
            sync_refused: [0; 4],
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<SchedulerMsg>,
        msg: SchedulerMsg,
        state: &mut SchedulerState,
    ) -> Result<(), ActorProcessingErr> {
        if state.inbox.is_some() && matches!(msg, SchedulerMsg::Route(_)) {
            // Peers' batches already delivered to this process may wait for their listener
            // task (on a current-thread runtime, until this actor has routed everything
            // queued): let it run, so the decision sees them.
            tokio::task::yield_now().await;
        }
        // The clock the tick follows (virtual in the replay): echo window, timeouts, lease.
        let now = crate::clock::now();
        state.apply_inbox(now);
        match msg {
            SchedulerMsg::Route(job) => state.route(job, now),
            SchedulerMsg::MarkPrefill(id, asker, reply) => {
                let global = state.ids.global_id(&id);
                let held = state.held(&global, asker, "mark_prefill");
                if held == Held::Done {
                    state.core.mark_prefill(&global);
                    if state.sync_out.is_some() {
                        state.ids.prefilled(&id);
                    }
                }
                let _ = reply.send(held);
                state.drain(now);
            }
            SchedulerMsg::Abandon {
                request_id,
                call_id,
                lease,
            } => state.abandon(&request_id, call_id, lease, now),
            SchedulerMsg::Free(id, asker, reply) => {
                let global = state.ids.global_id(&id);
                let held = state.held(&global, asker, "free");
                if held == Held::Done {
                    state.core.free(&global);
                    if state.sync_out.is_some() {
                        state.ids.freed(&id);
                    }
                }
                let _ = reply.send(held);
                state.drain(now);
            }
            SchedulerMsg::OutputBlock {
                request_id,
                decay_fraction,
                asker,
                reply,
            } => {
                let global = state.ids.global_id(&request_id);
                let held = state.held(&global, asker, "add_output_block");
                if held == Held::Done {
                    let counted = state.core.add_output_block(&global, decay_fraction);
                    if let (Some(n), Some(_)) = (counted, &state.sync_out) {
                        state.ids.output(&request_id, n);
                    }
                }
                let _ = reply.send(held);
            }
            SchedulerMsg::PotentialLoads {
                prompt_tokens,
                sequence_hashes,
                overlaps,
                reply,
            } => {
                let query = RouteQuery {
                    lower_tiers: &overlaps.tiers,
                    shared_blocks: overlaps.shared_blocks,
                    ..RouteQuery::new(prompt_tokens, &sequence_hashes)
                };
                let _ = reply.send(state.core.potential_loads(&query, &overlaps.scores));
            }
            SchedulerMsg::AddKey {
                key,
                capacity_blocks,
                block_size,
            } => {
                if let Some(b) = block_size {
                    state.core.set_block_size(b);
                }
                state.core.add_worker_key(key, capacity_blocks);
                state.drain(now);
                state.export_loads();
            }
            SchedulerMsg::RemoveKey(key) => {
                let dropped = state.core.remove_worker_key(key);
                state.tell_dropped(&dropped);
                state.forget(key);
                state.drain(now);
            }
            SchedulerMsg::RemoveWorker(worker_id) => {
                let dropped = state.core.remove_worker(worker_id);
                state.tell_dropped(&dropped);
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
                    let key = WorkerKey::new(report.worker_id, r.dp_rank);
                    let known = state.core.set_reported_load(
                        key,
                        ReportedLoad {
                            active_blocks: r.active_blocks,
                            waiting_requests: r.waiting_requests,
                        },
                    );
                    if known {
                        let labels = KeyLabels::new(&state.model, key);
                        let m = &state.metrics;
                        m.reported_active_blocks
                            .get_or_create(&labels)
                            .set(r.active_blocks as i64);
                        m.reported_waiting_requests
                            .get_or_create(&labels)
                            .set(r.waiting_requests as i64);
                    }
                }
                state.drain(now);
            }
            // Applied above.
            SchedulerMsg::PeerBatches => {}
            SchedulerMsg::PeerSnapshot(snapshot) => {
                let core = &state.core;
                let changes = state
                    .ids
                    .on_snapshot(snapshot, now, |id| core.contains_request(id));
                state.apply_peer(changes, now);
                state.send_fetches();
            }
            SchedulerMsg::PeerResync { peer, answer } => {
                let held: Vec<String> = state
                    .core
                    .active_sequences()
                    .filter(|(id, ..)| ReplicaSync::is_from(id, &peer))
                    .map(|(id, ..)| id.clone())
                    .collect();
                let found = answer.as_ref().map(|(_, a)| a.len());
                let changes = state.ids.on_resync(&peer, answer, held);
                tracing::info!(model = %state.model, peer = %peer, sequences = ?found, "peer's active sequences fetched again");
                state.apply_peer(changes, now);
            }
            SchedulerMsg::ExportActive { origin, reply } => {
                // Read first: batches numbered after this may still hold changes older than
                // the export, and a peer applies those after it (harmless in order).
                let published = state
                    .published
                    .as_ref()
                    .map_or(0, |p| p.load(std::sync::atomic::Ordering::Relaxed));
                let all = replica_sync::export_active(&state.core, origin.as_deref());
                let _ = reply.send((published, all));
            }
            SchedulerMsg::Loads(reply) => {
                let _ = reply.send(state.core.loads().collect());
            }
            SchedulerMsg::RejectQueued => {
                for q in state.core.take_queued() {
                    let _ = q.token.reply.send(Err(ErrorReply::new(
                        ErrorKind::Unavailable,
                        "the replica is shutting down; retry on another replica",
                    )));
                }
            }
            SchedulerMsg::Tick => {
                let swept = state.core.sweep(now);
                state.tell_dropped(&swept);
                if state.sync_out.is_some() {
                    state.expire_peers(now);
                }
                state.drain(now);
                state.export_loads();
            }
        }
        // Peers see a change as soon as the message that made it is handled (a batch when
        // one message makes several, e.g. a drained queue): waiting to fill batches let
        // synced replicas pile bursts onto the same workers (docs/benchmarks.md).
        if state.ids.pending() > 0 || (state.sync_out.is_some() && state.ids.heartbeat_due(now)) {
            state.flush_sync(now);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_inbox_wakes_once_until_taken() {
        let batch = |id: &str| SyncBatch {
            replica_id: id.into(),
            model: "m".into(),
            changes: Vec::new(),
            instance_id: uuid::Uuid::nil(),
            seq: 0,
        };
        let inbox = PeerInbox::default();
        assert!(inbox.push(batch("a")));
        assert!(!inbox.push(batch("b")), "the actor is already woken");
        let got: Vec<String> = inbox.take().into_iter().map(|b| b.replica_id).collect();
        assert_eq!(got, ["a", "b"]);
        assert!(inbox.take().is_empty());
        assert!(inbox.push(batch("c")), "empty again: wake it again");
    }
}

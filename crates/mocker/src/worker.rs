//! One simulated worker on the bus: its shared state, its KV event / load publisher and its
//! endpoints (`generate`, `state`, `drop_events`). The ranks run in [`crate::rank_task`].

use crate::engine::{OutputKind, Request, SubmitError};
use crate::rank_task::{stopped, RankCmd, RankOut};
use bytes::Bytes;
use kvrouter_bus::{Bus, Message, Subscription};
use kvrouter_protocol::{
    chunk_events, decode, encode_as, max_blocks_per_batch, reply_version, DpRank, EngineKind,
    ErrorKind, ErrorReply, GenerateEvent, GenerateRequest, Heartbeat, KvEvent, KvEventBatch,
    LoadReport, ModelSubjects, RankLiveness, RankLoad, Registration, Reply, StateChunk, StateQuery,
    Wire, WorkerId, WorkerKey, WorkerRole, FORMAT_VERSION,
};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch, Notify};
use tokio::time::Instant;
use uuid::Uuid;

/// Generated tokens travel in batches of at most this many inter-token latencies...
pub(crate) const TOKEN_BATCH: usize = 16;
/// ...and wait at most this long (wall) in a batch.
pub(crate) const TOKEN_BATCH_WAIT: Duration = Duration::from_millis(20);
/// Without changes, a load report still goes out this often.
const LOAD_KEEPALIVE: Duration = Duration::from_secs(1);

/// How a prefill or decode worker's KV transfers behave.
#[derive(Copy, Clone, Debug)]
pub(crate) struct TransferConfig {
    /// Simulated time one tp rank takes to receive one prompt block.
    pub per_block: Duration,
    /// Wall time a decode worker waits for every tp rank to receive.
    pub receive_timeout: Duration,
    /// The fleet's speedup (simulated time / wall time).
    pub speedup: f64,
}

/// No tp rank silenced.
const NOT_SILENCED: u32 = u32::MAX;

/// What every task of one worker shares: identity, registration fields, live ranks, loads.
pub(crate) struct WorkerInfo {
    pub worker_id: WorkerId,
    pub instance_id: Uuid,
    pub model: String,
    pub role: WorkerRole,
    pub block_size: u32,
    pub dp_size: u32,
    pub dp_start_rank: DpRank,
    pub tp_size: u32,
    pub capacity_blocks: u64,
    pub heartbeat_interval_ms: u32,
    pub transfer: TransferConfig,
    /// The silenced tp rank (test hook), or [`NOT_SILENCED`].
    silenced_tp_rank: AtomicU32,
    live: Vec<AtomicBool>,
    loads: Mutex<Vec<RankLoad>>,
    load_dirty: AtomicBool,
    load_changed: Notify,
}

impl WorkerInfo {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        worker_id: WorkerId,
        model: String,
        role: WorkerRole,
        block_size: u32,
        dp_size: u32,
        dp_start_rank: DpRank,
        tp_size: u32,
        capacity_blocks: u64,
        heartbeat_interval_ms: u32,
        transfer: TransferConfig,
    ) -> Self {
        Self {
            worker_id,
            instance_id: Uuid::new_v4(),
            model,
            role,
            block_size,
            dp_size,
            dp_start_rank,
            tp_size,
            capacity_blocks,
            heartbeat_interval_ms,
            transfer,
            silenced_tp_rank: AtomicU32::new(NOT_SILENCED),
            live: (0..dp_size).map(|_| AtomicBool::new(true)).collect(),
            loads: Mutex::new(
                (0..dp_size)
                    .map(|i| RankLoad {
                        dp_rank: dp_start_rank + i,
                        active_blocks: 0,
                        waiting_requests: 0,
                    })
                    .collect(),
            ),
            load_dirty: AtomicBool::new(true),
            load_changed: Notify::new(),
        }
    }

    /// The tp rank that finishes no transfer (test hook).
    pub(crate) fn silenced_tp_rank(&self) -> Option<u32> {
        Some(self.silenced_tp_rank.load(Ordering::Acquire)).filter(|&tp| tp != NOT_SILENCED)
    }

    pub(crate) fn set_silenced_tp_rank(&self, tp_rank: Option<u32>) {
        self.silenced_tp_rank
            .store(tp_rank.unwrap_or(NOT_SILENCED), Ordering::Release);
    }

    /// Index of `rank` among this worker's ranks, if it is one of them.
    pub(crate) fn rank_index(&self, rank: DpRank) -> Option<usize> {
        rank.checked_sub(self.dp_start_rank)
            .filter(|&i| i < self.dp_size)
            .map(|i| i as usize)
    }

    /// Index of `rank` if it is one of this worker's ranks and live.
    pub(crate) fn live_rank_index(&self, rank: DpRank) -> Option<usize> {
        self.rank_index(rank)
            .filter(|&i| self.live[i].load(Ordering::Acquire))
    }

    /// Sets a rank live or not; returns whether that changed anything.
    pub(crate) fn set_live(&self, index: usize, live: bool) -> bool {
        self.live[index].swap(live, Ordering::AcqRel) != live
    }

    pub(crate) fn live_ranks(&self) -> Vec<DpRank> {
        self.live
            .iter()
            .enumerate()
            .filter(|(_, l)| l.load(Ordering::Acquire))
            .map(|(i, _)| self.dp_start_rank + i as u32)
            .collect()
    }

    pub(crate) fn registration(&self) -> Registration {
        Registration {
            worker_id: self.worker_id,
            instance_id: self.instance_id,
            model: self.model.clone(),
            role: self.role,
            block_size: self.block_size,
            dp_size: self.dp_size,
            dp_start_rank: self.dp_start_rank,
            live_ranks: self.live_ranks(),
            tp_size: self.tp_size,
            capacity_blocks: self.capacity_blocks,
            heartbeat_interval_ms: self.heartbeat_interval_ms,
            engine: EngineKind::Mocker,
            base_url: String::new(),
        }
    }

    pub(crate) fn heartbeat(&self) -> Heartbeat {
        Heartbeat {
            worker_id: self.worker_id,
            instance_id: self.instance_id,
            live_ranks: self.live_ranks(),
        }
    }

    /// Records a rank's new load and wakes the publisher.
    pub(crate) fn set_load(&self, index: usize, load: RankLoad) {
        {
            let mut loads = self.loads.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(slot) = loads.get_mut(index) {
                *slot = load;
            }
        }
        self.load_dirty.store(true, Ordering::Release);
        self.load_changed.notify_one();
    }

    /// The load report of the live ranks.
    fn load_report(&self) -> LoadReport {
        let loads = self.loads.lock().unwrap_or_else(|e| e.into_inner());
        let ranks = loads
            .iter()
            .enumerate()
            .filter(|(i, _)| self.live[*i].load(Ordering::Acquire))
            .map(|(_, l)| *l)
            .collect();
        LoadReport {
            worker_id: self.worker_id,
            instance_id: self.instance_id,
            ranks,
        }
    }
}

/// Publishes an encodable message; failures are logged (the bus is at most once anyway).
pub(crate) async fn publish_msg<T: Wire>(bus: &Bus, subject: &str, msg: &T) -> bool {
    publish_as(bus, subject, msg, FORMAT_VERSION).await
}

/// [`publish_msg`] in format `version` (an answer goes out in its request's version).
async fn publish_as<T: Wire>(bus: &Bus, subject: &str, msg: &T, version: u8) -> bool {
    match encode_as(msg, version) {
        Ok(bytes) => match bus.publish(subject, Bytes::from(bytes)).await {
            Ok(()) => true,
            Err(e) => {
                tracing::debug!(subject, error = %e, "publish failed");
                false
            }
        },
        Err(e) => {
            tracing::error!(subject, error = %e, "cannot encode a message");
            false
        }
    }
}

/// Encodes `events` in format `version` as one or more messages, each under `max_payload`
/// bytes and at most `max_blocks` blocks, in order. `wrap` builds the message around a slice
/// of events. A single event too large for any message is logged and left out.
pub(crate) fn encode_chunked<T: Wire>(
    events: Vec<KvEvent>,
    max_payload: usize,
    wrap: &dyn Fn(Vec<KvEvent>) -> T,
    version: u8,
) -> Vec<Bytes> {
    fn push<T: Wire>(
        events: Vec<KvEvent>,
        max_payload: usize,
        wrap: &dyn Fn(Vec<KvEvent>) -> T,
        version: u8,
        out: &mut Vec<Bytes>,
    ) {
        let n = events.len();
        let first_id = events.first().map(|e| e.event_id);
        let encoded = encode_as(&wrap(events.clone()), version);
        match encoded {
            Ok(b) if b.len() <= max_payload => out.push(Bytes::from(b)),
            _ if n > 1 => {
                // Many small events can outgrow the block budget's estimate: halve.
                let mut events = events;
                let tail = events.split_off(n / 2);
                push(events, max_payload, wrap, version, out);
                push(tail, max_payload, wrap, version, out);
            }
            other => {
                let size = other.as_ref().map(Vec::len).unwrap_or(usize::MAX);
                tracing::error!(
                    event_id = ?first_id,
                    size,
                    max_payload,
                    "a KV event is larger than the bus payload limit; dropped"
                );
            }
        }
    }
    let mut out = Vec::new();
    for chunk in chunk_events(events, max_payload) {
        push(chunk, max_payload, wrap, version, &mut out);
    }
    out
}

/// What the publisher of a worker receives from its ranks and endpoints.
pub(crate) enum PubMsg {
    /// KV events of one rank, in event-id order.
    Events(Vec<KvEvent>),
    /// Drop (do not publish) the next `n` event batches.
    DropBatches(u64),
}

/// Batches a worker's KV events (one `KvEventBatch` per flush, chunked under the payload
/// limit) and publishes its load reports.
pub(crate) struct Publisher {
    pub bus: Bus,
    pub info: Arc<WorkerInfo>,
    pub kv_events_subject: String,
    pub load_subject: String,
    pub batch_interval: Duration,
    pub load_interval: Duration,
}

impl Publisher {
    pub(crate) async fn run(
        self,
        mut rx: mpsc::UnboundedReceiver<PubMsg>,
        mut shutdown: watch::Receiver<bool>,
    ) {
        let mut buf: Vec<KvEvent> = Vec::new();
        let mut to_drop: u64 = 0;
        let mut flush_at: Option<Instant> = None;
        let mut last_load = Instant::now();
        let mut load_tick = tokio::time::interval(self.load_interval);
        load_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                _ = stopped(&mut shutdown) => break,
                msg = rx.recv() => match msg {
                    None => break,
                    Some(PubMsg::Events(events)) => {
                        buf.extend(events);
                        flush_at.get_or_insert_with(|| Instant::now() + self.batch_interval);
                    }
                    Some(PubMsg::DropBatches(n)) => to_drop = to_drop.saturating_add(n),
                },
                _ = self.info.load_changed.notified() => {
                    flush_at.get_or_insert_with(|| Instant::now() + self.batch_interval);
                }
                _ = tokio::time::sleep_until(flush_at.unwrap_or_else(Instant::now)), if flush_at.is_some() => {
                    flush_at = None;
                    self.flush_events(&mut buf, &mut to_drop).await;
                    if self.info.load_dirty.load(Ordering::Acquire) {
                        self.publish_load().await;
                        last_load = Instant::now();
                    }
                }
                _ = load_tick.tick() => {
                    if self.info.load_dirty.load(Ordering::Acquire) || last_load.elapsed() >= LOAD_KEEPALIVE {
                        self.publish_load().await;
                        last_load = Instant::now();
                    }
                }
            }
        }
        // Whatever the ranks handed over before stopping goes out.
        while let Ok(msg) = rx.try_recv() {
            match msg {
                PubMsg::Events(events) => buf.extend(events),
                PubMsg::DropBatches(n) => to_drop = to_drop.saturating_add(n),
            }
        }
        self.flush_events(&mut buf, &mut to_drop).await;
    }

    async fn flush_events(&self, buf: &mut Vec<KvEvent>, to_drop: &mut u64) {
        if buf.is_empty() {
            return;
        }
        let max_payload = self.bus.max_payload();
        let worker_id = self.info.worker_id;
        let instance_id = self.info.instance_id;
        let wrap = |events: Vec<KvEvent>| KvEventBatch {
            worker_id,
            instance_id,
            events,
        };
        let batches = encode_chunked(std::mem::take(buf), max_payload, &wrap, FORMAT_VERSION);
        for batch in batches {
            if *to_drop > 0 {
                *to_drop -= 1;
                tracing::info!(
                    worker_id,
                    "dropping a KV event batch (drop_events test hook)"
                );
                continue;
            }
            if let Err(e) = self.bus.publish(&self.kv_events_subject, batch).await {
                tracing::warn!(worker_id, error = %e, "cannot publish KV events; they are lost");
            }
        }
    }

    async fn publish_load(&self) {
        self.info.load_dirty.store(false, Ordering::Release);
        let report = self.info.load_report();
        publish_msg(&self.bus, &self.load_subject, &report).await;
    }
}

/// The subscriptions of one worker's endpoints.
pub(crate) struct EndpointSubs {
    pub generate: Subscription,
    pub state: Subscription,
    pub drop_events: Subscription,
    pub rank_live: Subscription,
}

/// Serves one worker's `generate`, `state`, `drop_events` and `rank_live` subjects.
pub(crate) struct Endpoints {
    pub bus: Bus,
    pub info: Arc<WorkerInfo>,
    pub ranks: Vec<mpsc::UnboundedSender<RankCmd>>,
    pub publisher: mpsc::UnboundedSender<PubMsg>,
    pub subjects: ModelSubjects,
}

impl Endpoints {
    pub(crate) async fn run(self, mut subs: EndpointSubs, mut shutdown: watch::Receiver<bool>) {
        loop {
            tokio::select! {
                biased;
                _ = stopped(&mut shutdown) => break,
                msg = subs.generate.next() => match msg {
                    Some(msg) => self.on_generate(msg, &shutdown),
                    None => break,
                },
                msg = subs.state.next() => match msg {
                    Some(msg) => self.on_state(msg),
                    None => break,
                },
                msg = subs.drop_events.next() => match msg {
                    Some(msg) => self.on_drop_events(msg),
                    None => break,
                },
                msg = subs.rank_live.next() => match msg {
                    Some(msg) => self.on_rank_live(msg).await,
                    None => break,
                },
            }
        }
    }

    fn rank_error(&self, rank: DpRank) -> ErrorReply {
        let info = &self.info;
        let range = info.dp_start_rank..info.dp_start_rank.saturating_add(info.dp_size);
        let message = if info.rank_index(rank).is_some() {
            format!(
                "rank {rank} of worker {} is not live (live ranks {:?})",
                info.worker_id,
                info.live_ranks()
            )
        } else {
            format!(
                "worker {} has no rank {rank} (ranks {}..{})",
                info.worker_id, range.start, range.end
            )
        };
        ErrorReply::new(ErrorKind::InvalidRank, message)
    }

    fn on_generate(&self, msg: Message, shutdown: &watch::Receiver<bool>) {
        let Some(reply) = msg.reply else {
            tracing::debug!(
                worker_id = self.info.worker_id,
                "generate without a reply subject; ignored"
            );
            return;
        };
        let bus = self.bus.clone();
        let version = reply_version(&msg.payload);
        let req: GenerateRequest = match decode(&msg.payload) {
            Ok(r) => r,
            Err(e) => {
                let err =
                    ErrorReply::new(ErrorKind::Malformed, format!("bad GenerateRequest: {e}"));
                tokio::spawn(send_error_stream(
                    bus,
                    reply,
                    GenerateEvent::Error(err),
                    version,
                ));
                return;
            }
        };
        let Some(index) = self.info.live_rank_index(req.dp_rank) else {
            let err = self.rank_error(req.dp_rank);
            tokio::spawn(send_error_stream(
                bus,
                reply,
                GenerateEvent::Error(err),
                version,
            ));
            return;
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let rx = crate::disagg::hook(
            &self.bus,
            &self.subjects.kv_transfer(),
            &self.info,
            req.dp_rank,
            &req.request_id,
            rx,
        );
        let request = Request {
            request_id: req.request_id,
            tokens: req.tokens,
            max_tokens: crate::disagg::max_tokens_for(self.info.role, req.max_tokens),
        };
        if crate::disagg::kv_transferred(self.info.role) {
            // The rank gets the request once every tp rank has received its KV.
            let receive = crate::disagg::Receive {
                bus: self.bus.clone(),
                subject: self.subjects.kv_transfer(),
                info: self.info.clone(),
                dp_rank: req.dp_rank,
                request,
                rank: self.ranks[index].clone(),
                out: tx,
            };
            tokio::spawn(receive.run(shutdown.clone()));
        } else {
            let sent = self.ranks[index].send(RankCmd::Submit {
                request,
                transferred: None,
                out: tx,
            });
            if sent.is_err() {
                let err = ErrorReply::new(ErrorKind::Unavailable, "the worker is shutting down");
                tokio::spawn(send_error_stream(
                    bus,
                    reply,
                    GenerateEvent::Error(err),
                    version,
                ));
                return;
            }
        }
        tokio::spawn(stream_generate(bus, reply, rx, version));
    }

    fn on_state(&self, msg: Message) {
        let Some(reply) = msg.reply else {
            tracing::debug!(
                worker_id = self.info.worker_id,
                "state query without a reply subject; ignored"
            );
            return;
        };
        let bus = self.bus.clone();
        let version = reply_version(&msg.payload);
        let query: StateQuery = match decode(&msg.payload) {
            Ok(q) => q,
            Err(e) => {
                let err = ErrorReply::new(ErrorKind::Malformed, format!("bad StateQuery: {e}"));
                tokio::spawn(send_error_stream(
                    bus,
                    reply,
                    Reply::<StateChunk>::Err(err),
                    version,
                ));
                return;
            }
        };
        let Some(index) = self.info.live_rank_index(query.dp_rank) else {
            let err = self.rank_error(query.dp_rank);
            tokio::spawn(send_error_stream(
                bus,
                reply,
                Reply::<StateChunk>::Err(err),
                version,
            ));
            return;
        };
        let max_blocks = max_blocks_per_batch(bus.max_payload());
        let (tx, rx) = oneshot::channel();
        let sent = self.ranks[index].send(RankCmd::Snapshot {
            max_blocks,
            reply: tx,
        });
        if sent.is_err() {
            let err = ErrorReply::new(ErrorKind::Unavailable, "the worker is shutting down");
            tokio::spawn(send_error_stream(
                bus,
                reply,
                Reply::<StateChunk>::Err(err),
                version,
            ));
            return;
        }
        let key = WorkerKey::new(self.info.worker_id, query.dp_rank);
        let instance_id = self.info.instance_id;
        tokio::spawn(async move {
            let Ok(snapshot) = rx.await else {
                let err = ErrorReply::new(ErrorKind::Unavailable, "the worker is shutting down");
                send_error_stream(bus, reply, Reply::<StateChunk>::Err(err), version).await;
                return;
            };
            let last_event_id = snapshot.last_event_id;
            let wrap = |events: Vec<KvEvent>| {
                Reply::Ok(StateChunk {
                    key,
                    instance_id,
                    last_event_id,
                    events,
                })
            };
            let mut chunks = encode_chunked(snapshot.events, bus.max_payload(), &wrap, version);
            if chunks.is_empty() {
                match encode_as(&wrap(Vec::new()), version) {
                    Ok(b) => chunks.push(Bytes::from(b)),
                    Err(e) => tracing::error!(error = %e, "cannot encode a state chunk"),
                }
            }
            for chunk in chunks {
                if let Err(e) = bus.publish(&reply, chunk).await {
                    tracing::debug!(error = %e, "state reply failed");
                    return;
                }
            }
            let _ = bus.end_stream(&reply).await;
        });
    }

    fn on_drop_events(&self, msg: Message) {
        let result = match decode::<u64>(&msg.payload) {
            Ok(n) => {
                tracing::info!(
                    worker_id = self.info.worker_id,
                    n,
                    "will drop the next KV event batches"
                );
                let _ = self.publisher.send(PubMsg::DropBatches(n));
                Reply::Ok(())
            }
            Err(e) => Reply::Err(ErrorReply::new(
                ErrorKind::Malformed,
                format!("drop_events expects a u64: {e}"),
            )),
        };
        if let Some(reply) = msg.reply {
            let bus = self.bus.clone();
            let version = reply_version(&msg.payload);
            tokio::spawn(async move { publish_as(&bus, &reply, &result, version).await });
        }
    }

    async fn on_rank_live(&self, msg: Message) {
        let result = match decode::<RankLiveness>(&msg.payload) {
            Ok(RankLiveness { dp_rank, live }) => match self.info.rank_index(dp_rank) {
                Some(index) => {
                    set_rank_live(&self.bus, &self.subjects, &self.info, index, live).await;
                    Reply::Ok(())
                }
                None => Reply::Err(self.rank_error(dp_rank)),
            },
            Err(e) => Reply::Err(ErrorReply::new(
                ErrorKind::Malformed,
                format!("rank_live expects a RankLiveness: {e}"),
            )),
        };
        if let Some(reply) = msg.reply {
            publish_as(&self.bus, &reply, &result, reply_version(&msg.payload)).await;
        }
    }
}

/// Takes rank `index` of a worker in or out of service and, if that changed it, announces it
/// at once (a registration and a heartbeat with the new live ranks).
pub(crate) async fn set_rank_live(
    bus: &Bus,
    subjects: &ModelSubjects,
    info: &WorkerInfo,
    index: usize,
    live: bool,
) {
    if info.set_live(index, live) {
        let dp_rank = info.dp_start_rank + index as DpRank;
        tracing::info!(
            worker_id = info.worker_id,
            dp_rank,
            live,
            "rank liveness changed"
        );
        publish_msg(bus, &subjects.register(), &info.registration()).await;
        publish_msg(bus, &subjects.heartbeat(), &info.heartbeat()).await;
    }
}

/// A single error message (in format `version`), then the end of the stream.
async fn send_error_stream<T: Wire>(bus: Bus, reply: String, msg: T, version: u8) {
    if publish_as(&bus, &reply, &msg, version).await {
        let _ = bus.end_stream(&reply).await;
    }
}

fn submit_error(e: &SubmitError) -> ErrorReply {
    let kind = match e {
        SubmitError::EmptyPrompt => ErrorKind::EmptyPrompt,
        SubmitError::TooLong { .. } | SubmitError::PromptExceedsBatch { .. } => {
            ErrorKind::PromptTooLong
        }
        SubmitError::DuplicateRequestId(_) => ErrorKind::DuplicateRequest,
    };
    ErrorReply::new(kind, e.to_string())
}

fn micros_u64(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

fn micros_u32(d: Duration) -> u32 {
    u32::try_from(d.as_micros()).unwrap_or(u32::MAX)
}

/// Streams one request's progress to its reply subject (in format `version`): `PrefillDone`
/// at once, `Tokens` in batches, `Done`, then the end of the stream.
async fn stream_generate(
    bus: Bus,
    reply: String,
    mut rx: mpsc::UnboundedReceiver<RankOut>,
    version: u8,
) {
    let mut itl: Vec<u32> = Vec::new();
    let mut flush_at: Option<Instant> = None;
    loop {
        let out = tokio::select! {
            biased;
            out = rx.recv() => out,
            _ = tokio::time::sleep_until(flush_at.unwrap_or_else(Instant::now)), if flush_at.is_some() => {
                flush_at = None;
                let itl_us = std::mem::take(&mut itl);
                if !publish_as(&bus, &reply, &GenerateEvent::Tokens { itl_us }, version).await {
                    return;
                }
                continue;
            }
        };
        let event = match out {
            None => GenerateEvent::Error(ErrorReply::new(
                ErrorKind::Unavailable,
                "the worker stopped before the request finished",
            )),
            Some(RankOut::Rejected(e)) => GenerateEvent::Error(submit_error(&e)),
            Some(RankOut::Failed(e)) => GenerateEvent::Error(e),
            Some(RankOut::Output(OutputKind::PrefillDone {
                cached_blocks,
                prompt_blocks,
                ttft,
            })) => GenerateEvent::PrefillDone {
                ttft_us: micros_u64(ttft),
                cached_blocks: u32::try_from(cached_blocks).unwrap_or(u32::MAX),
                prompt_blocks: u32::try_from(prompt_blocks).unwrap_or(u32::MAX),
            },
            Some(RankOut::Output(OutputKind::Token { itl: d, .. })) => {
                itl.push(micros_u32(d));
                if itl.len() >= TOKEN_BATCH {
                    flush_at = None;
                    let itl_us = std::mem::take(&mut itl);
                    if !publish_as(&bus, &reply, &GenerateEvent::Tokens { itl_us }, version).await {
                        return;
                    }
                } else {
                    flush_at.get_or_insert_with(|| Instant::now() + TOKEN_BATCH_WAIT);
                }
                continue;
            }
            Some(RankOut::Output(OutputKind::Finished {
                output_tokens,
                latency,
            })) => GenerateEvent::Done {
                output_tokens,
                e2e_us: micros_u64(latency),
            },
        };
        let last = !matches!(event, GenerateEvent::PrefillDone { .. });
        if last && !itl.is_empty() {
            let itl_us = std::mem::take(&mut itl);
            if !publish_as(&bus, &reply, &GenerateEvent::Tokens { itl_us }, version).await {
                return;
            }
        }
        if !publish_as(&bus, &reply, &event, version).await {
            return;
        }
        if last {
            let _ = bus.end_stream(&reply).await;
            return;
        }
    }
}

//! Replica sync on the bus: publishing this replica's active-sequence changes on its own
//! subject (numbered, so peers notice a lost batch), applying the peers' (once their subject
//! vouches for their origin, see [`SyncOrigins`]), the catch-up snapshot a joining replica
//! asks a peer for, and a peer's own requests fetched again after a lost batch.

use crate::metrics::SubjectLabels;
use crate::replica_sync::{SyncOrigins, MAX_CATCH_UP_BYTES};
use crate::scheduler_actor::SchedulerMsg;
use crate::state::ReplicaShared;
use bytes::Bytes;
use kvrouter_bus::{Bus, BusError, Subscription};
use kvrouter_protocol::{
    chunk_by_budget, decode, encode, SeqChange, Subjects, SyncBatch, SyncStateRequest,
    ENCODED_EVENT_OVERHEAD,
};
use ractor::ActorRef;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use uuid::Uuid;

/// How long a catch-up stream may stay silent.
const CATCH_UP_TIMEOUT: Duration = Duration::from_secs(5);

/// What [`spawn_publisher`] gives its owner.
pub struct SyncPublisher {
    /// Where the scheduler actor sends its changes, in order.
    pub changes: mpsc::UnboundedSender<Vec<SeqChange>>,
    /// The last sequence number given to a batch (an answer to a peer's fetch says it:
    /// later batches carry what the answer does not).
    pub published: Arc<AtomicU64>,
    pub task: JoinHandle<()>,
}

/// Publishes one model's changes in the order the scheduler actor made them, numbered.
pub fn spawn_publisher(
    bus: Bus,
    subject: String,
    replica_id: String,
    model: String,
) -> SyncPublisher {
    let (tx, mut rx) = mpsc::unbounded_channel::<Vec<SeqChange>>();
    let instance_id = Uuid::new_v4();
    let published = Arc::new(AtomicU64::new(0));
    let last = published.clone();
    let task = tokio::spawn(async move {
        let mut seq = 0u64;
        while let Some(changes) = rx.recv().await {
            for chunk in chunks(changes, bus.max_payload()) {
                // Numbered even when publishing fails: the gap is what tells peers.
                seq += 1;
                last.store(seq, Ordering::Relaxed);
                let batch = SyncBatch {
                    replica_id: replica_id.clone(),
                    model: model.clone(),
                    changes: chunk,
                    instance_id,
                    seq,
                };
                match encode(&batch) {
                    Ok(b) => {
                        if let Err(e) = bus.publish(&subject, Bytes::from(b)).await {
                            tracing::warn!(error = %e, "cannot publish active-sequence changes to peers");
                        }
                    }
                    Err(e) => tracing::error!(error = %e, "cannot encode a sync batch"),
                }
            }
        }
    });
    SyncPublisher {
        changes: tx,
        published,
        task,
    }
}

/// Splits changes into batches that fit the bus's payload limit (no changes: one empty
/// batch, a replica's heartbeat).
fn chunks(changes: Vec<SeqChange>, max_payload: usize) -> Vec<Vec<SeqChange>> {
    // Half the payload for the changes: the batch's own fields and the estimate's slack.
    let size = |c: &SeqChange| {
        ENCODED_EVENT_OVERHEAD
            + match c {
                SeqChange::Add {
                    request_id,
                    sequence_hashes,
                    ..
                } => request_id.len() + 8 * sequence_hashes.len(),
                SeqChange::Prefilled { request_id }
                | SeqChange::Free { request_id }
                | SeqChange::Output { request_id, .. } => request_id.len(),
            }
    };
    let mut out = chunk_by_budget(changes, max_payload / 2, size);
    if out.is_empty() {
        out.push(Vec::new());
    }
    out
}

/// How often the listener may warn about refused sync batches.
const REFUSAL_WARN_EVERY: Duration = Duration::from_secs(10);

/// Hands every peer batch to its model's scheduler actor (through its
/// [`PeerInbox`](crate::scheduler_actor::PeerInbox)), once [`SyncOrigins`] accepts where it
/// came from: `own` is the subscription to every replica's own sync subject, `legacy` to the
/// previous release's shared one. Refused batches and changes are counted in
/// `kvrouter_misattributed_messages_total{subject="sync"|"sync_change"}` and logged at most
/// every 10 s.
pub fn spawn_peer_listener(
    shared: Arc<ReplicaShared>,
    subjects: Subjects,
    own: Subscription,
    legacy: Subscription,
) -> JoinHandle<()> {
    let origins = Arc::new(parking_lot::Mutex::new(SyncOrigins::default()));
    let tasks = [own, legacy].map(|sub| {
        let listener = PeerListener {
            shared: shared.clone(),
            subjects: subjects.clone(),
            origins: origins.clone(),
            last_warn: None,
        };
        tokio::spawn(listener.run(sub))
    });
    tokio::spawn(async move {
        for t in tasks {
            let _ = t.await;
        }
    })
}

struct PeerListener {
    shared: Arc<ReplicaShared>,
    subjects: Subjects,
    origins: Arc<parking_lot::Mutex<SyncOrigins>>,
    last_warn: Option<Instant>,
}

impl PeerListener {
    async fn run(mut self, mut sub: Subscription) {
        while let Some(msg) = sub.next().await {
            let Some(sender) = self.subjects.sync_sender(&msg.subject) else {
                continue;
            };
            let mut batch = match decode::<SyncBatch>(&msg.payload) {
                Ok(b) => b,
                Err(e) => {
                    self.shared.metrics.undecodable("sync");
                    if self.warn_now() {
                        tracing::warn!(subject = %msg.subject, error = %e, "undecodable replica-sync batch dropped");
                    }
                    continue;
                }
            };
            let checked = self.origins.lock().check(sender, &mut batch);
            match checked {
                Ok(0) => {}
                Ok(foreign) => {
                    let m = &self.shared.metrics;
                    m.misattributed
                        .get_or_create(&SubjectLabels {
                            subject: "sync_change",
                        })
                        .inc_by(foreign as u64);
                    if self.warn_now() {
                        tracing::warn!(subject = %msg.subject, peer = %batch.replica_id, foreign, "replica-sync changes to requests the peer did not route dropped (a replica speaking for another's requests: check the bus credentials)");
                    }
                }
                Err(refusal) => {
                    self.shared.metrics.misattributed("sync");
                    if self.warn_now() {
                        tracing::warn!(subject = %msg.subject, %refusal, "replica-sync batch dropped (a replica speaking for another: check the bus credentials)");
                    }
                    continue;
                }
            }
            if batch.replica_id == self.shared.replica_id {
                continue; // our own, echoed
            }
            if let Some(m) = self.shared.models.get(&batch.model) {
                if let Some(inbox) = &m.peer_inbox {
                    if inbox.push(batch) {
                        let _ = m.scheduler.send_message(SchedulerMsg::PeerBatches);
                    }
                }
            }
        }
    }

    fn warn_now(&mut self) -> bool {
        let due = self
            .last_warn
            .is_none_or(|t| t.elapsed() >= REFUSAL_WARN_EVERY);
        if due {
            self.last_warn = Some(Instant::now());
        }
        due
    }
}

/// Once every model's ranks are synced, asks a peer for the active sequences it knows, then
/// starts answering such requests itself.
pub fn spawn_catch_up(shared: Arc<ReplicaShared>, subjects: Subjects) -> JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            // Ranks that cannot be synced do not hold the catch-up (they get no routes).
            if shared.models.values().all(|m| m.status.ready().is_ok()) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        for m in shared.models.values() {
            let snapshot = fetch_snapshot(&shared, &subjects, &m.name).await;
            tracing::info!(model = %m.name, sequences = snapshot.len(), "replica sync caught up");
            let _ = m
                .scheduler
                .send_message(SchedulerMsg::PeerSnapshot(snapshot));
        }
        shared.sync_caught_up.store(true, Ordering::Relaxed);
        let sub = match shared
            .bus
            .queue_subscribe(
                &subjects.sync_state(),
                kvrouter_protocol::subjects::SYNC_QUEUE_GROUP,
            )
            .await
        {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(error = %e, "cannot serve replica-sync catch-ups");
                return;
            }
        };
        answer_state_requests(shared, sub, false).await;
    })
}

/// Answers this replica's own-state subject from the start: a peer that lost one of our
/// batches asks it for the requests we routed.
pub fn spawn_own_state_responder(shared: Arc<ReplicaShared>, sub: Subscription) -> JoinHandle<()> {
    tokio::spawn(answer_state_requests(shared, sub, true))
}

/// Answers each `SyncStateRequest` with a stream of `Add`s: every active sequence this
/// replica knows of the model, or (`own`) only those it routed.
async fn answer_state_requests(shared: Arc<ReplicaShared>, mut sub: Subscription, own: bool) {
    while let Some(msg) = sub.next().await {
        let Some(reply) = msg.reply else { continue };
        let Ok(req) = decode::<SyncStateRequest>(&msg.payload) else {
            let _ = shared.bus.end_stream(&reply).await;
            continue;
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            let (mut published, mut changes) = (0, Vec::new());
            if let Some(m) = shared.models.get(&req.model) {
                let (tx, rx) = oneshot::channel();
                let origin = own.then(|| shared.replica_id.clone());
                if m.scheduler
                    .send_message(SchedulerMsg::ExportActive { origin, reply: tx })
                    .is_ok()
                {
                    (published, changes) = rx.await.unwrap_or_default();
                }
            }
            for chunk in chunks(changes, shared.bus.max_payload()) {
                // `seq`: the last batch this answer covers.
                let batch = SyncBatch {
                    replica_id: shared.replica_id.clone(),
                    model: req.model.clone(),
                    changes: chunk,
                    instance_id: Uuid::nil(),
                    seq: published,
                };
                if let Ok(b) = encode(&batch) {
                    let _ = shared.bus.publish(&reply, Bytes::from(b)).await;
                }
            }
            let _ = shared.bus.end_stream(&reply).await;
        });
    }
}

/// Fetches peers' own requests again, one peer at a time as the scheduler actor of `model`
/// names them (after a lost batch), and hands each answer back to it.
pub fn spawn_resync(
    bus: Bus,
    subjects: Subjects,
    replica_id: String,
    model: String,
    mut peers: mpsc::UnboundedReceiver<String>,
    scheduler: ActorRef<SchedulerMsg>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        while let Some(peer) = peers.recv().await {
            let req = SyncStateRequest {
                replica_id: replica_id.clone(),
                model: model.clone(),
            };
            let answer = match fetch_changes(&bus, &subjects.sync_own(&peer), &peer, &req).await {
                Ok(changes) => Some(changes),
                Err(e) => {
                    tracing::warn!(model, peer, reason = %e, "cannot fetch a peer's active sequences again; its later changes still apply");
                    None
                }
            };
            let _ = scheduler.send_message(SchedulerMsg::PeerResync { peer, answer });
        }
    })
}

/// Asks `subject` for a stream of sync batches and collects their changes and the last
/// batch they cover, all or nothing (a partial answer would free what it left out).
async fn fetch_changes(
    bus: &Bus,
    subject: &str,
    peer: &str,
    req: &SyncStateRequest,
) -> Result<(u64, Vec<SeqChange>), String> {
    let payload = encode(req).map_err(|e| e.to_string())?;
    let mut stream = bus
        .request_stream(subject, Bytes::from(payload), CATCH_UP_TIMEOUT)
        .await
        .map_err(|e| e.to_string())?;
    let (mut covered, mut out, mut held) = (0, Vec::new(), 0usize);
    while let Some(item) = stream.next().await {
        let bytes = item.map_err(|e| e.to_string())?;
        held += bytes.len();
        if held > MAX_CATCH_UP_BYTES {
            return Err(format!(
                "the answer passed {MAX_CATCH_UP_BYTES} bytes (the most a catch-up may hold)"
            ));
        }
        let batch = decode::<SyncBatch>(&bytes).map_err(|e| e.to_string())?;
        if batch.replica_id != peer {
            return Err(format!(
                "the answer came from replica {:?}, not the one asked (check the bus credentials: \
                 only a replica's own may read its subjects)",
                batch.replica_id
            ));
        }
        covered = covered.max(batch.seq);
        out.extend(batch.changes);
    }
    Ok((covered, out))
}

async fn fetch_snapshot(
    shared: &ReplicaShared,
    subjects: &Subjects,
    model: &str,
) -> Vec<SeqChange> {
    let req = SyncStateRequest {
        replica_id: shared.replica_id.clone(),
        model: model.to_string(),
    };
    let Ok(payload) = encode(&req) else {
        return Vec::new();
    };
    let mut stream = match shared
        .bus
        .request_stream(
            &subjects.sync_state(),
            Bytes::from(payload),
            CATCH_UP_TIMEOUT,
        )
        .await
    {
        Ok(s) => s,
        Err(e) => {
            tracing::info!(model, reason = %e, "no peer to catch up from; starting from no active sequences");
            return Vec::new();
        }
    };
    let (mut out, mut held) = (Vec::new(), 0usize);
    while let Some(item) = stream.next().await {
        if let Ok(bytes) = &item {
            held += bytes.len();
            if held > MAX_CATCH_UP_BYTES {
                tracing::warn!(model, limit = MAX_CATCH_UP_BYTES, "replica-sync catch-up answer passed its byte limit and was cut short; peers' later changes still apply");
                break;
            }
        }
        if let Err(e @ BusError::NoResponders { .. }) = &item {
            // The in-process bus tells "nobody answers" here rather than at the request.
            tracing::info!(model, reason = %e, "no peer to catch up from; starting from no active sequences");
            break;
        }
        match item
            .map_err(|e| e.to_string())
            .and_then(|b| decode::<SyncBatch>(&b).map_err(|e| e.to_string()))
        {
            Ok(batch) => out.extend(batch.changes),
            Err(e) => {
                tracing::warn!(model, error = %e, "replica-sync catch-up cut short; peers' later changes still apply");
                break;
            }
        }
    }
    out
}

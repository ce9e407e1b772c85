//! The served indexer (`--serve-indexer`): the replica answers other replicas'
//! find_matches queries from its own index, and (in approximate mode) records the route
//! decisions every replica publishes.
//!
//! Per model, two tasks:
//! - queries (`NS.model.MODEL.indexer.find_matches`, queue group `kvrouter-indexers`): the
//!   task subscribes only once the model is ready (discovery window over and no rank in its
//!   first fetch, as `/readyz`), so a serving indexer that is still fetching worker state
//!   never steals a query, then announces itself (`indexer.announce`) so remote replicas ask
//!   it at once; if the model falls out of readiness later (a rank joins and is fetched), it
//!   answers `Unavailable` until ready again; the asker asks again (the queue group may pick
//!   a ready serving indexer) and, if none answers, routes on load alone. A rank whose state
//!   cannot be fetched does not hold it: it has no blocks in the index.
//! - records (`NS.model.MODEL.indexer.record`, no queue group, approximate mode only): every
//!   serving indexer records every published decision, so they all hold the same index and
//!   losing one costs no routing quality.
//!
//! In approximate mode a serving indexer's index holds only what it was told, so one that
//! starts later first asks a peer for its entries (`NS.model.MODEL.indexer.dump`, queue group
//! `kvrouter-indexers`, a stream of chunks within the bus payload limit), each with the time it
//! has left on the peer ([`kvrouter_indexer::ApproxTracker::import`]). Decisions published
//! meanwhile are held and recorded after the dump ([`HeldRecords`]); a block the dump and a
//! held decision both name keeps the later expiry. Until the dump is loaded the model is not
//! ready, so queries wait; once loaded, it answers later peers' dump requests itself. With no
//! peer (the first serving indexer) or a failed fetch, it starts empty, as before.

use crate::metrics::{Metrics, ModelLabels};
use crate::serve::{serve_requests, OneWay, Server};
use crate::state::ModelShared;
use bytes::Bytes;
use kvrouter_bus::{Bus, Subscription};
use kvrouter_indexer::{OverlapScores, ShardedIndex};
use kvrouter_protocol::{
    chunk_approx_entries, decode, encode, ApproxEntry, ErrorKind, ErrorReply, IndexerAnnouncement,
    IndexerDumpChunk, IndexerDumpRequest, IndexerQuery, IndexerRecord, LocalBlockHash,
    OverlapScoresReply, Reply,
};
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;

/// How often a serving indexer that is not ready yet checks again before subscribing.
const READY_POLL: Duration = Duration::from_millis(20);
/// Wait before retrying a failed subscription.
const SUBSCRIBE_RETRY: Duration = Duration::from_secs(1);

/// Plain core: the answer to one query, given readiness, this index's block size and its
/// lookup.
pub fn answer(
    query: &IndexerQuery,
    ready: Result<(), String>,
    block_size: Option<u32>,
    find: impl FnOnce(&[LocalBlockHash]) -> OverlapScores,
) -> Result<OverlapScoresReply, ErrorReply> {
    ready.map_err(|why| {
        ErrorReply::new(
            ErrorKind::Unavailable,
            format!("this serving indexer is not synced: {why}"),
        )
    })?;
    let block_size = block_size
        .ok_or_else(|| ErrorReply::new(ErrorKind::NoWorkers, "no worker has registered yet"))?;
    if query.block_size != block_size {
        return Err(ErrorReply::new(
            ErrorKind::InvalidRequest,
            format!(
                "block size {} asked, this index uses {block_size}",
                query.block_size
            ),
        ));
    }
    let found = find(&query.local_hashes);
    Ok(OverlapScoresReply {
        block_size,
        scores: found.scores,
        tier_overlap_blocks: found.tiers,
        shared_blocks: found.shared_blocks,
    })
}

/// Answers one model's find_matches queries once it is ready (see the module docs), and
/// announces itself then, so remote replicas use it at once.
pub fn spawn_queries(
    model: Arc<ModelShared>,
    server: Server,
    replica_id: String,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let bus = server.bus.clone();
        let labels = Metrics::model(&model.name);
        let subject = model.subjects.indexer_find_matches();
        let group = kvrouter_protocol::subjects::INDEXER_QUEUE_GROUP;
        while model.status.ready().is_err() {
            tokio::time::sleep(READY_POLL).await;
        }
        let sub = loop {
            match bus.queue_subscribe(&subject, group).await {
                Ok(s) => break s,
                Err(e) => {
                    tracing::error!(model = %model.name, %subject, error = %e, "cannot serve the index; retrying");
                    tokio::time::sleep(SUBSCRIBE_RETRY).await;
                }
            }
        };
        let _ = bus.flush().await;
        tracing::info!(model = %model.name, %subject, "serving the index");
        announce(&bus, &model, &replica_id).await;
        let metrics = server.metrics.clone();
        serve_requests(
            sub,
            server,
            "indexer_find_matches",
            OneWay::Drop,
            move |q, _| {
                let (model, metrics, labels) = (model.clone(), metrics.clone(), labels.clone());
                async move {
                    let result = answer(
                        &q,
                        model.status.ready(),
                        model.status.block_size(),
                        |local| model.index.find_matches(local),
                    );
                    let counter = if result.is_ok() {
                        &metrics.served_indexer_queries
                    } else {
                        &metrics.served_indexer_refusals
                    };
                    counter.get_or_create(&labels).inc();
                    result.into()
                }
            },
        )
        .await;
    })
}

/// Tells remote replicas this serving indexer answers (see [`IndexerAnnouncement`]).
async fn announce(bus: &Bus, model: &ModelShared, replica_id: &str) {
    let msg = IndexerAnnouncement {
        replica_id: replica_id.to_string(),
    };
    let sent = match encode(&msg) {
        Ok(b) => bus
            .publish(&model.subjects.indexer_announce(), Bytes::from(b))
            .await
            .map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    if let Err(e) = sent {
        tracing::warn!(model = %model.name, error = %e, "cannot announce the serving indexer (remote replicas find it on their next probe)");
    }
}

/// Published decisions that arrive while a peer's dump is fetched, held to be recorded after
/// it; past `max` of them, or [`MAX_HELD_BYTES`] of payload, the oldest are dropped (most
/// likely in the dump already).
#[derive(Debug)]
pub struct HeldRecords {
    held: VecDeque<Bytes>,
    max: usize,
    max_bytes: usize,
    bytes: usize,
    dropped: u64,
}

/// Decisions held while a dump is fetched, at most.
const MAX_HELD_RECORDS: usize = 65_536;
/// Bytes of decisions held while a dump is fetched, at most (each is an encoded
/// [`IndexerRecord`], up to the bus's max payload).
pub const MAX_HELD_BYTES: usize = 64 << 20;

impl HeldRecords {
    pub fn new(max: usize) -> Self {
        Self::with_bytes(max, MAX_HELD_BYTES)
    }

    /// At most `max` records and `max_bytes` bytes of them.
    pub fn with_bytes(max: usize, max_bytes: usize) -> Self {
        Self {
            held: VecDeque::new(),
            max: max.max(1),
            max_bytes,
            bytes: 0,
            dropped: 0,
        }
    }

    pub fn push(&mut self, payload: Bytes) {
        if payload.len() > self.max_bytes {
            self.dropped += 1;
            return;
        }
        while self.held.len() >= self.max || self.bytes + payload.len() > self.max_bytes {
            let Some(old) = self.held.pop_front() else {
                break;
            };
            self.bytes -= old.len();
            self.dropped += 1;
        }
        self.bytes += payload.len();
        self.held.push_back(payload);
    }

    /// How many were dropped, and the rest in arrival order.
    pub fn take(self) -> (u64, VecDeque<Bytes>) {
        (self.dropped, self.held)
    }
}

/// Records one published decision (an encoded [`IndexerRecord`]) in the index. With
/// `registered_only`, a decision for a key that is no registered worker's rank is dropped:
/// it would bring back the index state of a worker that left (or make up a new one). Off
/// while catching up, when discovery may not have heard of every worker yet.
async fn record(
    model: &ModelShared,
    payload: &[u8],
    index: &ShardedIndex,
    metrics: &Metrics,
    registered_only: bool,
) {
    let labels: ModelLabels = Metrics::model(&model.name);
    let result = match decode::<IndexerRecord>(payload) {
        Ok(r) if registered_only && !model.status.layouts.has_rank(r.key) => {
            Err(format!("{} is no registered worker's rank", r.key))
        }
        Ok(r) => index
            .record_routing_decision(r.key, r.local_hashes, r.sequence_hashes)
            .await
            .map_err(|e| e.to_string()),
        Err(e) => Err(format!("undecodable record: {e}")),
    };
    match result {
        Ok(()) => metrics.served_indexer_records.get_or_create(&labels).inc(),
        Err(e) => {
            tracing::debug!(model = %model.name, error = %e, "published route decision not recorded");
            metrics.approx_record_failures.get_or_create(&labels).inc()
        }
    };
}

/// What a dump fetch brought.
#[derive(Debug, Default)]
struct Fetched {
    block_size: Option<u32>,
    entries: Vec<ApproxEntry>,
    chunks: usize,
    /// Why it stopped early (or found no peer).
    error: Option<String>,
}

async fn fetch_dump(bus: &Bus, subject: &str, replica_id: &str, idle: Duration) -> Fetched {
    let mut out = Fetched::default();
    let request = IndexerDumpRequest {
        replica_id: replica_id.to_string(),
    };
    let payload = match encode(&request) {
        Ok(p) => p,
        Err(e) => {
            out.error = Some(e.to_string());
            return out;
        }
    };
    let mut stream = match bus
        .request_stream(subject, Bytes::from(payload), idle)
        .await
    {
        Ok(s) => s,
        Err(e) => {
            out.error = Some(e.to_string());
            return out;
        }
    };
    while let Some(item) = stream.next().await {
        let chunk = item
            .map_err(|e| e.to_string())
            .and_then(|b| decode::<Reply<IndexerDumpChunk>>(&b).map_err(|e| e.to_string()))
            .and_then(|r| {
                r.into_result()
                    .map_err(|e| format!("the peer refused: {}: {}", e.kind, e.message))
            });
        match chunk {
            Ok(c) => {
                out.block_size = out.block_size.or(c.block_size);
                out.entries.extend(c.entries);
                out.chunks += 1;
            }
            Err(e) => {
                out.error = Some(e);
                break;
            }
        }
    }
    out
}

/// Loads a fetched dump, unless the peer's block size differs from this replica's.
async fn load_dump(model: &ModelShared, index: &ShardedIndex, fetched: Fetched) {
    let name = &model.name;
    if fetched.chunks == 0 {
        let reason = fetched.error.unwrap_or_else(|| "the dump was empty".into());
        tracing::info!(model = %name, %reason, "no approximate index from a peer: starting empty");
        return;
    }
    if let (Some(theirs), Some(ours)) = (fetched.block_size, model.status.block_size()) {
        if theirs != ours {
            tracing::warn!(model = %name, theirs, ours, "the peer serving indexer uses another block size: its approximate index is not loaded");
            return;
        }
    }
    let entries = fetched.entries.len();
    match index.import_approx(fetched.entries).await {
        Ok(got) => tracing::info!(
            model = %name,
            entries,
            chunks = fetched.chunks,
            added = got.added,
            kept = got.kept,
            refused = got.refused,
            "approximate index loaded from a peer serving indexer"
        ),
        Err(e) => {
            tracing::warn!(model = %name, error = %e, "cannot load the peer's approximate index")
        }
    }
    if let Some(e) = fetched.error {
        tracing::warn!(model = %name, error = %e, "the peer's approximate index was cut short: loaded what arrived");
    }
}

/// An approximate-mode serving indexer of one model (see the module docs).
pub struct ApproxServing {
    pub model: Arc<ModelShared>,
    /// Subscribed to the model's `indexer.record` before the dump is asked for, so no
    /// decision falls between the two.
    pub records: Subscription,
    pub index: Arc<ShardedIndex>,
    pub bus: Bus,
    pub metrics: Arc<Metrics>,
    pub replica_id: String,
    /// How long the dump stream may stay silent.
    pub fetch_timeout: Duration,
}

/// Loads a peer's approximate index, holding the decisions published meanwhile, then records
/// every published decision in this replica's index.
pub fn spawn_approx(a: ApproxServing) -> JoinHandle<()> {
    a.model
        .status
        .index_catching_up
        .store(true, Ordering::Relaxed);
    tokio::spawn(async move {
        let ApproxServing {
            model,
            mut records,
            index,
            bus,
            metrics,
            replica_id,
            fetch_timeout,
        } = a;
        let subject = model.subjects.indexer_dump();
        let mut held = HeldRecords::new(MAX_HELD_RECORDS);
        let fetch = fetch_dump(&bus, &subject, &replica_id, fetch_timeout);
        tokio::pin!(fetch);
        let fetched = loop {
            tokio::select! {
                f = &mut fetch => break f,
                msg = records.next() => match msg {
                    Some(m) => held.push(m.payload),
                    None => return,
                },
            }
        };
        load_dump(&model, &index, fetched).await;
        let (dropped, held) = held.take();
        if dropped > 0 {
            tracing::warn!(model = %model.name, dropped, "route decisions published during the catch-up were dropped");
            metrics
                .approx_record_failures
                .get_or_create(&Metrics::model(&model.name))
                .inc_by(dropped);
        }
        for payload in &held {
            record(&model, payload, &index, &metrics, false).await;
        }
        model
            .status
            .index_catching_up
            .store(false, Ordering::Relaxed);
        while let Some(msg) = records.next().await {
            record(&model, &msg.payload, &index, &metrics, true).await;
        }
    })
}

/// The chunks of one dump answer, each encoded as `Reply<IndexerDumpChunk>`.
fn dump_chunks(
    exported: Result<Vec<ApproxEntry>, String>,
    block_size: Option<u32>,
    max_payload: usize,
) -> Vec<Bytes> {
    let replies: Vec<Reply<IndexerDumpChunk>> = match exported {
        Ok(entries) => chunk_approx_entries(entries, max_payload)
            .into_iter()
            .map(|entries| {
                Reply::Ok(IndexerDumpChunk {
                    block_size,
                    entries,
                })
            })
            .collect(),
        Err(e) => vec![Reply::Err(ErrorReply::new(ErrorKind::Internal, e))],
    };
    replies
        .iter()
        .filter_map(|r| encode(r).ok().map(Bytes::from))
        .collect()
}

/// Answers later serving indexers' dump requests for one model, once this one's index is
/// loaded (approximate mode).
pub fn spawn_dumps(model: Arc<ModelShared>, index: Arc<ShardedIndex>, bus: Bus) -> JoinHandle<()> {
    tokio::spawn(async move {
        let subject = model.subjects.indexer_dump();
        let group = kvrouter_protocol::subjects::INDEXER_QUEUE_GROUP;
        // A replica still loading its own dump must not hand out a partial one.
        while model.status.index_catching_up.load(Ordering::Relaxed) {
            tokio::time::sleep(READY_POLL).await;
        }
        let mut sub = loop {
            match bus.queue_subscribe(&subject, group).await {
                Ok(s) => break s,
                Err(e) => {
                    tracing::error!(model = %model.name, %subject, error = %e, "cannot serve approximate index dumps; retrying");
                    tokio::time::sleep(SUBSCRIBE_RETRY).await;
                }
            }
        };
        while let Some(msg) = sub.next().await {
            let Some(reply_to) = msg.reply else {
                continue;
            };
            let asker = decode::<IndexerDumpRequest>(&msg.payload)
                .map(|r| r.replica_id)
                .unwrap_or_default();
            let exported = index.export_approx().await.map_err(|e| e.to_string());
            let entries = exported.as_ref().map_or(0, Vec::len);
            let chunks = dump_chunks(exported, model.status.block_size(), bus.max_payload());
            tracing::info!(model = %model.name, %asker, entries, chunks = chunks.len(), "serving the approximate index to a peer");
            for c in chunks {
                if let Err(e) = bus.publish(&reply_to, c).await {
                    tracing::debug!(error = %e, "cannot send an approximate index chunk (the asker may have gone)");
                    break;
                }
            }
            let _ = bus.end_stream(&reply_to).await;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrouter_protocol::{TierBlocks, WorkerKey};

    fn query(block_size: u32) -> IndexerQuery {
        IndexerQuery {
            block_size,
            local_hashes: [1, 2, 3].map(LocalBlockHash).to_vec(),
        }
    }

    fn find(local: &[LocalBlockHash]) -> OverlapScores {
        OverlapScores {
            scores: vec![(WorkerKey::new(4, 1), local.len() as u32)],
            tiers: vec![(
                WorkerKey::new(5, 0),
                TierBlocks {
                    host: 2,
                    ..TierBlocks::default()
                },
            )],
            shared_blocks: 1,
        }
    }

    #[test]
    fn a_synced_index_answers() {
        let r = answer(&query(16), Ok(()), Some(16), find).unwrap();
        assert_eq!(r.block_size, 16);
        assert_eq!(r.scores, vec![(WorkerKey::new(4, 1), 3)]);
        assert_eq!(r.tier_overlap_blocks.len(), 1);
        assert_eq!(r.shared_blocks, 1);
    }

    #[test]
    fn an_unsynced_index_refuses_so_the_asker_falls_back() {
        let e = answer(&query(16), Err("1 of 2 syncing".into()), Some(16), find).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Unavailable);
        assert!(e.message.contains("1 of 2 syncing"));
    }

    #[test]
    fn another_block_size_or_none_yet_is_refused() {
        let e = answer(&query(32), Ok(()), Some(16), find).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidRequest);
        let e = answer(&query(16), Ok(()), None, find).unwrap_err();
        assert_eq!(e.kind, ErrorKind::NoWorkers);
    }

    #[test]
    fn held_records_keep_order_and_drop_the_oldest_past_the_bound() {
        let mut h = HeldRecords::new(3);
        for i in 0..5u8 {
            h.push(Bytes::from(vec![i]));
        }
        let (dropped, held) = h.take();
        assert_eq!(dropped, 2);
        let held: Vec<u8> = held.iter().map(|b| b[0]).collect();
        assert_eq!(held, [2, 3, 4]);
    }

    #[test]
    fn a_dump_answer_is_chunked_within_the_payload_and_decodes() {
        let entries: Vec<ApproxEntry> = (0..3000u64)
            .map(|i| ApproxEntry {
                key: WorkerKey::new(i % 7, 0),
                parent: (i % 5 != 0).then_some(kvrouter_protocol::SequenceHash(
                    (u64::MAX - i).wrapping_add(1),
                )),
                sequence_hash: kvrouter_protocol::SequenceHash(u64::MAX - i),
                local_hash: LocalBlockHash(i.wrapping_mul(0x9e37_79b9_7f4a_7c15)),
                expires_in_ms: 120_000,
            })
            .collect();
        let max = 32 << 10;
        let chunks = dump_chunks(Ok(entries.clone()), Some(16), max);
        assert!(chunks.len() > 1);
        let mut back = Vec::new();
        for c in &chunks {
            assert!(c.len() <= max);
            let r: Reply<IndexerDumpChunk> = decode(c).unwrap();
            let chunk = r.into_result().unwrap();
            assert_eq!(chunk.block_size, Some(16));
            back.extend(chunk.entries);
        }
        assert_eq!(back, entries);
        let err = dump_chunks(Err("shard down".into()), None, max);
        let r: Reply<IndexerDumpChunk> = decode(&err[0]).unwrap();
        assert_eq!(r.into_result().unwrap_err().kind, ErrorKind::Internal);
    }

    #[test]
    fn held_records_are_bounded_in_bytes() {
        let mut h = HeldRecords::with_bytes(100, 10);
        for i in 0..6u8 {
            h.push(Bytes::from(vec![i; 3]));
            assert!(h.bytes <= 10);
        }
        h.push(Bytes::from(vec![9; 11])); // larger than the bound: dropped at once
        let (dropped, held) = h.take();
        let firsts: Vec<u8> = held.iter().map(|b| b[0]).collect();
        assert_eq!(firsts, [3, 4, 5]);
        assert_eq!(dropped, 4);
    }
}

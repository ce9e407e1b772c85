//! Shard actors around index cores, and the shared read path.
//!
//! Each shard actor owns one [`Index`] (and, in approximate mode, its [`ApproxTracker`]) for
//! the workers assigned to it; all ranks of a worker live in one shard. Writes travel as
//! batched messages to the owning actor. Reads do not pay an actor round trip (about 10 µs):
//! every core sits behind a `RwLock` that only its actor ever write-locks, once per batch, and
//! an [`IndexReader`] read-locks each core in turn. An actor acknowledges a batch only after
//! releasing the write lock, so a lookup issued after the acknowledgement sees the batch.

use crate::approx::{ApproxConfig, ApproxTracker, Imported};
use crate::error::IndexError;
use crate::index::{Index, IndexStats, RankDump};
use crate::overlap::OverlapScores;
use crate::prefix::PrefixChain;
use kvrouter_protocol::{ApproxEntry, KvEvent, LocalBlockHash, SequenceHash, WorkerId, WorkerKey};
use parking_lot::{Mutex, RwLock};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use rustc_hash::FxHashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use thiserror::Error;
use tokio::sync::mpsc::UnboundedSender;
use tokio::task::JoinHandle;

/// How often approximate-mode shards drop expired blocks.
const EXPIRE_EVERY: Duration = Duration::from_secs(1);

/// Approximate-mode time, from tokio's clock so that TTLs follow a paused (virtual) clock in
/// replays and tests; the same as `Instant::now()` otherwise.
fn approx_now() -> Instant {
    tokio::time::Instant::now().into_std()
}

#[derive(Clone, Debug)]
pub struct ShardedIndexConfig {
    /// Shard actors. Each applies its workers' events in parallel with the others, but a
    /// lookup walks every shard whose workers hold the query's prefix, so more shards trade
    /// lookup time for event throughput (see docs/benchmarks.md).
    pub shards: usize,
    /// `Some` for approximate mode (routing decisions feed the index).
    pub approx: Option<ApproxConfig>,
    /// Exact mode: routing decisions may still be recorded for ranks whose events do not
    /// arrive (a silent rank), kept for this config's TTL and dropped once the rank's events
    /// flow again ([`ShardedIndex::drop_recorded`]). Ignored with `approx`.
    pub fallback: Option<ApproxConfig>,
    /// Where ranks that saw an event-id gap are reported, for recovery.
    pub recovery: Option<UnboundedSender<WorkerKey>>,
}

impl Default for ShardedIndexConfig {
    fn default() -> Self {
        Self {
            shards: 1,
            approx: None,
            fallback: None,
            recovery: None,
        }
    }
}

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ShardError {
    #[error("cannot start index shard {shard}: {reason}")]
    Spawn { shard: usize, reason: String },
    #[error("index shard {0} has stopped")]
    ShardDown(usize),
    #[error("approximate mode is off: start the index with an approx config")]
    NotApproximate,
    #[error(transparent)]
    Index(#[from] IndexError),
}

struct ShardCore {
    index: Index,
    approx: Option<ApproxTracker>,
}

/// Messages a shard actor handles; writes are applied in mailbox order.
pub enum ShardMsg {
    Apply(Vec<KvEvent>),
    /// A rank's dump, loaded in mailbox order with no answer (see
    /// [`ShardedIndex::queue_load_rank`]).
    LoadQueued(RankDump),
    Record {
        key: WorkerKey,
        local: Vec<LocalBlockHash>,
        sequence: Vec<SequenceHash>,
        reply: RpcReplyPort<Result<(), IndexError>>,
    },
    RemoveWorker(WorkerId),
    RemoveRank(WorkerKey),
    SetBlockLimit(WorkerId, Option<usize>),
    Dump(WorkerKey, RpcReplyPort<Option<RankDump>>),
    Load(RankDump, RpcReplyPort<Result<(), IndexError>>),
    Expire,
    /// The blocks recorded for a rank are removed (see [`ShardedIndex::drop_recorded`]).
    DropRecorded(WorkerKey),
    /// Approximate mode: every tracked block with its time left (see [`ApproxTracker::export`]).
    ExportApprox(RpcReplyPort<Vec<ApproxEntry>>),
    /// Approximate mode: loads a peer's export (see [`ApproxTracker::import`]).
    ImportApprox(Vec<ApproxEntry>, RpcReplyPort<Imported>),
    /// Replies once every earlier message has been applied.
    Flush(RpcReplyPort<()>),
}

struct ShardActor;

struct ShardArgs {
    core: Arc<RwLock<ShardCore>>,
    live_blocks: Arc<AtomicUsize>,
    recovery: Option<UnboundedSender<WorkerKey>>,
}

struct ShardState {
    args: ShardArgs,
    _expiry: Option<JoinHandle<()>>,
}

impl ShardState {
    /// Publishes the size used for shard assignment and reports ranks needing recovery.
    fn after_write(&self, core: &mut ShardCore) {
        self.args
            .live_blocks
            .store(core.index.live_blocks(), Ordering::Relaxed);
        let gaps = core.index.take_needs_recovery();
        if let Some(tx) = &self.args.recovery {
            for key in gaps {
                let _ = tx.send(key);
            }
        }
    }
}

impl Actor for ShardActor {
    type Msg = ShardMsg;
    type State = ShardState;
    type Arguments = ShardArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<ShardMsg>,
        args: ShardArgs,
    ) -> Result<ShardState, ActorProcessingErr> {
        let expiry = args
            .core
            .read()
            .approx
            .is_some()
            .then(|| myself.send_interval(EXPIRE_EVERY, || ShardMsg::Expire));
        Ok(ShardState {
            args,
            _expiry: expiry,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<ShardMsg>,
        msg: ShardMsg,
        state: &mut ShardState,
    ) -> Result<(), ActorProcessingErr> {
        let core_lock = state.args.core.clone();
        match msg {
            ShardMsg::Apply(events) => {
                let mut core = core_lock.write();
                for ev in &events {
                    if let Err(e) = core.index.apply(ev) {
                        tracing::debug!(error = %e, "kv event refused");
                    }
                }
                state.after_write(&mut core);
            }
            ShardMsg::Record {
                key,
                local,
                sequence,
                reply,
            } => {
                let mut guard = core_lock.write();
                let core = &mut *guard;
                let result = match core.approx.as_mut() {
                    Some(t) => t.record(&mut core.index, key, &local, &sequence, approx_now()),
                    None => Ok(()),
                };
                state.after_write(core);
                drop(guard);
                let _ = reply.send(result);
            }
            ShardMsg::RemoveWorker(id) => {
                let mut core = core_lock.write();
                core.index.remove_worker(id);
                if let Some(t) = core.approx.as_mut() {
                    t.forget_worker(id);
                }
                state.after_write(&mut core);
            }
            ShardMsg::RemoveRank(key) => {
                let mut core = core_lock.write();
                core.index.remove_worker_rank(key);
                if let Some(t) = core.approx.as_mut() {
                    t.forget_rank(key);
                }
                state.after_write(&mut core);
            }
            ShardMsg::DropRecorded(key) => {
                let mut guard = core_lock.write();
                let core = &mut *guard;
                if let Some(t) = core.approx.as_mut() {
                    let n = t.drop_rank(&mut core.index, key);
                    tracing::debug!(
                        worker = key.worker_id,
                        dp_rank = key.dp_rank,
                        blocks = n,
                        "recorded blocks dropped"
                    );
                }
                state.after_write(core);
            }
            ShardMsg::SetBlockLimit(id, limit) => {
                core_lock.write().index.set_block_limit(id, limit)
            }
            ShardMsg::Dump(key, reply) => {
                let dump = core_lock.read().index.dump(key);
                let _ = reply.send(dump);
            }
            ShardMsg::LoadQueued(dump) => {
                let mut core = core_lock.write();
                let result = core.index.load_rank(&dump);
                state.after_write(&mut core);
                drop(core);
                if let Err(e) = result {
                    tracing::warn!(worker = dump.key.worker_id, dp_rank = dump.key.dp_rank, error = %e, "rank state partly refused by the index");
                }
            }
            ShardMsg::Load(dump, reply) => {
                let mut core = core_lock.write();
                let result = core.index.load_rank(&dump);
                state.after_write(&mut core);
                drop(core);
                let _ = reply.send(result);
            }
            ShardMsg::Expire => {
                let mut guard = core_lock.write();
                let core = &mut *guard;
                if let Some(t) = core.approx.as_mut() {
                    t.expire(&mut core.index, approx_now());
                }
                state.after_write(core);
            }
            ShardMsg::ExportApprox(reply) => {
                let core = core_lock.read();
                let entries = core
                    .approx
                    .as_ref()
                    .map(|t| t.export(&core.index, approx_now()))
                    .unwrap_or_default();
                drop(core);
                let _ = reply.send(entries);
            }
            ShardMsg::ImportApprox(entries, reply) => {
                let mut guard = core_lock.write();
                let core = &mut *guard;
                let imported = match core.approx.as_mut() {
                    Some(t) => t.import(&mut core.index, &entries, approx_now()),
                    None => Imported::default(),
                };
                state.after_write(core);
                drop(guard);
                let _ = reply.send(imported);
            }
            ShardMsg::Flush(reply) => {
                let _ = reply.send(());
            }
        }
        Ok(())
    }
}

struct Shard {
    actor: ActorRef<ShardMsg>,
    join: JoinHandle<()>,
    live_blocks: Arc<AtomicUsize>,
}

#[derive(Default)]
struct Assignment {
    shard_of: FxHashMap<WorkerId, usize>,
    workers_per_shard: Vec<usize>,
}

/// The shared read path: cheap to clone, safe to use from any thread.
#[derive(Clone)]
pub struct IndexReader {
    cores: Arc<[Arc<RwLock<ShardCore>>]>,
}

impl IndexReader {
    /// Overlap of every worker key with the query's leading blocks, across all shards.
    pub fn find_matches(&self, local: &[LocalBlockHash]) -> OverlapScores {
        let mut chain = PrefixChain::new(local);
        let mut out = OverlapScores::default();
        for core in self.cores.iter() {
            core.read().index.find_matches_in(&mut chain, &mut out);
        }
        out
    }

    /// Blocks one worker rank holds (0 when the index does not know it).
    pub fn held_blocks(&self, key: WorkerKey) -> usize {
        self.cores
            .iter()
            .map(|core| core.read().index.held_blocks(key))
            .sum()
    }

    /// Sizes and counters summed over shards.
    pub fn stats(&self) -> IndexStats {
        let mut total = IndexStats::default();
        for core in self.cores.iter() {
            let s = core.read().index.stats();
            total.live_blocks += s.live_blocks;
            total.live_pairs += s.live_pairs;
            total.worker_keys += s.worker_keys;
            total.table_bytes += s.table_bytes;
            total.lower_tier_pairs += s.lower_tier_pairs;
            total.live_runs += s.live_runs;
            let (t, c) = (&mut total.counters, s.counters);
            t.events_applied += c.events_applied;
            t.stored_blocks += c.stored_blocks;
            t.removed_blocks += c.removed_blocks;
            t.removed_unknown_blocks += c.removed_unknown_blocks;
            t.stale_events += c.stale_events;
            t.gaps += c.gaps;
            t.rejected_missing_parent += c.rejected_missing_parent;
            t.rejected_block_limit += c.rejected_block_limit;
        }
        total
    }
}

/// N shard actors, the worker → shard assignment, and the read path.
pub struct ShardedIndex {
    shards: Vec<Shard>,
    assignment: Mutex<Assignment>,
    reader: IndexReader,
    approx: bool,
}

impl ShardedIndex {
    /// Starts the shard actors on the current tokio runtime.
    pub async fn start(config: ShardedIndexConfig) -> Result<Self, ShardError> {
        let n = config.shards.max(1);
        let mut shards = Vec::with_capacity(n);
        let mut cores = Vec::with_capacity(n);
        for i in 0..n {
            let core = Arc::new(RwLock::new(ShardCore {
                index: Index::new(),
                approx: config.approx.or(config.fallback).map(ApproxTracker::new),
            }));
            let live_blocks = Arc::new(AtomicUsize::new(0));
            let args = ShardArgs {
                core: core.clone(),
                live_blocks: live_blocks.clone(),
                recovery: config.recovery.clone(),
            };
            let (actor, join) =
                Actor::spawn(None, ShardActor, args)
                    .await
                    .map_err(|e| ShardError::Spawn {
                        shard: i,
                        reason: e.to_string(),
                    })?;
            shards.push(Shard {
                actor,
                join,
                live_blocks,
            });
            cores.push(core);
        }
        Ok(Self {
            assignment: Mutex::new(Assignment {
                shard_of: FxHashMap::default(),
                workers_per_shard: vec![0; n],
            }),
            shards,
            reader: IndexReader {
                cores: cores.into(),
            },
            approx: config.approx.is_some() || config.fallback.is_some(),
        })
    }

    pub fn reader(&self) -> IndexReader {
        self.reader.clone()
    }

    pub fn find_matches(&self, local: &[LocalBlockHash]) -> OverlapScores {
        self.reader.find_matches(local)
    }

    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// The shard that owns `worker_id`, assigning a first-seen worker to the shard with the
    /// fewest live blocks (then the fewest workers).
    pub fn shard_of(&self, worker_id: WorkerId) -> usize {
        let mut a = self.assignment.lock();
        if let Some(&s) = a.shard_of.get(&worker_id) {
            return s;
        }
        let s = (0..self.shards.len())
            .min_by_key(|&i| {
                (
                    self.shards[i].live_blocks.load(Ordering::Relaxed),
                    a.workers_per_shard[i],
                )
            })
            .unwrap_or(0);
        a.shard_of.insert(worker_id, s);
        a.workers_per_shard[s] += 1;
        s
    }

    /// The shard a worker is assigned to, without assigning it.
    pub fn assigned_shard(&self, worker_id: WorkerId) -> Option<usize> {
        self.assignment.lock().shard_of.get(&worker_id).copied()
    }

    fn send(&self, shard: usize, msg: ShardMsg) -> Result<(), ShardError> {
        self.shards[shard]
            .actor
            .send_message(msg)
            .map_err(|_| ShardError::ShardDown(shard))
    }

    /// Queues a batch of events; each shard gets its workers' events in order, in one message.
    /// Use [`flush`](Self::flush) to wait until they are visible to readers.
    pub fn apply_batch(&self, events: Vec<KvEvent>) -> Result<(), ShardError> {
        if self.shards.len() == 1 {
            // Still assign, so removal and stats agree with the multi-shard path.
            for ev in &events {
                self.shard_of(ev.key.worker_id);
            }
            return self.send(0, ShardMsg::Apply(events));
        }
        let mut per_shard: Vec<Vec<KvEvent>> = (0..self.shards.len()).map(|_| Vec::new()).collect();
        for ev in events {
            per_shard[self.shard_of(ev.key.worker_id)].push(ev);
        }
        for (i, batch) in per_shard.into_iter().enumerate() {
            if !batch.is_empty() {
                self.send(i, ShardMsg::Apply(batch))?;
            }
        }
        Ok(())
    }

    /// Waits until every message sent before has been applied by every shard.
    pub async fn flush(&self) -> Result<(), ShardError> {
        for (i, shard) in self.shards.iter().enumerate() {
            shard
                .actor
                .call(ShardMsg::Flush, None)
                .await
                .map_err(|_| ShardError::ShardDown(i))?
                .success_or(ShardError::ShardDown(i))?;
        }
        Ok(())
    }

    /// Applies a batch and returns once readers see it.
    pub async fn apply_and_wait(&self, events: Vec<KvEvent>) -> Result<(), ShardError> {
        self.apply_batch(events)?;
        self.flush().await
    }

    /// Approximate mode: records that a request with these blocks was routed to `key`.
    pub async fn record_routing_decision(
        &self,
        key: WorkerKey,
        local: Vec<LocalBlockHash>,
        sequence: Vec<SequenceHash>,
    ) -> Result<(), ShardError> {
        if !self.approx {
            return Err(ShardError::NotApproximate);
        }
        if local.len() != sequence.len() {
            return Err(IndexError::LengthMismatch {
                local: local.len(),
                sequence: sequence.len(),
            }
            .into());
        }
        let shard = self.shard_of(key.worker_id);
        let result = self.shards[shard]
            .actor
            .call(
                |reply| ShardMsg::Record {
                    key,
                    local,
                    sequence,
                    reply,
                },
                None,
            )
            .await
            .map_err(|_| ShardError::ShardDown(shard))?
            .success_or(ShardError::ShardDown(shard))?;
        Ok(result?)
    }

    /// Approximate mode: every tracked block of every shard with its time left, each rank's
    /// blocks parents first (for a peer's [`import_approx`](Self::import_approx)).
    pub async fn export_approx(&self) -> Result<Vec<ApproxEntry>, ShardError> {
        if !self.approx {
            return Err(ShardError::NotApproximate);
        }
        let mut out = Vec::new();
        for (i, shard) in self.shards.iter().enumerate() {
            let entries = shard
                .actor
                .call(ShardMsg::ExportApprox, None)
                .await
                .map_err(|_| ShardError::ShardDown(i))?
                .success_or(ShardError::ShardDown(i))?;
            out.extend(entries);
        }
        Ok(out)
    }

    /// Approximate mode: loads a peer's export, each worker's entries to its shard in order.
    pub async fn import_approx(&self, entries: Vec<ApproxEntry>) -> Result<Imported, ShardError> {
        if !self.approx {
            return Err(ShardError::NotApproximate);
        }
        let mut per_shard: Vec<Vec<ApproxEntry>> = vec![Vec::new(); self.shards.len()];
        for e in entries {
            per_shard[self.shard_of(e.key.worker_id)].push(e);
        }
        let mut total = Imported::default();
        for (i, batch) in per_shard.into_iter().enumerate() {
            if batch.is_empty() {
                continue;
            }
            let got = self.shards[i]
                .actor
                .call(|reply| ShardMsg::ImportApprox(batch, reply), None)
                .await
                .map_err(|_| ShardError::ShardDown(i))?
                .success_or(ShardError::ShardDown(i))?;
            total.added += got.added;
            total.kept += got.kept;
            total.refused += got.refused;
        }
        Ok(total)
    }

    /// Refuses `Stored` events beyond `limit` blocks per rank of `worker_id`.
    pub fn set_block_limit(
        &self,
        worker_id: WorkerId,
        limit: Option<usize>,
    ) -> Result<(), ShardError> {
        let shard = self.shard_of(worker_id);
        self.send(shard, ShardMsg::SetBlockLimit(worker_id, limit))
    }

    /// Removes every rank of a worker; its shard assignment is released.
    pub fn remove_worker(&self, worker_id: WorkerId) -> Result<(), ShardError> {
        let shard = {
            let mut a = self.assignment.lock();
            let Some(s) = a.shard_of.remove(&worker_id) else {
                return Ok(());
            };
            a.workers_per_shard[s] -= 1;
            s
        };
        self.send(shard, ShardMsg::RemoveWorker(worker_id))
    }

    /// Removes one rank; the worker keeps its shard.
    /// Removes the blocks recorded for `key` by routing decisions (its own events say what
    /// it caches again), after every earlier message to its shard.
    pub fn drop_recorded(&self, key: WorkerKey) -> Result<(), ShardError> {
        match self.assigned_shard(key.worker_id) {
            Some(s) => self.send(s, ShardMsg::DropRecorded(key)),
            None => Ok(()),
        }
    }

    pub fn remove_worker_rank(&self, key: WorkerKey) -> Result<(), ShardError> {
        match self.assigned_shard(key.worker_id) {
            Some(s) => self.send(s, ShardMsg::RemoveRank(key)),
            None => Ok(()),
        }
    }

    /// Events that rebuild one rank (after every earlier message to its shard).
    pub async fn dump(&self, key: WorkerKey) -> Result<Option<RankDump>, ShardError> {
        let Some(shard) = self.assigned_shard(key.worker_id) else {
            return Ok(None);
        };
        self.shards[shard]
            .actor
            .call(|reply| ShardMsg::Dump(key, reply), None)
            .await
            .map_err(|_| ShardError::ShardDown(shard))?
            .success_or(ShardError::ShardDown(shard))
    }

    /// Replaces a rank's state with a dump without waiting: it is loaded before any event
    /// queued after it (one shard's mailbox keeps order), so the caller never stalls other
    /// ranks' events on a big snapshot. A partly refused dump is logged by the shard.
    pub fn queue_load_rank(&self, dump: RankDump) -> Result<(), ShardError> {
        let shard = self.shard_of(dump.key.worker_id);
        self.send(shard, ShardMsg::LoadQueued(dump))
    }

    /// Replaces a rank's state with a dump.
    pub async fn load_rank(&self, dump: RankDump) -> Result<(), ShardError> {
        let shard = self.shard_of(dump.key.worker_id);
        let result = self.shards[shard]
            .actor
            .call(|reply| ShardMsg::Load(dump, reply), None)
            .await
            .map_err(|_| ShardError::ShardDown(shard))?
            .success_or(ShardError::ShardDown(shard))?;
        Ok(result?)
    }

    pub fn stats(&self) -> IndexStats {
        self.reader.stats()
    }

    /// Stops every shard actor and waits for them.
    pub async fn stop(self) {
        for shard in &self.shards {
            shard.actor.stop(None);
        }
        for shard in self.shards {
            let _ = shard.join.await;
        }
    }
}

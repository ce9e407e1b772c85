//! The paged KV cache of one rank: fixed-size blocks, prefix reuse, LRU eviction, KV events.
//!
//! Modelled on vLLM v1's block pool:
//! - A rank has `capacity` physical blocks. A sequence holds its blocks in a [`BlockTable`]
//!   (block `i` holds tokens `i*block_size..(i+1)*block_size`); a block held by several
//!   sequences is stored once and reference-counted.
//! - A full prompt block, once computed, is *registered* under its [`SequenceHash`] (the
//!   router-compatible prefix identity, from `kvrouter_protocol::hashing`) and published with
//!   a `Stored` event. A later prompt that starts with the same blocks reuses them.
//! - Blocks that nobody references but are registered stay cached; they are evicted in LRU
//!   order, only when a new block is needed and no free block is left. A sequence releases
//!   its blocks last-first, so the tail of a prompt is evicted before its head, and a parent
//!   block is never older in the LRU than its children.
//! - Blocks that are never registered (a prompt's trailing partial block, decode tokens, and
//!   a sequence's blocks after [`KvCache::clear`]) consume capacity but are never published.
//!   Generated tokens are not cached: only prompt blocks are (simpler than vLLM, which can
//!   also cache full generated blocks; the router only matches prompts anyway).
//! - If a sequence computes a block that another sequence registered meanwhile, it adopts the
//!   registered block and frees its own copy (no duplicate is published).
//!
//! - With lower tiers ([`KvCache::with_tiers`]), an evicted block moves to the host, then to
//!   disk (see [`crate::offload`]) instead of being forgotten; a block registered on the
//!   device again (a request loaded it back) leaves its lower tier.
//!
//! Every change is reported as a KV event with this rank's next event id (0, 1, 2, …):
//! newly registered blocks as `Stored` (one event per contiguous run, with the parent's
//! engine hash), evictions as `Removed` (consecutive evictions from one tier share one
//! event), moves between tiers as a `Stored` in the new tier and a `Removed` in the old, and
//! [`KvCache::clear`] as `Cleared` (every tier). Events queue until [`KvCache::take_events`].

use crate::engine_hash::engine_block_hashes;
use crate::offload::{BlockMeta, LowerTiers, Move};
use kvrouter_protocol::{
    local_block_hashes, sequence_hashes, EngineBlockHash, EventId, KvEvent, KvEventData,
    LocalBlockHash, SequenceHash, StoredBlock, Tier, WorkerKey,
};
use rustc_hash::{FxHashMap, FxHashSet};
use std::fmt;
use thiserror::Error;

/// Index of a physical block in a rank's pool.
type BlockId = u32;
const NIL: BlockId = BlockId::MAX;

/// The hashes of a prompt's full blocks, computed once per request.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PromptBlocks {
    /// Router-compatible local hashes (no LoRA).
    pub local: Vec<LocalBlockHash>,
    /// Router-compatible sequence hashes: the prefix identity the cache is keyed by.
    pub seq: Vec<SequenceHash>,
    /// The engine's own chained block hashes, as published in events.
    pub engine: Vec<EngineBlockHash>,
}

impl PromptBlocks {
    /// Hashes every full block of `tokens`; a trailing partial block is ignored, and
    /// `block_size` 0 yields no blocks.
    pub fn new(tokens: &[u32], block_size: usize, engine_seed: u64) -> Self {
        let local = local_block_hashes(tokens, block_size, None).unwrap_or_default();
        let seq = sequence_hashes(&local);
        let engine = engine_block_hashes(engine_seed, tokens, block_size);
        debug_assert_eq!(local.len(), engine.len());
        Self { local, seq, engine }
    }

    /// Number of full blocks.
    pub fn len(&self) -> usize {
        self.seq.len()
    }

    /// The prompt has no full block.
    pub fn is_empty(&self) -> bool {
        self.seq.is_empty()
    }
}

/// The blocks one sequence holds, in token order. Created by [`KvCache::new_table`] and
/// handed back with [`KvCache::release`]; not `Clone`, so a table is released once.
#[derive(Debug, Default)]
pub struct BlockTable {
    blocks: Vec<BlockId>,
    /// Leading blocks that are registered (or adopted) prompt blocks.
    registered: usize,
    /// The cache epoch the table was made in; after a clear, a table registers nothing more.
    epoch: u64,
}

impl BlockTable {
    /// Blocks held.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Holds no block.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Leading blocks that are registered prompt blocks.
    pub fn registered(&self) -> usize {
        self.registered
    }
}

/// Not enough free or evictable blocks for an allocation.
#[derive(Debug, Error, Clone, Copy, PartialEq, Eq)]
#[error("KV cache full: {needed} blocks needed, {available} free or evictable")]
pub struct CacheFull {
    pub needed: usize,
    pub available: usize,
}

/// How much of a prompt's prefix is cached.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Leading blocks cached.
    pub blocks: usize,
    /// Of those, how many nobody references (reusing them takes them off the evictable list).
    pub unreferenced: usize,
}

/// One registered block, as [`KvCache::cached`] lists it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CachedBlock {
    pub engine_hash: EngineBlockHash,
    pub parent: Option<EngineBlockHash>,
    pub local_hash: LocalBlockHash,
    pub seq_hash: SequenceHash,
    pub ref_count: u32,
}

#[derive(Clone, Debug)]
struct Block {
    ref_count: u32,
    /// `Some` while registered (in the index).
    meta: Option<BlockMeta>,
    /// LRU links, meaningful while `ref_count == 0 && meta.is_some()`.
    prev: BlockId,
    next: BlockId,
}

/// The paged KV cache of one rank. See the module docs.
pub struct KvCache {
    key: WorkerKey,
    capacity: usize,
    /// Physical blocks created so far (grown lazily up to `capacity`).
    blocks: Vec<Block>,
    /// Unregistered blocks with no reference.
    free: Vec<BlockId>,
    /// Registered blocks by prefix identity.
    index: FxHashMap<SequenceHash, BlockId>,
    /// Registered blocks with no reference, least recently used at the head.
    lru_head: BlockId,
    lru_tail: BlockId,
    lru_len: usize,
    epoch: u64,
    next_event_id: EventId,
    pending: Vec<KvEvent>,
    /// Host and disk, when the rank has them.
    lower: Option<LowerTiers>,
    /// Scratch for the moves of one eviction.
    moves: Vec<Move>,
}

impl fmt::Debug for KvCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KvCache")
            .field("key", &self.key)
            .field("capacity", &self.capacity)
            .field("cached", &self.index.len())
            .field("evictable", &self.lru_len)
            .field("free", &self.free_blocks())
            .field("next_event_id", &self.next_event_id)
            .finish()
    }
}

impl KvCache {
    /// An empty cache of `capacity` blocks for rank `key`. Capacity is clamped to what a
    /// u32 block id can name.
    pub fn new(key: WorkerKey, capacity: usize) -> Self {
        Self::with_tiers(key, capacity, 0, 0)
    }

    /// Like [`new`](Self::new), with host and disk tiers of these capacities (blocks; 0 for
    /// none) that keep what the device evicts.
    pub fn with_tiers(
        key: WorkerKey,
        capacity: usize,
        host_capacity: usize,
        disk_capacity: usize,
    ) -> Self {
        Self {
            key,
            capacity: capacity.min(NIL as usize - 1),
            blocks: Vec::new(),
            free: Vec::new(),
            index: FxHashMap::default(),
            lru_head: NIL,
            lru_tail: NIL,
            lru_len: 0,
            epoch: 0,
            next_event_id: 0,
            pending: Vec::new(),
            lower: LowerTiers::new(host_capacity, disk_capacity),
            moves: Vec::new(),
        }
    }

    /// Blocks held in a lower tier (0 for the device or a tier the rank lacks).
    pub fn tier_blocks(&self, tier: Tier) -> usize {
        self.lower.as_ref().map_or(0, |l| l.len(tier))
    }

    /// How many blocks of `seq`, from its start, the lower tiers hold, by tier: what a
    /// request whose device prefix ends there loads instead of computing.
    pub fn match_lower(&self, seq: &[SequenceHash]) -> (usize, usize) {
        let (mut host, mut disk) = (0, 0);
        let Some(lower) = &self.lower else {
            return (0, 0);
        };
        for &s in seq {
            match lower.tier_of(s) {
                Some(Tier::Host) => host += 1,
                Some(_) => disk += 1,
                None => break,
            }
        }
        (host, disk)
    }

    /// The rank whose cache this is.
    pub fn key(&self) -> WorkerKey {
        self.key
    }

    /// Physical blocks.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Registered (published) blocks, referenced or not.
    pub fn cached_blocks(&self) -> usize {
        self.index.len()
    }

    /// Registered blocks nobody references: cached, evictable.
    pub fn evictable_blocks(&self) -> usize {
        self.lru_len
    }

    /// Blocks holding nothing.
    pub fn free_blocks(&self) -> usize {
        self.free.len() + (self.capacity - self.blocks.len())
    }

    /// Blocks an allocation may take: free plus evictable.
    pub fn available_blocks(&self) -> usize {
        self.free_blocks() + self.lru_len
    }

    /// Blocks referenced by at least one sequence.
    pub fn active_blocks(&self) -> usize {
        self.capacity - self.available_blocks()
    }

    /// Blocks holding something (referenced, or cached and evictable). Never above capacity.
    pub fn used_blocks(&self) -> usize {
        self.capacity - self.free_blocks()
    }

    /// The id of the last event this cache emitted (queued or taken), if any.
    pub fn last_event_id(&self) -> Option<EventId> {
        self.next_event_id.checked_sub(1)
    }

    /// Whether a block with this prefix identity is cached.
    pub fn contains(&self, seq: SequenceHash) -> bool {
        self.index.contains_key(&seq)
    }

    /// A new, empty block table for a sequence.
    pub fn new_table(&self) -> BlockTable {
        BlockTable {
            blocks: Vec::new(),
            registered: 0,
            epoch: self.epoch,
        }
    }

    /// How many leading blocks of `seq` are cached (no side effects).
    pub fn match_prefix(&self, seq: &[SequenceHash]) -> PrefixMatch {
        let mut m = PrefixMatch::default();
        for s in seq {
            let Some(&id) = self.index.get(s) else { break };
            m.blocks += 1;
            if self.blocks[id as usize].ref_count == 0 {
                m.unreferenced += 1;
            }
        }
        m
    }

    /// Takes a reference on the longest cached prefix of `seq` into `table`, which must be
    /// empty; returns how many blocks it took (0 if `table` is not empty or is stale).
    pub fn acquire_prefix(&mut self, table: &mut BlockTable, seq: &[SequenceHash]) -> usize {
        if !table.blocks.is_empty() || table.epoch != self.epoch {
            return 0;
        }
        for s in seq {
            let Some(&id) = self.index.get(s) else { break };
            self.ref_block(id);
            table.blocks.push(id);
        }
        table.registered = table.blocks.len();
        table.blocks.len()
    }

    /// Appends `n` unregistered blocks to `table`, evicting LRU cached blocks if no free
    /// block is left. All or nothing: fails without side effects if fewer than `n` blocks
    /// are free or evictable.
    pub fn allocate(&mut self, table: &mut BlockTable, n: usize) -> Result<(), CacheFull> {
        let available = self.available_blocks();
        if n > available {
            return Err(CacheFull {
                needed: n,
                available,
            });
        }
        table.blocks.reserve(n);
        for _ in 0..n {
            let id = self.take_block();
            table.blocks.push(id);
        }
        Ok(())
    }

    /// Registers the table's prompt blocks `table.registered()..full_computed` (those now
    /// fully computed) and queues one `Stored` event per contiguous run of newly registered
    /// blocks. A block already registered by another sequence is adopted instead (the
    /// table's own copy is freed). Does nothing for a table from before a [`clear`](Self::clear).
    pub fn commit(&mut self, table: &mut BlockTable, prompt: &PromptBlocks, full_computed: usize) {
        if table.epoch != self.epoch {
            return;
        }
        let end = full_computed.min(prompt.len()).min(table.blocks.len());
        let mut run: Vec<StoredBlock> = Vec::new();
        let mut run_parent = None;
        // Blocks now on the device that a lower tier held (tiers are exclusive).
        let mut loaded: Vec<(Tier, EngineBlockHash)> = Vec::new();
        for i in table.registered..end {
            let seq = prompt.seq[i];
            let parent = i.checked_sub(1).map(|p| prompt.engine[p]);
            let own = table.blocks[i];
            if let Some(&existing) = self.index.get(&seq) {
                self.flush_stored(run_parent, &mut run);
                if existing != own {
                    self.ref_block(existing);
                    self.unref_block(own);
                    table.blocks[i] = existing;
                }
            } else {
                let block = &mut self.blocks[own as usize];
                debug_assert!(block.meta.is_none() && block.ref_count > 0);
                block.meta = Some(BlockMeta {
                    seq,
                    engine: prompt.engine[i],
                    parent,
                    local: prompt.local[i],
                });
                self.index.insert(seq, own);
                if let Some(lower) = &mut self.lower {
                    if let Some((tier, m)) = lower.take(seq) {
                        loaded.push((tier, m.engine));
                    }
                }
                if run.is_empty() {
                    run_parent = parent;
                }
                run.push(StoredBlock {
                    engine_hash: prompt.engine[i],
                    local_hash: prompt.local[i],
                });
            }
            table.registered = i + 1;
        }
        self.flush_stored(run_parent, &mut run);
        for (tier, engine) in loaded {
            self.push_event_in(
                tier,
                KvEventData::Removed {
                    engine_hashes: vec![engine],
                },
            );
        }
    }

    /// Drops the table's references, last block first (so a prompt's tail is evicted before
    /// its head). Registered blocks stay cached; the others become free.
    pub fn release(&mut self, table: BlockTable) {
        for &id in table.blocks.iter().rev() {
            self.unref_block(id);
        }
    }

    /// Drops the whole prefix cache and queues a `Cleared` event. Blocks that running
    /// sequences still reference stay allocated to them, unregistered; those sequences
    /// register nothing more (their prefix is no longer published).
    pub fn clear(&mut self) {
        for (_, id) in self.index.drain() {
            let block = &mut self.blocks[id as usize];
            block.meta = None;
            block.prev = NIL;
            block.next = NIL;
            if block.ref_count == 0 {
                self.free.push(id);
            }
        }
        self.lru_head = NIL;
        self.lru_tail = NIL;
        self.lru_len = 0;
        self.epoch += 1;
        if let Some(lower) = &mut self.lower {
            lower.clear();
        }
        self.push_event(KvEventData::Cleared);
    }

    /// The queued events, oldest first.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.pending)
    }

    /// The current cache as `Stored` events, device first, then host and disk, parents
    /// before children within a tier, each of at most `max_blocks_per_event` blocks (at
    /// least 1), plus the last event id. Every event of the dump carries that last id (0 when
    /// there is none): a snapshot, not new events.
    pub fn state_events(&self, max_blocks_per_event: usize) -> (Vec<KvEvent>, Option<EventId>) {
        let last = self.last_event_id();
        let mut dump = TierDump {
            key: self.key,
            event_id: last.unwrap_or(0),
            max: max_blocks_per_event.max(1),
            events: Vec::new(),
        };
        let device = self
            .index
            .values()
            .filter_map(|&id| self.blocks[id as usize].meta);
        dump.tier(Tier::Device, device);
        if let Some(lower) = &self.lower {
            for tier in [Tier::Host, Tier::Disk] {
                dump.tier(tier, lower.blocks(tier));
            }
        }
        (dump.events, last)
    }

    /// Every registered block.
    pub fn cached(&self) -> impl Iterator<Item = CachedBlock> + '_ {
        self.index.values().filter_map(|&id| {
            let b = &self.blocks[id as usize];
            b.meta.map(|m| CachedBlock {
                engine_hash: m.engine,
                parent: m.parent,
                local_hash: m.local,
                seq_hash: m.seq,
                ref_count: b.ref_count,
            })
        })
    }

    /// Every block of a lower tier (unreferenced: nothing runs from a lower tier).
    pub fn lower_cached(&self, tier: Tier) -> impl Iterator<Item = CachedBlock> + '_ {
        self.lower
            .iter()
            .flat_map(move |l| l.blocks(tier))
            .map(|m| CachedBlock {
                engine_hash: m.engine,
                parent: m.parent,
                local_hash: m.local,
                seq_hash: m.seq,
                ref_count: 0,
            })
    }

    /// Checks the internal bookkeeping; with `tables`, also that every block's reference
    /// count equals the number of times the tables hold it. For tests.
    pub fn check_invariants<'a>(
        &self,
        tables: impl IntoIterator<Item = &'a BlockTable>,
    ) -> Result<(), String> {
        if self.blocks.len() > self.capacity {
            return Err(format!(
                "{} blocks exceed capacity {}",
                self.blocks.len(),
                self.capacity
            ));
        }
        let mut in_free = vec![false; self.blocks.len()];
        for &id in &self.free {
            let b = &self.blocks[id as usize];
            if in_free[id as usize] || b.ref_count != 0 || b.meta.is_some() {
                return Err(format!("bad free block {id}: {b:?}"));
            }
            in_free[id as usize] = true;
        }
        let mut in_lru = vec![false; self.blocks.len()];
        let (mut cur, mut prev, mut n) = (self.lru_head, NIL, 0);
        while cur != NIL {
            let b = &self.blocks[cur as usize];
            if in_lru[cur as usize] || b.ref_count != 0 || b.meta.is_none() || b.prev != prev {
                return Err(format!("bad LRU block {cur}: {b:?}"));
            }
            in_lru[cur as usize] = true;
            n += 1;
            prev = cur;
            cur = b.next;
        }
        if n != self.lru_len || prev != self.lru_tail {
            return Err(format!("LRU length {n} != {}", self.lru_len));
        }
        let mut registered = 0;
        for (i, b) in self.blocks.iter().enumerate() {
            if let Some(m) = b.meta {
                registered += 1;
                if self.index.get(&m.seq) != Some(&(i as BlockId)) {
                    return Err(format!("registered block {i} not indexed"));
                }
            }
            if b.ref_count == 0 && !in_free[i] && !in_lru[i] {
                return Err(format!("unreferenced block {i} leaked: {b:?}"));
            }
        }
        if let Some(lower) = &self.lower {
            for tier in [Tier::Host, Tier::Disk] {
                if let Some(m) = lower.blocks(tier).find(|m| self.index.contains_key(&m.seq)) {
                    return Err(format!("block {m:?} is on the device and in {tier:?}"));
                }
            }
        }
        if registered != self.index.len() {
            return Err(format!(
                "{registered} registered blocks, index has {}",
                self.index.len()
            ));
        }
        let mut counts = vec![0u32; self.blocks.len()];
        let mut any_table = false;
        for t in tables {
            any_table = true;
            for &id in &t.blocks {
                counts[id as usize] += 1;
            }
            if t.epoch == self.epoch {
                for &id in &t.blocks[..t.registered] {
                    if self.blocks[id as usize].meta.is_none() {
                        return Err(format!("table's registered block {id} is not registered"));
                    }
                }
            }
        }
        if any_table {
            for (i, b) in self.blocks.iter().enumerate() {
                if b.ref_count != counts[i] {
                    return Err(format!(
                        "block {i} ref_count {} but held {} times",
                        b.ref_count, counts[i]
                    ));
                }
            }
        }
        Ok(())
    }

    fn take_block(&mut self) -> BlockId {
        let id = if let Some(id) = self.free.pop() {
            id
        } else if self.blocks.len() < self.capacity {
            self.blocks.push(Block {
                ref_count: 0,
                meta: None,
                prev: NIL,
                next: NIL,
            });
            (self.blocks.len() - 1) as BlockId
        } else {
            let id = self.lru_head;
            debug_assert!(id != NIL, "allocate checked availability");
            self.lru_remove(id);
            let meta = self.blocks[id as usize].meta.take();
            if let Some(m) = meta {
                self.index.remove(&m.seq);
                self.offload(m);
                self.push_event(KvEventData::Removed {
                    engine_hashes: vec![m.engine],
                });
            }
            id
        };
        self.blocks[id as usize].ref_count = 1;
        id
    }

    fn ref_block(&mut self, id: BlockId) {
        if self.blocks[id as usize].ref_count == 0 {
            self.lru_remove(id);
        }
        self.blocks[id as usize].ref_count += 1;
    }

    fn unref_block(&mut self, id: BlockId) {
        let b = &mut self.blocks[id as usize];
        debug_assert!(b.ref_count > 0);
        b.ref_count = b.ref_count.saturating_sub(1);
        if b.ref_count == 0 {
            if b.meta.is_some() {
                self.lru_push_back(id);
            } else {
                self.free.push(id);
            }
        }
    }

    fn lru_push_back(&mut self, id: BlockId) {
        let tail = self.lru_tail;
        {
            let b = &mut self.blocks[id as usize];
            b.prev = tail;
            b.next = NIL;
        }
        if tail == NIL {
            self.lru_head = id;
        } else {
            self.blocks[tail as usize].next = id;
        }
        self.lru_tail = id;
        self.lru_len += 1;
    }

    fn lru_remove(&mut self, id: BlockId) {
        let (prev, next) = {
            let b = &mut self.blocks[id as usize];
            let pn = (b.prev, b.next);
            b.prev = NIL;
            b.next = NIL;
            pn
        };
        if prev == NIL {
            self.lru_head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.lru_tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        self.lru_len -= 1;
    }

    /// Moves a block the device evicted into the lower tiers, if any.
    fn offload(&mut self, m: BlockMeta) {
        let Some(lower) = &mut self.lower else {
            return;
        };
        let mut moves = std::mem::take(&mut self.moves);
        lower.offload(m, &mut moves);
        for mv in moves.drain(..) {
            match mv {
                Move::Stored(tier, b) => self.push_event_in(
                    tier,
                    KvEventData::Stored {
                        parent: b.parent,
                        blocks: vec![StoredBlock {
                            engine_hash: b.engine,
                            local_hash: b.local,
                        }],
                    },
                ),
                Move::Removed(tier, engine) => self.push_event_in(
                    tier,
                    KvEventData::Removed {
                        engine_hashes: vec![engine],
                    },
                ),
            }
        }
        self.moves = moves;
    }

    fn flush_stored(&mut self, parent: Option<EngineBlockHash>, run: &mut Vec<StoredBlock>) {
        if !run.is_empty() {
            let blocks = std::mem::take(run);
            self.push_event(KvEventData::Stored { parent, blocks });
        }
    }

    fn push_event(&mut self, data: KvEventData) {
        self.push_event_in(Tier::Device, data)
    }

    /// Queues an event with the next id; a `Removed` right after a `Removed` from the same
    /// tier joins it.
    fn push_event_in(&mut self, tier: Tier, data: KvEventData) {
        if let KvEventData::Removed { engine_hashes } = &data {
            if let Some(KvEvent {
                tier: prev_tier,
                data:
                    KvEventData::Removed {
                        engine_hashes: prev,
                    },
                ..
            }) = self.pending.last_mut()
            {
                if *prev_tier == tier {
                    prev.extend_from_slice(engine_hashes);
                    return;
                }
            }
        }
        self.pending.push(KvEvent {
            tier,
            key: self.key,
            event_id: self.next_event_id,
            data,
        });
        self.next_event_id += 1;
    }
}

/// Builds a state dump, one tier at a time.
struct TierDump {
    key: WorkerKey,
    event_id: EventId,
    max: usize,
    events: Vec<KvEvent>,
}

impl TierDump {
    /// The blocks of one tier as chains, parents first: a block whose parent is not in this
    /// tier starts a chain with that parent named (it is in a tier above, or was dropped).
    fn tier(&mut self, tier: Tier, metas: impl Iterator<Item = BlockMeta>) {
        let by_engine: FxHashMap<EngineBlockHash, BlockMeta> =
            metas.map(|m| (m.engine, m)).collect();
        let mut children: FxHashMap<EngineBlockHash, Vec<EngineBlockHash>> = FxHashMap::default();
        let mut roots = Vec::new();
        for m in by_engine.values() {
            match m.parent {
                Some(p) if by_engine.contains_key(&p) => {
                    children.entry(p).or_default().push(m.engine)
                }
                _ => roots.push(m.engine),
            }
        }
        for kids in children.values_mut() {
            kids.sort_unstable();
        }
        roots.sort_unstable();
        roots.reverse();

        let (key, event_id, max) = (self.key, self.event_id, self.max);
        let mut emit = |parent: Option<EngineBlockHash>, blocks: Vec<StoredBlock>| {
            self.events.push(KvEvent {
                tier,
                key,
                event_id,
                data: KvEventData::Stored { parent, blocks },
            });
        };
        let mut visited: FxHashSet<EngineBlockHash> = FxHashSet::default();
        let mut stack = roots;
        while let Some(start) = stack.pop() {
            let mut chunk_parent = by_engine[&start].parent;
            let mut chunk: Vec<StoredBlock> = Vec::new();
            let mut cur = start;
            loop {
                if !visited.insert(cur) {
                    break; // only on an engine-hash collision cycle
                }
                let m = by_engine[&cur];
                chunk.push(StoredBlock {
                    engine_hash: m.engine,
                    local_hash: m.local,
                });
                if chunk.len() == max {
                    emit(chunk_parent, std::mem::take(&mut chunk));
                    chunk_parent = Some(cur);
                }
                let Some(kids) = children.get(&cur) else {
                    break;
                };
                stack.extend(kids[1..].iter().rev());
                cur = kids[0];
            }
            if !chunk.is_empty() {
                emit(chunk_parent, chunk);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine_hash::DEFAULT_ENGINE_HASH_SEED;

    const KEY: WorkerKey = WorkerKey::new(7, 1);

    fn prompt(tokens: &[u32], bs: usize) -> PromptBlocks {
        PromptBlocks::new(tokens, bs, DEFAULT_ENGINE_HASH_SEED)
    }

    /// Allocates, computes and registers a whole prompt; returns its table.
    fn run_prompt(c: &mut KvCache, p: &PromptBlocks) -> BlockTable {
        let mut t = c.new_table();
        let hit = c.acquire_prefix(&mut t, &p.seq);
        c.allocate(&mut t, p.len() - hit).unwrap();
        c.commit(&mut t, p, p.len());
        t
    }

    #[test]
    fn stores_reuses_and_reports_router_hashes() {
        let mut c = KvCache::new(KEY, 10);
        let tokens: Vec<u32> = (0..12).collect();
        let p = prompt(&tokens, 4);
        let t = run_prompt(&mut c, &p);
        let ev = c.take_events();
        assert_eq!(ev.len(), 1);
        assert_eq!(ev[0].event_id, 0);
        assert_eq!(ev[0].key, KEY);
        let KvEventData::Stored { parent, blocks } = &ev[0].data else {
            panic!("{ev:?}")
        };
        assert_eq!(*parent, None);
        let local = local_block_hashes(&tokens, 4, None).unwrap();
        assert_eq!(
            blocks.iter().map(|b| b.local_hash).collect::<Vec<_>>(),
            local
        );
        assert_eq!(
            blocks.iter().map(|b| b.engine_hash).collect::<Vec<_>>(),
            p.engine
        );
        assert_eq!(c.active_blocks(), 3);
        c.release(t);
        assert_eq!((c.active_blocks(), c.cached_blocks()), (0, 3));
        assert_eq!(c.evictable_blocks(), 3);

        // A longer prompt with the same prefix reuses 3 blocks and stores one more.
        let tokens2: Vec<u32> = (0..16).collect();
        let p2 = prompt(&tokens2, 4);
        assert_eq!(
            c.match_prefix(&p2.seq),
            PrefixMatch {
                blocks: 3,
                unreferenced: 3
            }
        );
        let t2 = run_prompt(&mut c, &p2);
        let ev = c.take_events();
        assert_eq!(ev.len(), 1);
        assert_eq!(ev[0].event_id, 1);
        assert_eq!(
            ev[0].data,
            KvEventData::Stored {
                parent: Some(p.engine[2]),
                blocks: vec![StoredBlock {
                    engine_hash: p2.engine[3],
                    local_hash: p2.local[3]
                }]
            }
        );
        c.check_invariants([&t2]).unwrap();
        c.release(t2);
        c.check_invariants([]).unwrap();
    }

    #[test]
    fn evicts_lru_tail_first_and_never_referenced_blocks() {
        let mut c = KvCache::new(KEY, 4);
        let a = prompt(&(0..12).collect::<Vec<_>>(), 4); // 3 blocks
        let ta = run_prompt(&mut c, &a);
        c.release(ta);
        c.take_events();
        // A 2-block prompt needs 2 blocks: one free, one evicted: a's tail (block 2).
        let b = prompt(&(100..108).collect::<Vec<_>>(), 4);
        let tb = run_prompt(&mut c, &b);
        let ev = c.take_events();
        assert_eq!(
            ev[0].data,
            KvEventData::Removed {
                engine_hashes: vec![a.engine[2]]
            }
        );
        assert!(matches!(ev[1].data, KvEventData::Stored { .. }));
        assert_eq!((ev[0].event_id, ev[1].event_id), (1, 2));
        // Everything is referenced or cached: 2 held by b, 2 evictable (a's head).
        let mut t = c.new_table();
        assert_eq!(
            c.allocate(&mut t, 3),
            Err(CacheFull {
                needed: 3,
                available: 2
            })
        );
        assert!(t.is_empty());
        c.allocate(&mut t, 2).unwrap();
        let ev = c.take_events();
        assert_eq!(ev.len(), 1, "consecutive evictions share one event");
        assert_eq!(
            ev[0].data,
            KvEventData::Removed {
                engine_hashes: vec![a.engine[1], a.engine[0]]
            }
        );
        assert!(b.seq.iter().all(|&s| c.contains(s)));
        c.check_invariants([&tb, &t]).unwrap();
        assert_eq!(c.used_blocks(), 4);
    }

    #[test]
    fn concurrent_duplicate_is_adopted_not_republished() {
        let mut c = KvCache::new(KEY, 10);
        let p = prompt(&(0..8).collect::<Vec<_>>(), 4);
        let mut t1 = c.new_table();
        let mut t2 = c.new_table();
        c.allocate(&mut t1, 2).unwrap();
        c.allocate(&mut t2, 2).unwrap();
        c.commit(&mut t1, &p, 2);
        c.commit(&mut t2, &p, 2);
        assert_eq!(c.take_events().len(), 1);
        assert_eq!(c.active_blocks(), 2);
        c.check_invariants([&t1, &t2]).unwrap();
        c.release(t1);
        c.release(t2);
        assert_eq!((c.active_blocks(), c.evictable_blocks()), (0, 2));
    }

    #[test]
    fn clear_unpublishes_but_keeps_running_blocks() {
        let mut c = KvCache::new(KEY, 10);
        let p = prompt(&(0..8).collect::<Vec<_>>(), 4);
        let q = prompt(&(50..58).collect::<Vec<_>>(), 4);
        let tp = run_prompt(&mut c, &p);
        let tq = run_prompt(&mut c, &q);
        c.release(tq);
        c.take_events();
        c.clear();
        let ev = c.take_events();
        assert_eq!(ev.len(), 1);
        assert_eq!((ev[0].event_id, &ev[0].data), (2, &KvEventData::Cleared));
        assert_eq!(c.cached_blocks(), 0);
        assert_eq!(c.active_blocks(), 2);
        c.check_invariants([&tp]).unwrap();
        c.release(tp);
        assert_eq!(c.free_blocks(), 10);
        c.check_invariants([]).unwrap();
    }

    #[test]
    fn state_dump_orders_parents_first_and_chunks() {
        let mut c = KvCache::new(KEY, 100);
        let base: Vec<u32> = (0..20).collect();
        let mut other = base.clone();
        other[9] = 999; // branches at block 2 (size 4)
        for toks in [&base, &other] {
            let t = run_prompt(&mut c, &prompt(toks, 4));
            c.release(t);
        }
        let (events, last) = c.state_events(2);
        assert_eq!(last, Some(1));
        let mut seen: FxHashSet<EngineBlockHash> = FxHashSet::default();
        let mut total = 0;
        for e in &events {
            assert_eq!(e.event_id, 1);
            let KvEventData::Stored { parent, blocks } = &e.data else {
                panic!()
            };
            assert!(blocks.len() <= 2 && !blocks.is_empty());
            if let Some(p) = parent {
                assert!(seen.contains(p), "parent before child");
            }
            for b in blocks {
                seen.insert(b.engine_hash);
            }
            total += blocks.len();
        }
        assert_eq!(total, 5 + 3);
        assert_eq!(total, c.cached_blocks());
        assert_eq!(KvCache::new(KEY, 1).state_events(4), (vec![], None));
    }
}

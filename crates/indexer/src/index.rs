//! The index core: which worker ranks hold which prompt prefixes. Synchronous, no I/O.
//!
//! Layout, chosen for lookup speed and bytes per (block, rank) pair:
//! - `blocks`: one 24-byte entry per distinct cached prefix, keyed by its
//!   [`prefix`](crate::prefix) id: its parent's id (for dumps) and the set of worker slots
//!   holding it. A lookup does one probe per query block; the probes do not depend on each
//!   other, so the CPU overlaps their cache misses. (Own open-addressing tables that
//!   prefetch explicitly were measured: faster lookups, but slower deletes under churn and
//!   more memory at scale; see docs/benchmarks.md.)
//! - per rank, `aliases`: engine block hash → prefix id, 16 bytes per (block, rank) pair. A
//!   rank's table is small enough to stay in cache while its events are applied. Engine
//!   hashes stay opaque: they only resolve a `Stored` parent and the blocks of a `Removed`.
//!
//! Semantics (mirrored by the reference model in the tests): a rank holds a set of prefixes;
//! its overlap with a query is the largest `k` such that it holds every prefix of the query of
//! length `1..=k`. An engine hash names the prefix it was last stored with; removing any name
//! of a prefix drops the prefix.

use crate::error::IndexError;
use crate::holders::{HolderArena, Holders};
use crate::overlap::OverlapScores;
use crate::prefix::{self, PrefixChain, ROOT};
use crate::table_alloc::TableAlloc;
use hashbrown::HashTable;
use kvrouter_protocol::{
    EngineBlockHash, EventId, KvEvent, KvEventData, LocalBlockHash, StoredBlock, Tier, WorkerId,
    WorkerKey,
};
use rustc_hash::FxHashMap;
use smallvec::SmallVec;
use tiers::LowerTiers;

mod tiers;

#[derive(Clone, Copy)]
struct Block {
    prefix: u64,
    parent: u64,
    holders: Holders,
}

/// An engine hash of one rank and the prefix it names.
#[derive(Clone, Copy)]
struct Alias {
    engine: u64,
    prefix: u64,
}

/// See [`TableAlloc`]: the system allocator, with huge pages for big tables.
type Table<T> = HashTable<T, TableAlloc>;

fn new_table<T>() -> Table<T> {
    HashTable::new_in(TableAlloc)
}

/// Under churn hashbrown tables keep their peak size (and grow further on tombstones): shrink
/// one that has fallen below a third full.
fn maybe_shrink<T>(t: &mut Table<T>, hasher: impl Fn(&T) -> u64) {
    let cap = t.capacity();
    if cap > 64 && t.len() * 3 < cap {
        t.shrink_to(t.len() * 3 / 2, hasher);
    }
}

struct Rank {
    key: WorkerKey,
    aliases: Table<Alias>,
    held: usize,
    last_event_id: Option<EventId>,
    needs_recovery: bool,
}

#[inline(always)]
fn engine_hash_of(e: u64) -> u64 {
    // Folded multiply: engine hashes may be small or sequential; spread them over all bits.
    let m = (e as u128).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835);
    (m as u64) ^ ((m >> 64) as u64)
}

/// Counters since the index was created.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexCounters {
    pub events_applied: u64,
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    /// Blocks named in a `Removed` that the rank did not hold.
    pub removed_unknown_blocks: u64,
    /// Duplicate or older event ids, dropped.
    pub stale_events: u64,
    /// Event-id gaps seen (each raises a recovery request for its rank).
    pub gaps: u64,
    pub rejected_missing_parent: u64,
    pub rejected_block_limit: u64,
}

/// A snapshot of the index's size.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Distinct cached prefixes.
    pub live_blocks: usize,
    /// (prefix, worker key) pairs.
    pub live_pairs: usize,
    pub worker_keys: usize,
    /// Bytes allocated by the index's tables (allocator slack not included).
    pub table_bytes: usize,
    /// (prefix, worker key) pairs in host and disk tiers, and shared blocks.
    pub lower_tier_pairs: usize,
    pub counters: IndexCounters,
}

/// What applying one event did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    pub stored: usize,
    pub removed: usize,
    /// Blocks of a `Removed` the rank did not hold.
    pub skipped: usize,
    /// Number of event ids missing before this event (0 when in sequence).
    pub gap: u64,
}

/// Events that rebuild one rank: load them with [`Index::load_rank`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankDump {
    pub key: WorkerKey,
    pub last_event_id: Option<EventId>,
    pub events: Vec<KvEvent>,
}

/// Extra room over a worker's registered capacity before its `Stored` events are refused.
pub fn block_limit_for_capacity(capacity_blocks: usize) -> usize {
    capacity_blocks + capacity_blocks / 4 + 64
}

/// The KV block index of a set of worker ranks.
pub struct Index {
    blocks: Table<Block>,
    arena: HolderArena,
    ranks: Vec<Option<Rank>>,
    /// Key of each slot, dense, for turning holder bits into worker keys.
    slot_keys: Vec<WorkerKey>,
    slots: FxHashMap<WorkerKey, u32>,
    limits: FxHashMap<WorkerId, usize>,
    live_pairs: usize,
    counters: IndexCounters,
    /// Host, disk and shared blocks; `None` until the first lower-tier event.
    lower: Option<Box<LowerTiers>>,
}

impl Default for Index {
    fn default() -> Self {
        Self {
            blocks: new_table(),
            arena: HolderArena::default(),
            ranks: Vec::new(),
            slot_keys: Vec::new(),
            slots: FxHashMap::default(),
            limits: FxHashMap::default(),
            live_pairs: 0,
            counters: IndexCounters::default(),
            lower: None,
        }
    }
}

impl Index {
    pub fn new() -> Self {
        Self::default()
    }

    /// Refuse `Stored` events that would make any rank of `worker_id` hold more than `limit`
    /// blocks (`None` lifts the limit). See [`block_limit_for_capacity`].
    pub fn set_block_limit(&mut self, worker_id: WorkerId, limit: Option<usize>) {
        match limit {
            Some(l) => self.limits.insert(worker_id, l),
            None => self.limits.remove(&worker_id),
        };
    }

    /// Applies one event, checking its id against the rank's last one.
    pub fn apply(&mut self, event: &KvEvent) -> Result<Applied, IndexError> {
        let slot = self.slot_for(event.key);
        let rank = self.rank_mut(slot);
        let mut gap = 0;
        if let Some(last) = rank.last_event_id {
            if event.event_id <= last {
                self.counters.stale_events += 1;
                return Err(IndexError::StaleEvent {
                    key: event.key,
                    event_id: event.event_id,
                    last,
                });
            }
            gap = event.event_id - last - 1;
            if gap > 0 {
                rank.needs_recovery = true;
            }
        }
        rank.last_event_id = Some(event.event_id);
        if gap > 0 {
            self.counters.gaps += 1;
        }
        let mut applied = self.apply_in(slot, event.tier, &event.data)?;
        applied.gap = gap;
        Ok(applied)
    }

    /// Applies a device event's content without event-id checks (dumps, approximate mode).
    /// Removals for an unknown rank are ignored rather than creating it.
    pub fn apply_unsequenced(
        &mut self,
        key: WorkerKey,
        data: &KvEventData,
    ) -> Result<Applied, IndexError> {
        self.apply_unsequenced_in(key, Tier::Device, data)
    }

    /// [`Index::apply_unsequenced`] for the blocks of any tier.
    pub fn apply_unsequenced_in(
        &mut self,
        key: WorkerKey,
        tier: Tier,
        data: &KvEventData,
    ) -> Result<Applied, IndexError> {
        let slot = match (self.slots.get(&key), data) {
            (Some(&s), _) => s,
            (None, KvEventData::Stored { .. }) => self.slot_for(key),
            (None, _) => return Ok(Applied::default()),
        };
        self.apply_in(slot, tier, data)
    }

    fn apply_data(&mut self, slot: u32, data: &KvEventData) -> Result<Applied, IndexError> {
        let out = match data {
            KvEventData::Stored { parent, blocks } => self.store(slot, *parent, blocks)?,
            KvEventData::Removed { engine_hashes } => self.remove_blocks(slot, engine_hashes),
            KvEventData::Cleared => {
                let removed = self.clear_slot(slot);
                Applied {
                    removed,
                    ..Applied::default()
                }
            }
        };
        self.counters.events_applied += 1;
        self.counters.stored_blocks += out.stored as u64;
        self.counters.removed_blocks += out.removed as u64;
        self.counters.removed_unknown_blocks += out.skipped as u64;
        Ok(out)
    }

    fn store(
        &mut self,
        slot: u32,
        parent: Option<EngineBlockHash>,
        blocks: &[StoredBlock],
    ) -> Result<Applied, IndexError> {
        let rank = self.ranks[slot as usize].as_ref().expect("slot in use");
        let key = rank.key;
        let prefix = match parent {
            None => ROOT,
            Some(pe) => match self.resolve_parent(key, Tier::Device, pe.0) {
                Some(p) => p,
                None => {
                    self.counters.rejected_missing_parent += 1;
                    return Err(IndexError::MissingParent { key, parent: pe });
                }
            },
        };
        if let Err(e) = self.within_limit(key, rank.held, blocks.len()) {
            self.counters.rejected_block_limit += 1;
            return Err(e);
        }
        self.store_from(slot, prefix, blocks)
    }

    /// Whether `key`, holding `held` blocks here, may take `adding` more under its worker's
    /// limit in this index.
    fn within_limit(&self, key: WorkerKey, held: usize, adding: usize) -> Result<(), IndexError> {
        match self.limits.get(&key.worker_id) {
            Some(&limit) if held + adding > limit => Err(IndexError::BlockLimit {
                key,
                held,
                adding,
                limit,
            }),
            _ => Ok(()),
        }
    }

    /// Stores a chain of blocks below the prefix `prefix` (resolved, held, or the root).
    fn store_from(
        &mut self,
        slot: u32,
        mut prefix: u64,
        blocks: &[StoredBlock],
    ) -> Result<Applied, IndexError> {
        let Self {
            blocks: table,
            arena,
            ranks,
            live_pairs,
            ..
        } = self;
        let rank = ranks[slot as usize].as_mut().expect("slot in use");
        let ids: SmallVec<[u64; 64]> = blocks
            .iter()
            .scan(prefix, |p, b| {
                *p = prefix::extend(*p, b.local_hash.0);
                Some(*p)
            })
            .collect();
        let mut stored = 0;
        for (i, b) in blocks.iter().enumerate() {
            let p = ids[i];
            let e = b.engine_hash.0;
            let h = engine_hash_of(e);
            match rank.aliases.find_mut(h, |a| a.engine == e) {
                Some(alias) if alias.prefix != p => {
                    // The engine reused a hash for another block: the old block is gone.
                    let old = std::mem::replace(&mut alias.prefix, p);
                    release(table, arena, &mut rank.held, live_pairs, old, slot);
                }
                Some(_) => {}
                None => {
                    rank.aliases.insert_unique(
                        h,
                        Alias {
                            engine: e,
                            prefix: p,
                        },
                        |a| engine_hash_of(a.engine),
                    );
                }
            }
            let entry = table
                .entry(p, |b| b.prefix == p, |b| b.prefix)
                .or_insert(Block {
                    prefix: p,
                    parent: prefix,
                    holders: Holders::EMPTY,
                });
            let added = arena.insert(&mut entry.into_mut().holders, slot);
            if added {
                rank.held += 1;
                *live_pairs += 1;
                stored += 1;
            }
            prefix = p;
        }
        Ok(Applied {
            stored,
            ..Applied::default()
        })
    }

    fn remove_blocks(&mut self, slot: u32, engine_hashes: &[EngineBlockHash]) -> Applied {
        let Self {
            blocks: table,
            arena,
            ranks,
            live_pairs,
            ..
        } = self;
        let rank = ranks[slot as usize].as_mut().expect("slot in use");
        let mut out = Applied::default();
        for e in engine_hashes {
            let found = rank
                .aliases
                .find_entry(engine_hash_of(e.0), |a| a.engine == e.0)
                .ok()
                .map(|entry| entry.remove().0.prefix);
            let Some(p) = found else {
                out.skipped += 1;
                continue;
            };
            if release(table, arena, &mut rank.held, live_pairs, p, slot) {
                out.removed += 1;
            } else {
                out.skipped += 1;
            }
        }
        maybe_shrink(&mut rank.aliases, |a| engine_hash_of(a.engine));
        maybe_shrink(table, |b| b.prefix);
        out
    }

    /// Drops every block of a slot; returns how many it held.
    fn clear_slot(&mut self, slot: u32) -> usize {
        let Self {
            blocks: table,
            arena,
            ranks,
            live_pairs,
            ..
        } = self;
        let rank = ranks[slot as usize].as_mut().expect("slot in use");
        let mut removed = 0;
        for a in std::mem::replace(&mut rank.aliases, new_table()).iter() {
            if release(table, arena, &mut rank.held, live_pairs, a.prefix, slot) {
                removed += 1;
            }
        }
        debug_assert_eq!(rank.held, 0);
        maybe_shrink(table, |b| b.prefix);
        removed
    }

    /// Forgets one rank entirely (blocks, event-id state, recovery flag).
    pub fn remove_worker_rank(&mut self, key: WorkerKey) -> bool {
        let Some(slot) = self.slots.get(&key).copied() else {
            return false;
        };
        self.clear_slot(slot);
        self.ranks[slot as usize] = None;
        self.slots.remove(&key);
        self.forget_lower(key);
        true
    }

    /// Forgets every rank of a worker; returns how many ranks were removed.
    pub fn remove_worker(&mut self, worker_id: WorkerId) -> usize {
        let keys: SmallVec<[WorkerKey; 8]> = self
            .slots
            .keys()
            .filter(|k| k.worker_id == worker_id)
            .copied()
            .collect();
        self.limits.remove(&worker_id);
        keys.into_iter()
            .filter(|k| self.remove_worker_rank(*k))
            .count()
    }

    /// Overlap of every worker key with the query's leading blocks, by tier.
    pub fn find_matches(&self, local: &[LocalBlockHash]) -> OverlapScores {
        let mut chain = PrefixChain::new(local);
        let mut out = OverlapScores::default();
        self.find_matches_in(&mut chain, &mut out);
        out
    }

    /// Adds this index's overlaps for `chain` to `out` (keys with overlap 0 omitted).
    pub fn find_matches_in(&self, chain: &mut PrefixChain<'_>, out: &mut OverlapScores) {
        let first = out.scores.len();
        self.device_matches(chain, &mut out.scores);
        self.lower_matches(chain, first, out);
    }

    /// The device overlaps, appended to `out`.
    fn device_matches(&self, chain: &mut PrefixChain<'_>, out: &mut Vec<(WorkerKey, u32)>) {
        let n = chain.len();
        if n == 0 || self.blocks.is_empty() {
            return;
        }
        let Some(first) = self.holders_at(chain.get(0)) else {
            return;
        };
        let first = self.arena.view(first);
        let mut mask = first.mask;
        let mut high: SmallVec<[u32; 8]> = SmallVec::from_slice(first.high());
        let mut i = 1;
        loop {
            if mask == 0 && high.is_empty() {
                return;
            }
            if i == n {
                self.emit(mask, &high, n, out);
                return;
            }
            let h = self.holders_at(chain.get(i)).unwrap_or(Holders::EMPTY);
            let view = self.arena.view(h);
            let (hmask, hhigh) = (view.mask, view.high());
            let next = mask & hmask;
            if next != mask {
                self.emit(mask & !next, &[], i, out);
                mask = next;
            }
            // Sorted lists: one merge pass (a shared system prompt may have thousands of
            // holders), and none when the next block has the same holders.
            if !high.is_empty() && high.as_slice() != hhigh {
                let mut dropped: SmallVec<[u32; 8]> = SmallVec::new();
                let (mut j, mut kept) = (0, 0);
                for k in 0..high.len() {
                    let s = high[k];
                    while j < hhigh.len() && hhigh[j] < s {
                        j += 1;
                    }
                    if hhigh.get(j) == Some(&s) {
                        high[kept] = s;
                        kept += 1;
                    } else {
                        dropped.push(s);
                    }
                }
                high.truncate(kept);
                if !dropped.is_empty() {
                    self.emit(0, &dropped, i, out);
                }
            }
            i += 1;
        }
    }

    #[inline]
    fn emit(&self, mut mask: u64, high: &[u32], overlap: usize, out: &mut Vec<(WorkerKey, u32)>) {
        while mask != 0 {
            let s = mask.trailing_zeros();
            out.push((self.slot_keys[s as usize], overlap as u32));
            mask &= mask - 1;
        }
        for &s in high {
            out.push((self.slot_keys[s as usize], overlap as u32));
        }
    }

    #[inline(always)]
    fn holders_at(&self, p: u64) -> Option<Holders> {
        self.blocks.find(p, |b| b.prefix == p).map(|b| b.holders)
    }

    /// The local hash of the block `key` holds under engine hash `engine` in any tier, if it
    /// holds one (an engine may name an offloaded block by its hash alone).
    pub fn local_hash(&self, key: WorkerKey, engine: EngineBlockHash) -> Option<LocalBlockHash> {
        self.local_hash_here(key, engine)
            .or_else(|| self.lower_local_hash(key, engine))
    }

    fn local_hash_here(&self, key: WorkerKey, engine: EngineBlockHash) -> Option<LocalBlockHash> {
        let &slot = self.slots.get(&key)?;
        let rank = self.ranks[slot as usize].as_ref()?;
        let p = alias_of(&rank.aliases, engine.0)?;
        let b = self.blocks.find(p, |b| b.prefix == p)?;
        self.arena
            .contains(b.holders, slot)
            .then(|| LocalBlockHash(prefix::local_of(p, b.parent)))
    }

    /// Events that rebuild `key` exactly: device blocks, then host, then disk, parents
    /// before children within a tier. Blocks cut off from the root (a removed ancestor, in
    /// no tier) match nothing and are left out.
    pub fn dump(&self, key: WorkerKey) -> Option<RankDump> {
        let &slot = self.slots.get(&key)?;
        let rank = self.ranks[slot as usize].as_ref()?;
        // Only chains rooted in another tier need it: none without lower tiers.
        let engine_of = match self.lower {
            Some(_) => self.engine_hashes_of(key),
            None => FxHashMap::default(),
        };
        let event_id = rank.last_event_id.unwrap_or(0);
        let mut events: Vec<KvEvent> = self
            .chains(slot, &engine_of)
            .into_iter()
            .map(|(parent, blocks)| KvEvent {
                key,
                event_id,
                tier: Tier::Device,
                data: KvEventData::Stored { parent, blocks },
            })
            .collect();
        self.dump_lower(key, &engine_of, &mut events);
        Some(RankDump {
            key,
            last_event_id: rank.last_event_id,
            events,
        })
    }

    /// The blocks `slot` holds as `Stored` chains, parents first. A chain starts at the root
    /// or below a prefix the rank holds elsewhere (`engine_of`, another tier).
    fn chains(
        &self,
        slot: u32,
        engine_of: &FxHashMap<u64, u64>,
    ) -> Vec<(Option<EngineBlockHash>, Vec<StoredBlock>)> {
        let Some(rank) = self.ranks[slot as usize].as_ref() else {
            return Vec::new();
        };
        // prefix -> (engine hash, parent), for the blocks this rank holds
        let mut held: FxHashMap<u64, (u64, u64)> = FxHashMap::default();
        for a in rank.aliases.iter() {
            if let Some(b) = self.blocks.find(a.prefix, |b| b.prefix == a.prefix) {
                if self.arena.contains(b.holders, slot) {
                    held.insert(a.prefix, (a.engine, b.parent));
                }
            }
        }
        let mut children: FxHashMap<u64, Vec<u64>> = FxHashMap::default();
        for (&p, &(_, parent)) in &held {
            children.entry(parent).or_default().push(p);
        }
        for c in children.values_mut() {
            c.sort_unstable(); // deterministic output
        }
        // Depth-first from each root; each event follows one chain as far as it goes.
        let mut roots: Vec<u64> = children
            .keys()
            .copied()
            .filter(|&p| p == ROOT || (!held.contains_key(&p) && engine_of.contains_key(&p)))
            .collect();
        roots.sort_unstable();
        let mut out = Vec::new();
        for root in roots {
            let mut stack: Vec<u64> = children[&root].clone();
            while let Some(start) = stack.pop() {
                let parent = held[&start].1;
                let mut blocks = Vec::new();
                let mut p = start;
                loop {
                    let (engine, parent) = held[&p];
                    blocks.push(StoredBlock {
                        engine_hash: EngineBlockHash(engine),
                        local_hash: LocalBlockHash(prefix::local_of(p, parent)),
                    });
                    match children.get(&p).map(Vec::as_slice) {
                        Some([first, rest @ ..]) => {
                            stack.extend_from_slice(rest);
                            p = *first;
                        }
                        _ => break,
                    }
                }
                let parent_engine = match held.get(&parent) {
                    Some(&(e, _)) => Some(e),
                    None => engine_of.get(&parent).copied(),
                };
                out.push((
                    (parent != ROOT).then(|| EngineBlockHash(parent_engine.expect("a root"))),
                    blocks,
                ));
            }
        }
        out
    }

    /// Replaces a rank's state with a dump (recovery). Every event is tried; the first
    /// refusal, if any, is returned after the rest are applied.
    pub fn load_rank(&mut self, dump: &RankDump) -> Result<(), IndexError> {
        self.remove_worker_rank(dump.key);
        let slot = self.slot_for(dump.key);
        self.rank_mut(slot).last_event_id = dump.last_event_id;
        // A chain whose parent sits in a tier dumped later is retried once that one loaded.
        let mut pending: Vec<&KvEvent> = dump.events.iter().collect();
        loop {
            let mut failed = Vec::new();
            let mut first_err = None;
            for &ev in &pending {
                if let Err(e) = self.apply_in(slot, ev.tier, &ev.data) {
                    failed.push(ev);
                    first_err.get_or_insert(e);
                }
            }
            if failed.is_empty() {
                return Ok(());
            }
            if failed.len() == pending.len() {
                return Err(first_err.expect("an error"));
            }
            pending = failed;
        }
    }

    /// Ranks that saw an event-id gap since the last call; their flags are reset.
    pub fn take_needs_recovery(&mut self) -> Vec<WorkerKey> {
        self.ranks
            .iter_mut()
            .flatten()
            .filter_map(|r| std::mem::take(&mut r.needs_recovery).then_some(r.key))
            .collect()
    }

    pub fn last_event_id(&self, key: WorkerKey) -> Option<EventId> {
        let slot = *self.slots.get(&key)?;
        self.ranks[slot as usize].as_ref()?.last_event_id
    }

    /// Blocks held by one rank.
    pub fn held_blocks(&self, key: WorkerKey) -> usize {
        self.slots
            .get(&key)
            .and_then(|&s| self.ranks[s as usize].as_ref())
            .map_or(0, |r| r.held)
    }

    pub fn worker_keys(&self) -> impl Iterator<Item = WorkerKey> + '_ {
        self.slots.keys().copied()
    }

    /// Bytes the index's tables have allocated (entries and control bytes), excluding
    /// spilled holder sets.
    pub fn table_bytes(&self) -> usize {
        fn bytes<T>(t: &Table<T>) -> usize {
            t.allocation_size()
        }
        bytes(&self.blocks)
            + self
                .ranks
                .iter()
                .flatten()
                .map(|r| bytes(&r.aliases))
                .sum::<usize>()
            + self.lower.as_deref().map_or(0, |l| l.table_bytes())
    }

    pub fn live_blocks(&self) -> usize {
        self.blocks.len()
    }

    pub fn stats(&self) -> IndexStats {
        IndexStats {
            live_blocks: self.blocks.len(),
            live_pairs: self.live_pairs,
            worker_keys: self.slots.len(),
            table_bytes: self.table_bytes(),
            lower_tier_pairs: self.lower.as_deref().map_or(0, |l| l.pairs()),
            counters: self.counters,
        }
    }

    fn slot_for(&mut self, key: WorkerKey) -> u32 {
        if let Some(&s) = self.slots.get(&key) {
            return s;
        }
        // The lowest free slot keeps small fleets in the inline holder mask.
        let slot = match self.ranks.iter().position(Option::is_none) {
            Some(s) => s,
            None => {
                self.ranks.push(None);
                self.slot_keys.push(key);
                self.ranks.len() - 1
            }
        };
        self.ranks[slot] = Some(Rank {
            key,
            aliases: new_table(),
            held: 0,
            last_event_id: None,
            needs_recovery: false,
        });
        self.slot_keys[slot] = key;
        self.slots.insert(key, slot as u32);
        slot as u32
    }

    fn rank_mut(&mut self, slot: u32) -> &mut Rank {
        self.ranks[slot as usize].as_mut().expect("slot in use")
    }
}

#[inline]
fn alias_of(aliases: &Table<Alias>, e: u64) -> Option<u64> {
    aliases
        .find(engine_hash_of(e), |a| a.engine == e)
        .map(|a| a.prefix)
}

fn holds(table: &Table<Block>, arena: &HolderArena, p: u64, slot: u32) -> bool {
    table
        .find(p, |b| b.prefix == p)
        .is_some_and(|b| arena.contains(b.holders, slot))
}

/// [`unhold`], keeping the rank's and the index's pair counts.
fn release(
    table: &mut Table<Block>,
    arena: &mut HolderArena,
    held: &mut usize,
    live_pairs: &mut usize,
    p: u64,
    slot: u32,
) -> bool {
    let released = unhold(table, arena, p, slot);
    if released {
        *held -= 1;
        *live_pairs -= 1;
    }
    released
}

/// Removes `slot` from prefix `p`'s holders, dropping the block when nobody holds it.
/// Returns whether the slot held it.
fn unhold(table: &mut Table<Block>, arena: &mut HolderArena, p: u64, slot: u32) -> bool {
    let Ok(mut entry) = table.find_entry(p, |b| b.prefix == p) else {
        return false;
    };
    if !arena.remove(&mut entry.get_mut().holders, slot) {
        return false;
    }
    if entry.get().holders.is_empty() {
        entry.remove();
    }
    true
}

//! The index core: which worker ranks hold which prompt prefixes. Synchronous, no I/O.
//!
//! Layout, chosen for memory traffic (the tables of a big fleet do not fit in any cache):
//! - [`runs`]: the blocks of every tier, as runs of up to 64 consecutive blocks of one branch,
//!   each with a bitmap of positions per holder slot. A lookup touches one run per 64 blocks
//!   of shared history (a heads-table probe, the run, its ids), not one table entry per block.
//! - per holder slot (a rank's device, host or disk tier, or shared storage), `aliases`:
//!   engine block hash → the block's location, 16 bytes per (block, slot) pair. Applying a
//!   block costs one probe of its rank's table; the run it lands in is usually already in
//!   cache. Engine hashes stay opaque: they only resolve a `Stored` parent and the blocks of a
//!   `Removed`.
//!
//! Semantics (mirrored by the reference model in the tests): a rank holds a set of prefixes;
//! its overlap with a query is the largest `k` such that it holds every prefix of the query of
//! length `1..=k`. An engine hash names the prefix it was last stored with; removing any name
//! of a prefix drops the prefix.

use crate::error::IndexError;
use crate::overlap::OverlapScores;
use crate::prefix::{self, PrefixChain, ROOT};
use crate::table_alloc::TableAlloc;
use aliases::Aliases;
use hashbrown::HashTable;
use kvrouter_protocol::{
    EngineBlockHash, EventId, KvEvent, KvEventData, LocalBlockHash, StoredBlock, Tier, WorkerId,
    WorkerKey,
};
use runs::{Loc, Runs, LOWER_BASE};
use rustc_hash::FxHashMap;
use smallvec::SmallVec;

mod aliases;
mod runs;
mod tiers;

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

/// What one holder slot (a rank's tier, or shared storage) holds and calls it.
struct Slot {
    key: WorkerKey,
    aliases: Aliases,
    held: usize,
}

impl Slot {
    fn new(key: WorkerKey) -> Self {
        Self {
            key,
            aliases: Aliases::default(),
            held: 0,
        }
    }
}

/// A worker key's slots and event sequence.
struct KeyState {
    dev: u32,
    host: Option<u32>,
    disk: Option<u32>,
    last_event_id: Option<EventId>,
    needs_recovery: bool,
}

/// Names an event's blocks are looked up this far ahead of their use (see `Aliases`).
const PREFETCH_AHEAD: usize = 12;

const NO_RUN: u32 = u32::MAX;

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
    /// Runs of blocks the index keeps (every tier; see `index::runs`).
    pub live_runs: usize,
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
#[derive(Default)]
pub struct Index {
    runs: Runs,
    /// Device slots (numbers below [`LOWER_BASE`]), lowest free first: small fleets keep
    /// small slot numbers.
    slots: Vec<Option<Slot>>,
    /// Lower-tier slots, numbered from [`LOWER_BASE`].
    lower: Vec<Option<Slot>>,
    keys: FxHashMap<WorkerKey, KeyState>,
    /// The slot of shared storage, once it stored something.
    shared: Option<u32>,
    limits: FxHashMap<(WorkerId, Tier), usize>,
    live_pairs: usize,
    live_blocks: usize,
    lower_pairs: usize,
    counters: IndexCounters,
}

impl Index {
    pub fn new() -> Self {
        Self::default()
    }

    /// Refuse `Stored` events that would make any rank of `worker_id` hold more than `limit`
    /// blocks (`None` lifts the limit). See [`block_limit_for_capacity`].
    pub fn set_block_limit(&mut self, worker_id: WorkerId, limit: Option<usize>) {
        self.set_tier_block_limit(worker_id, Tier::Device, limit)
    }

    /// Refuse `Stored` events that would make any rank of `worker_id` hold more than `limit`
    /// blocks in `tier` (`None` lifts it); see [`Index::set_block_limit`].
    pub fn set_tier_block_limit(&mut self, worker_id: WorkerId, tier: Tier, limit: Option<usize>) {
        match limit {
            Some(l) => self.limits.insert((worker_id, tier), l),
            None => self.limits.remove(&(worker_id, tier)),
        };
    }

    /// Applies one event, checking its id against the rank's last one.
    pub fn apply(&mut self, event: &KvEvent) -> Result<Applied, IndexError> {
        let state = self.key_state(event.key);
        let mut gap = 0;
        if let Some(last) = state.last_event_id {
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
                state.needs_recovery = true;
            }
        }
        state.last_event_id = Some(event.event_id);
        if gap > 0 {
            self.counters.gaps += 1;
        }
        let mut applied = self.apply_in(event.key, event.tier, &event.data)?;
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
        match (self.keys.contains_key(&key), data) {
            (true, _) => {}
            (false, KvEventData::Stored { .. }) => {
                self.key_state(key);
            }
            (false, _) => return Ok(Applied::default()),
        }
        self.apply_in(key, tier, data)
    }

    /// Applies an event's content to `tier` of `key` (a known key).
    fn apply_in(
        &mut self,
        key: WorkerKey,
        tier: Tier,
        data: &KvEventData,
    ) -> Result<Applied, IndexError> {
        let out = match data {
            KvEventData::Stored { parent, blocks } => {
                let slot = self.tier_slot_for(key, tier);
                self.store(key, slot, tier, *parent, blocks)?
            }
            KvEventData::Removed { engine_hashes } => match self.tier_slot(key, tier) {
                Some(s) => self.remove_blocks(s, engine_hashes),
                None => Applied {
                    skipped: engine_hashes.len(),
                    ..Applied::default()
                },
            },
            // Every tier of the rank; shared storage is no rank's to clear.
            KvEventData::Cleared => Applied {
                removed: self.clear_key(key),
                ..Applied::default()
            },
        };
        self.counters.events_applied += 1;
        self.counters.stored_blocks += out.stored as u64;
        self.counters.removed_blocks += out.removed as u64;
        self.counters.removed_unknown_blocks += out.skipped as u64;
        Ok(out)
    }

    fn store(
        &mut self,
        key: WorkerKey,
        slot: u32,
        tier: Tier,
        parent: Option<EngineBlockHash>,
        blocks: &[StoredBlock],
    ) -> Result<Applied, IndexError> {
        let (at, prefix) = match parent {
            None => (None, ROOT),
            Some(pe) => match self.resolve_parent(key, tier, pe.0) {
                Some(loc) => (Some(loc), self.runs.id(loc)),
                None => {
                    self.counters.rejected_missing_parent += 1;
                    return Err(IndexError::MissingParent { key, parent: pe });
                }
            },
        };
        let held = self.slot(slot).held;
        if let Some(&limit) = self.limits.get(&(key.worker_id, tier)) {
            if held + blocks.len() > limit {
                self.counters.rejected_block_limit += 1;
                return Err(IndexError::BlockLimit {
                    key,
                    held,
                    adding: blocks.len(),
                    limit,
                });
            }
        }
        Ok(self.store_chain(slot, at, prefix, blocks))
    }

    /// Stores a chain of blocks for `slot` below the block at `at` (prefix id `prefix`), or
    /// below the root when `at` is `None`.
    fn store_chain(
        &mut self,
        slot: u32,
        mut at: Option<Loc>,
        mut prefix: u64,
        blocks: &[StoredBlock],
    ) -> Applied {
        // Bits of one run not yet marked held: one holder update per run, not per block.
        let mut pending = (NO_RUN, 0u64);
        let mut stored = 0;
        let aliases = &slot_mut(&mut self.slots, &mut self.lower, slot).aliases;
        for b in blocks.iter().take(PREFETCH_AHEAD) {
            aliases.prefetch(b.engine_hash.0);
        }
        for (k, b) in blocks.iter().enumerate() {
            let p = prefix::extend(prefix, b.local_hash.0);
            let loc = match self.runs.find_child(at, prefix, p) {
                Some(l) => l,
                None => match at {
                    Some(a) if self.runs.appendable(a) => self.runs.append(a.run, p),
                    _ => self.runs.create(prefix, p),
                },
            };
            if loc.run != pending.0 {
                stored += self.mark_held(slot, pending);
                pending = (loc.run, 0);
            }
            let aliases = &mut slot_mut(&mut self.slots, &mut self.lower, slot).aliases;
            if let Some(ahead) = blocks.get(k + PREFETCH_AHEAD) {
                aliases.prefetch(ahead.engine_hash.0);
            }
            match aliases.insert(b.engine_hash.0, loc) {
                Some(old) if old == loc => {}
                Some(old) => {
                    // The engine reused a hash for another block: the old block is gone.
                    self.runs.add_ref(loc.run);
                    stored += self.mark_held(slot, pending);
                    pending.1 = 0;
                    self.release(slot, old, 1 << old.pos);
                    self.runs.drop_refs(old.run, 1);
                }
                None => self.runs.add_ref(loc.run),
            }
            pending.1 |= 1 << loc.pos;
            at = Some(loc);
            prefix = p;
        }
        stored += self.mark_held(slot, pending);
        Applied {
            stored,
            ..Applied::default()
        }
    }

    /// Marks `bits` of a run held by `slot`; returns the pairs added.
    fn mark_held(&mut self, slot: u32, (run, bits): (u32, u64)) -> usize {
        if run == NO_RUN || bits == 0 {
            return 0;
        }
        let d = self.runs.set_bits(run, slot, bits);
        slot_mut(&mut self.slots, &mut self.lower, slot).held += d.pairs;
        if slot < LOWER_BASE {
            self.live_pairs += d.pairs;
            self.live_blocks += d.dev_blocks;
        } else {
            self.lower_pairs += d.pairs;
        }
        d.pairs
    }

    /// Marks `bits` of a run no longer held by `slot`; returns the pairs dropped.
    fn release(&mut self, slot: u32, loc: Loc, bits: u64) -> usize {
        let d = self.runs.clear_bits(loc.run, slot, bits);
        let s = slot_mut(&mut self.slots, &mut self.lower, slot);
        s.held = s.held.saturating_sub(d.pairs);
        if slot < LOWER_BASE {
            self.live_pairs -= d.pairs;
            self.live_blocks -= d.dev_blocks;
        } else {
            self.lower_pairs -= d.pairs;
        }
        d.pairs
    }

    fn remove_blocks(&mut self, slot: u32, engine_hashes: &[EngineBlockHash]) -> Applied {
        let mut out = Applied::default();
        // (run, bits to clear, aliases dropped): one holder update per run.
        let mut pending = (NO_RUN, 0u64, 0u32);
        let aliases = &slot_mut(&mut self.slots, &mut self.lower, slot).aliases;
        for e in engine_hashes.iter().take(PREFETCH_AHEAD) {
            aliases.prefetch(e.0);
        }
        for (k, e) in engine_hashes.iter().enumerate() {
            let aliases = &mut slot_mut(&mut self.slots, &mut self.lower, slot).aliases;
            if let Some(ahead) = engine_hashes.get(k + PREFETCH_AHEAD) {
                aliases.prefetch(ahead.0);
            }
            let found = aliases.remove(e.0);
            let Some(loc) = found else {
                out.skipped += 1;
                continue;
            };
            if loc.run != pending.0 {
                self.flush_removed(slot, pending);
                pending = (loc.run, 0, 0);
            }
            pending.2 += 1;
            let bit = 1 << loc.pos;
            // A stale name (the prefix was dropped under another name) removes nothing.
            if pending.1 & bit == 0 && self.runs.holds(loc, slot) {
                pending.1 |= bit;
                out.removed += 1;
            } else {
                out.skipped += 1;
            }
        }
        self.flush_removed(slot, pending);
        slot_mut(&mut self.slots, &mut self.lower, slot)
            .aliases
            .maybe_shrink();
        out
    }

    fn flush_removed(&mut self, slot: u32, (run, bits, refs): (u32, u64, u32)) {
        if run == NO_RUN {
            return;
        }
        self.release(slot, Loc { run, pos: 0 }, bits);
        self.runs.drop_refs(run, refs);
    }

    /// Drops every block of a slot, keeping the slot; returns how many it held.
    fn clear_slot(&mut self, slot: u32) -> usize {
        let s = slot_mut(&mut self.slots, &mut self.lower, slot);
        let aliases = std::mem::take(&mut s.aliases);
        let mut removed = 0;
        for (_, loc) in aliases.iter() {
            removed += self.release(slot, loc, 1 << loc.pos);
            self.runs.drop_refs(loc.run, 1);
        }
        debug_assert_eq!(self.slot(slot).held, 0);
        removed
    }

    /// Frees a slot after dropping its blocks; returns how many it held.
    fn free_slot(&mut self, slot: u32) -> usize {
        let removed = self.clear_slot(slot);
        if slot < LOWER_BASE {
            self.slots[slot as usize] = None;
        } else {
            self.lower[(slot - LOWER_BASE) as usize] = None;
        }
        removed
    }

    /// Forgets one rank entirely (blocks, event-id state, recovery flag).
    pub fn remove_worker_rank(&mut self, key: WorkerKey) -> bool {
        let Some(state) = self.keys.remove(&key) else {
            return false;
        };
        self.free_slot(state.dev);
        for s in [state.host, state.disk].into_iter().flatten() {
            self.free_slot(s);
        }
        true
    }

    /// Forgets every rank of a worker; returns how many ranks were removed.
    pub fn remove_worker(&mut self, worker_id: WorkerId) -> usize {
        let keys: SmallVec<[WorkerKey; 8]> = self
            .keys
            .keys()
            .filter(|k| k.worker_id == worker_id)
            .copied()
            .collect();
        self.limits.retain(|(w, _), _| *w != worker_id);
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
        if self.has_lower() {
            self.lower_matches(chain, first, out);
        }
    }

    /// The device overlaps, appended to `out`.
    fn device_matches(&self, chain: &mut PrefixChain<'_>, out: &mut Vec<(WorkerKey, u32)>) {
        let n = chain.len();
        if n == 0 || self.runs.is_empty() {
            return;
        }
        let Some(mut run) = self.runs.head(chain.get(0)) else {
            return;
        };
        // Device slots holding every query block so far, sorted.
        let mut active: SmallVec<[u32; 16]> = self
            .runs
            .get(run)
            .device_holders()
            .iter()
            .filter(|h| h.bits & 1 != 0)
            .map(|h| h.slot)
            .collect();
        let mut i = 0;
        while !active.is_empty() {
            let r = self.runs.get(run);
            let end = n.min(i + r.len());
            let m = self.runs.matched(run, chain.ids(i, end));
            let holders = r.device_holders();
            let (mut j, mut kept) = (0, 0);
            for k in 0..active.len() {
                let s = active[k];
                while j < holders.len() && holders[j].slot < s {
                    j += 1;
                }
                let bits = match holders.get(j) {
                    Some(h) if h.slot == s => h.bits,
                    _ => 0,
                };
                let covered = ((!bits).trailing_zeros() as usize).min(m);
                if covered == m {
                    active[kept] = s;
                    kept += 1;
                } else if i + covered > 0 {
                    out.push((self.slot(s).key, (i + covered) as u32));
                }
            }
            active.truncate(kept);
            i += m;
            if i == n || m == 0 {
                break;
            }
            // The query left the run or ran past its end: its next block, if stored, heads
            // a run.
            match self.runs.head(chain.get(i)) {
                Some(next) => run = next,
                None => break,
            }
        }
        for s in active {
            out.push((self.slot(s).key, i as u32));
        }
    }

    /// The local hash of the block `key` holds under engine hash `engine` in any tier, if it
    /// holds one (an engine may name an offloaded block by its hash alone).
    pub fn local_hash(&self, key: WorkerKey, engine: EngineBlockHash) -> Option<LocalBlockHash> {
        let state = self.keys.get(&key)?;
        [Some(state.dev), state.host, state.disk]
            .into_iter()
            .flatten()
            .find_map(|slot| {
                let loc = self.held_loc(slot, engine.0)?;
                let (p, parent) = (self.runs.id(loc), self.runs.parent_id(loc));
                Some(LocalBlockHash(prefix::local_of(p, parent)))
            })
    }

    /// Where `slot` holds the block it calls `engine`, if it holds it.
    fn held_loc(&self, slot: u32, engine: u64) -> Option<Loc> {
        self.slot(slot)
            .aliases
            .get(engine)
            .filter(|&loc| self.runs.holds(loc, slot))
    }

    /// Events that rebuild `key` exactly: device blocks, then host, then disk, parents
    /// before children within a tier. Blocks cut off from the root (a removed ancestor, in
    /// no tier) match nothing and are left out.
    pub fn dump(&self, key: WorkerKey) -> Option<RankDump> {
        let state = self.keys.get(&key)?;
        // Only chains rooted in another tier need it: none without lower tiers.
        let engine_of = match self.has_lower() {
            true => self.engine_hashes_of(key),
            false => FxHashMap::default(),
        };
        let event_id = state.last_event_id.unwrap_or(0);
        let mut events = Vec::new();
        for (tier, slot) in [
            (Tier::Device, Some(state.dev)),
            (Tier::Host, state.host),
            (Tier::Disk, state.disk),
        ] {
            let Some(slot) = slot else { continue };
            for (parent, blocks) in self.chains(slot, &engine_of) {
                events.push(KvEvent {
                    key,
                    event_id,
                    tier,
                    data: KvEventData::Stored { parent, blocks },
                });
            }
        }
        Some(RankDump {
            key,
            last_event_id: state.last_event_id,
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
        // prefix -> (engine hash, parent), for the blocks this slot holds
        let mut held: FxHashMap<u64, (u64, u64)> = FxHashMap::default();
        for (engine, loc) in self.slot(slot).aliases.iter() {
            if self.runs.holds(loc, slot) {
                held.insert(self.runs.id(loc), (engine, self.runs.parent_id(loc)));
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
        // Forged ids could make a cycle: each prefix is emitted once.
        let mut seen: rustc_hash::FxHashSet<u64> = Default::default();
        for root in roots {
            let mut stack: Vec<u64> = children[&root].clone();
            while let Some(start) = stack.pop() {
                if !seen.insert(start) {
                    continue;
                }
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
                        Some([first, rest @ ..]) if !seen.contains(first) => {
                            stack.extend_from_slice(rest);
                            p = *first;
                            seen.insert(p);
                        }
                        Some([_, rest @ ..]) => {
                            stack.extend_from_slice(rest);
                            break;
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
        self.key_state(dump.key).last_event_id = dump.last_event_id;
        // A chain whose parent sits in a tier dumped later is retried once that one loaded.
        let mut pending: Vec<&KvEvent> = dump.events.iter().collect();
        loop {
            let mut failed = Vec::new();
            let mut first_err = None;
            for &ev in &pending {
                if let Err(e) = self.apply_in(dump.key, ev.tier, &ev.data) {
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
        self.keys
            .iter_mut()
            .filter_map(|(k, s)| std::mem::take(&mut s.needs_recovery).then_some(*k))
            .collect()
    }

    pub fn last_event_id(&self, key: WorkerKey) -> Option<EventId> {
        self.keys.get(&key)?.last_event_id
    }

    /// Blocks held by one rank.
    pub fn held_blocks(&self, key: WorkerKey) -> usize {
        self.keys.get(&key).map_or(0, |s| self.slot(s.dev).held)
    }

    pub fn worker_keys(&self) -> impl Iterator<Item = WorkerKey> + '_ {
        self.keys.keys().copied()
    }

    /// Bytes the index's tables have allocated (runs, their ids and spilled holder lists, the
    /// heads and alias tables), allocator slack not included.
    pub fn table_bytes(&self) -> usize {
        self.runs.bytes()
            + self
                .slots
                .iter()
                .chain(&self.lower)
                .flatten()
                .map(|s| s.aliases.allocation_size())
                .sum::<usize>()
    }

    pub fn live_blocks(&self) -> usize {
        self.live_blocks
    }

    pub fn stats(&self) -> IndexStats {
        IndexStats {
            live_blocks: self.live_blocks,
            live_pairs: self.live_pairs,
            worker_keys: self.keys.len(),
            table_bytes: self.table_bytes(),
            lower_tier_pairs: self.lower_pairs,
            live_runs: self.runs.live(),
            counters: self.counters,
        }
    }

    /// The state of `key`, created with a device slot when new.
    fn key_state(&mut self, key: WorkerKey) -> &mut KeyState {
        if !self.keys.contains_key(&key) {
            // The lowest free slot keeps small fleets' slot numbers small.
            let dev = match self.slots.iter().position(Option::is_none) {
                Some(s) => s,
                None => {
                    self.slots.push(None);
                    self.slots.len() - 1
                }
            };
            self.slots[dev] = Some(Slot::new(key));
            self.keys.insert(
                key,
                KeyState {
                    dev: dev as u32,
                    host: None,
                    disk: None,
                    last_event_id: None,
                    needs_recovery: false,
                },
            );
        }
        self.keys.get_mut(&key).expect("just inserted")
    }

    #[inline]
    fn slot(&self, slot: u32) -> &Slot {
        let s = if slot < LOWER_BASE {
            &self.slots[slot as usize]
        } else {
            &self.lower[(slot - LOWER_BASE) as usize]
        };
        s.as_ref().expect("slot in use")
    }
}

#[inline]
fn slot_mut<'a>(
    slots: &'a mut [Option<Slot>],
    lower: &'a mut [Option<Slot>],
    slot: u32,
) -> &'a mut Slot {
    let s = if slot < LOWER_BASE {
        &mut slots[slot as usize]
    } else {
        &mut lower[(slot - LOWER_BASE) as usize]
    };
    s.as_mut().expect("slot in use")
}

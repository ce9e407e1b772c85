//! Lower tiers: blocks a rank keeps in host memory or on its disk, and blocks in shared
//! storage, which belong to no rank and are credited to every rank of the model.
//!
//! Each lower tier is an [`Index`] of its own (host and disk keyed by the rank, shared under
//! [`SHARED_KEY`]), created on the first lower-tier event: a device-only fleet pays one
//! `None` check per lookup and nothing per event. Event ids stay the device index's: one
//! sequence per rank, whatever tier an event names.
//!
//! A rank's overlap with a query (mirrored by the reference model in the tests): the device
//! prefix `d`; then for host, disk and shared in that order, the longest prefix held in that
//! tier or any above it, minus what the tiers above already counted.

use super::*;
use kvrouter_protocol::{Tier, TierBlocks};

/// The key shared-storage blocks are held under.
pub(super) const SHARED_KEY: WorkerKey = WorkerKey::new(u64::MAX, u32::MAX);

#[derive(Default)]
pub(super) struct LowerTiers {
    host: Index,
    disk: Index,
    shared: Index,
}

impl LowerTiers {
    fn get(&self, tier: Tier) -> Option<&Index> {
        match tier {
            Tier::Device => None,
            Tier::Host => Some(&self.host),
            Tier::Disk => Some(&self.disk),
            Tier::Shared => Some(&self.shared),
        }
    }

    fn get_mut(&mut self, tier: Tier) -> Option<&mut Index> {
        match tier {
            Tier::Device => None,
            Tier::Host => Some(&mut self.host),
            Tier::Disk => Some(&mut self.disk),
            Tier::Shared => Some(&mut self.shared),
        }
    }

    fn is_empty(&self) -> bool {
        self.host.blocks.is_empty() && self.disk.blocks.is_empty() && self.shared.blocks.is_empty()
    }

    pub(super) fn pairs(&self) -> usize {
        self.host.live_pairs + self.disk.live_pairs + self.shared.live_pairs
    }

    pub(super) fn table_bytes(&self) -> usize {
        self.host.table_bytes() + self.disk.table_bytes() + self.shared.table_bytes()
    }
}

/// The key a tier holds a rank's blocks under.
fn key_in(tier: Tier, key: WorkerKey) -> WorkerKey {
    if tier == Tier::Shared {
        SHARED_KEY
    } else {
        key
    }
}

impl Index {
    /// Applies an event's content to `tier` of the rank in `slot` (its device slot).
    pub(super) fn apply_in(
        &mut self,
        slot: u32,
        tier: Tier,
        data: &KvEventData,
    ) -> Result<Applied, IndexError> {
        let key = self.slot_keys[slot as usize];
        let mut out = match (tier, data) {
            (_, KvEventData::Cleared) => {
                // Every tier of the rank; shared storage is no rank's to clear.
                let mut out = self.apply_data(slot, data)?;
                if let Some(lower) = self.lower.as_deref_mut() {
                    for t in [Tier::Host, Tier::Disk] {
                        out.removed += lower.get_mut(t).map_or(0, |i| i.forget(key));
                    }
                }
                return Ok(out);
            }
            (Tier::Device, _) => return self.apply_data(slot, data),
            (_, KvEventData::Stored { parent, blocks }) => {
                let prefix = match parent {
                    None => ROOT,
                    Some(pe) => match self.resolve_parent(key, tier, pe.0) {
                        Some(p) => p,
                        None => {
                            self.counters.rejected_missing_parent += 1;
                            return Err(IndexError::MissingParent { key, parent: *pe });
                        }
                    },
                };
                let index = self
                    .lower
                    .get_or_insert_with(Default::default)
                    .get_mut(tier)
                    .expect("a lower tier");
                let s = index.slot_for(key_in(tier, key));
                let held = index.held_blocks(key_in(tier, key));
                if let Err(e) = index.within_limit(key, held, blocks.len()) {
                    self.counters.rejected_block_limit += 1;
                    return Err(e);
                }
                index.store_from(s, prefix, blocks)?
            }
            (_, KvEventData::Removed { engine_hashes }) => {
                let index = self.lower.as_deref_mut().and_then(|l| l.get_mut(tier));
                let slot = index
                    .as_deref()
                    .and_then(|i| i.slots.get(&key_in(tier, key)).copied());
                match index.zip(slot) {
                    Some((index, s)) => index.remove_blocks(s, engine_hashes),
                    None => Applied {
                        skipped: engine_hashes.len(),
                        ..Applied::default()
                    },
                }
            }
        };
        out.gap = 0;
        self.counters.events_applied += 1;
        self.counters.stored_blocks += out.stored as u64;
        self.counters.removed_blocks += out.removed as u64;
        self.counters.removed_unknown_blocks += out.skipped as u64;
        Ok(out)
    }

    /// [`Index::local_hash`] in the host and disk tiers.
    pub(super) fn lower_local_hash(
        &self,
        key: WorkerKey,
        engine: EngineBlockHash,
    ) -> Option<LocalBlockHash> {
        let lower = self.lower.as_deref()?;
        [&lower.host, &lower.disk]
            .into_iter()
            .find_map(|i| i.local_hash_here(key, engine))
    }

    /// Refuse lower-tier `Stored` events that would make any rank of `worker_id` hold more
    /// than `limit` blocks in `tier` (`None` lifts it); see [`Index::set_block_limit`].
    pub fn set_tier_block_limit(&mut self, worker_id: WorkerId, tier: Tier, limit: Option<usize>) {
        if tier == Tier::Device {
            return self.set_block_limit(worker_id, limit);
        }
        let lower = self.lower.get_or_insert_with(Default::default);
        if let Some(index) = lower.get_mut(tier) {
            index.set_block_limit(worker_id, limit);
        }
    }

    /// Forgets a key's blocks and slot; returns how many blocks it held.
    fn forget(&mut self, key: WorkerKey) -> usize {
        let held = self.held_blocks(key);
        self.remove_worker_rank(key);
        held
    }

    /// Forgets a rank's lower-tier blocks (the rank is leaving or being reloaded).
    pub(super) fn forget_lower(&mut self, key: WorkerKey) {
        if let Some(lower) = self.lower.as_deref_mut() {
            lower.host.forget(key);
            lower.disk.forget(key);
        }
    }

    /// The prefix `key` holds under engine hash `engine` in this index, if it holds it.
    fn held_prefix(&self, key: WorkerKey, engine: u64) -> Option<u64> {
        let &slot = self.slots.get(&key)?;
        let rank = self.ranks[slot as usize].as_ref()?;
        alias_of(&rank.aliases, engine).filter(|&p| holds(&self.blocks, &self.arena, p, slot))
    }

    /// The parent of a lower-tier `Stored`: a block of the same tier, or of any other tier of
    /// the rank (an offloaded block's parent often is still on the device), or shared.
    pub(super) fn resolve_parent(&self, key: WorkerKey, tier: Tier, engine: u64) -> Option<u64> {
        let lower = self.lower.as_deref();
        [tier, Tier::Device, Tier::Host, Tier::Disk, Tier::Shared]
            .into_iter()
            .find_map(|t| {
                let index = if t == Tier::Device {
                    Some(self)
                } else {
                    lower?.get(t)
                };
                index?.held_prefix(key_in(t, key), engine)
            })
    }

    /// Adds the lower-tier overlaps of this index's ranks to `out`, whose `scores` from
    /// `first` on are this index's device overlaps for `chain`.
    pub(super) fn lower_matches(
        &self,
        chain: &mut PrefixChain<'_>,
        first: usize,
        out: &mut OverlapScores,
    ) {
        let Some(lower) = self.lower.as_deref() else {
            return;
        };
        let n = chain.len();
        if n == 0 || lower.is_empty() {
            return;
        }
        let ids: SmallVec<[u64; 64]> = (0..n).map(|i| chain.get(i)).collect();
        let in_shared = |p: u64| lower.shared.holders_at(p).is_some();
        let shared_alone = ids.iter().take_while(|&&p| in_shared(p)).count();
        out.shared_blocks = out.shared_blocks.max(shared_alone as u32);

        // A rank with any overlap holds the first block in some tier, or shared storage does.
        let mut candidates: SmallVec<[WorkerKey; 16]> =
            out.scores[first..].iter().map(|(k, _)| *k).collect();
        for tier in [&lower.host, &lower.disk] {
            if let Some(h) = tier.holders_at(ids[0]) {
                let v = tier.arena.view(h);
                let mut mask = v.mask;
                while mask != 0 {
                    candidates.push(tier.slot_keys[mask.trailing_zeros() as usize]);
                    mask &= mask - 1;
                }
                candidates.extend(v.high().iter().map(|&s| tier.slot_keys[s as usize]));
            }
        }
        if shared_alone > 0 {
            candidates.extend(self.slots.keys().copied());
        }
        candidates.sort_unstable();
        candidates.dedup();

        let device: FxHashMap<WorkerKey, u32> = out.scores[first..].iter().copied().collect();
        let holds_in = |index: &Index, slot: Option<u32>, p: u64| {
            slot.is_some_and(|s| holds(&index.blocks, &index.arena, p, s))
        };
        for key in candidates {
            if !self.slots.contains_key(&key) {
                continue; // another shard's rank
            }
            let d = device.get(&key).copied().unwrap_or(0) as usize;
            let (dev, host, disk) = (
                self.slots.get(&key).copied(),
                lower.host.slots.get(&key).copied(),
                lower.disk.slots.get(&key).copied(),
            );
            let to_host = |p| holds_in(self, dev, p) || holds_in(&lower.host, host, p);
            let to_disk = |p| to_host(p) || holds_in(&lower.disk, disk, p);
            let to_shared = |p| to_disk(p) || in_shared(p);
            let advance = |mut i: usize, held: &dyn Fn(u64) -> bool| {
                while i < n && held(ids[i]) {
                    i += 1;
                }
                i
            };
            let p1 = advance(d, &to_host);
            let p2 = advance(p1, &to_disk);
            let p3 = advance(p2, &to_shared);
            if p3 > d {
                out.tiers.push((
                    key,
                    TierBlocks {
                        device: d as u32,
                        host: (p1 - d) as u32,
                        disk: (p2 - p1) as u32,
                        shared: (p3 - p2) as u32,
                    },
                ));
            }
        }
    }

    /// Appends events that rebuild `key`'s host and disk blocks (after its device events).
    /// A block whose parent sits in another tier names that parent's engine hash
    /// (`engine_of`: the engine hash of every prefix the rank holds, any tier).
    pub(super) fn dump_lower(
        &self,
        key: WorkerKey,
        engine_of: &FxHashMap<u64, u64>,
        events: &mut Vec<KvEvent>,
    ) {
        let Some(lower) = self.lower.as_deref() else {
            return;
        };
        let event_id = self.last_event_id(key).unwrap_or(0);
        for tier in [Tier::Host, Tier::Disk] {
            let index = lower.get(tier).expect("a lower tier");
            if let Some(&slot) = index.slots.get(&key) {
                for (parent, blocks) in index.chains(slot, engine_of) {
                    events.push(KvEvent {
                        key,
                        event_id,
                        tier,
                        data: KvEventData::Stored { parent, blocks },
                    });
                }
            }
        }
    }

    /// Engine hash of every prefix `key` holds in any tier of this index and that a dump
    /// can rebuild: reachable from the root through blocks the rank holds (a block below a
    /// removed ancestor, or below shared storage, is left out).
    pub(super) fn engine_hashes_of(&self, key: WorkerKey) -> FxHashMap<u64, u64> {
        let lower = self.lower.as_deref();
        let tiers = [Some(self), lower.map(|l| &l.host), lower.map(|l| &l.disk)];
        // parent -> (prefix, engine hash) of every held block
        let mut children: FxHashMap<u64, Vec<(u64, u64)>> = FxHashMap::default();
        for index in tiers.into_iter().flatten() {
            let Some(&slot) = index.slots.get(&key) else {
                continue;
            };
            if let Some(rank) = index.ranks[slot as usize].as_ref() {
                for a in rank.aliases.iter() {
                    if let Some(b) = index.blocks.find(a.prefix, |b| b.prefix == a.prefix) {
                        if index.arena.contains(b.holders, slot) {
                            children
                                .entry(b.parent)
                                .or_default()
                                .push((a.prefix, a.engine));
                        }
                    }
                }
            }
        }
        let mut out = FxHashMap::default();
        let mut stack = vec![ROOT];
        while let Some(p) = stack.pop() {
            for &(c, engine) in children.get(&p).map(Vec::as_slice).unwrap_or(&[]) {
                if out.insert(c, engine).is_none() {
                    stack.push(c);
                }
            }
        }
        out
    }
}

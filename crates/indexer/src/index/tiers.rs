//! Lower tiers: blocks a rank keeps in host memory or on its disk, and blocks in shared
//! storage, which belong to no rank and are credited to every rank of the model.
//!
//! Every tier lives in the same runs: a lower tier is a holder slot of its own (numbered from
//! [`LOWER_BASE`], so device slots keep the low numbers), created on the tier's first event.
//! A device-only fleet pays one check per lookup and nothing per event. Event ids stay the
//! device's: one sequence per rank, whatever tier an event names.
//!
//! A rank's overlap with a query (mirrored by the reference model in the tests): the device
//! prefix `d`; then for host, disk and shared in that order, the longest prefix held in that
//! tier or any above it, minus what the tiers above already counted.

use super::*;
use kvrouter_protocol::{Tier, TierBlocks};

/// The key shared-storage blocks are held under.
const SHARED_KEY: WorkerKey = WorkerKey::new(u64::MAX, u32::MAX);

impl Index {
    /// Whether any lower-tier slot exists.
    pub(super) fn has_lower(&self) -> bool {
        self.shared.is_some() || self.lower.iter().any(Option::is_some)
    }

    /// The slot of `key`'s `tier` (shared storage's for [`Tier::Shared`]), if it exists.
    pub(super) fn tier_slot(&self, key: WorkerKey, tier: Tier) -> Option<u32> {
        match tier {
            Tier::Shared => self.shared,
            t => {
                let state = self.keys.get(&key)?;
                match t {
                    Tier::Host => state.host,
                    Tier::Disk => state.disk,
                    _ => Some(state.dev),
                }
            }
        }
    }

    /// The slot of `key`'s `tier`, created if new (`key` is known).
    pub(super) fn tier_slot_for(&mut self, key: WorkerKey, tier: Tier) -> u32 {
        if let Some(s) = self.tier_slot(key, tier) {
            return s;
        }
        let owner = if tier == Tier::Shared {
            SHARED_KEY
        } else {
            key
        };
        let n = match self.lower.iter().position(Option::is_none) {
            Some(n) => n,
            None => {
                self.lower.push(None);
                self.lower.len() - 1
            }
        };
        self.lower[n] = Some(Slot::new(owner));
        let slot = LOWER_BASE + n as u32;
        match tier {
            Tier::Shared => self.shared = Some(slot),
            t => {
                let state = self.keys.get_mut(&key).expect("a known key");
                match t {
                    Tier::Host => state.host = Some(slot),
                    _ => state.disk = Some(slot),
                }
            }
        }
        slot
    }

    /// Drops every block of `key` in every tier; returns how many there were. The device
    /// slot stays (with the key's event ids); the lower ones go.
    pub(super) fn clear_key(&mut self, key: WorkerKey) -> usize {
        let Some(state) = self.keys.get_mut(&key) else {
            return 0;
        };
        let (dev, lower) = (state.dev, [state.host.take(), state.disk.take()]);
        let mut removed = self.clear_slot(dev);
        for s in lower.into_iter().flatten() {
            removed += self.free_slot(s);
        }
        removed
    }

    /// The parent of a `Stored`: a block of the same tier, or of any other tier of the rank
    /// (an offloaded block's parent often is still on the device), or shared.
    pub(super) fn resolve_parent(&self, key: WorkerKey, tier: Tier, engine: u64) -> Option<Loc> {
        [tier, Tier::Device, Tier::Host, Tier::Disk, Tier::Shared]
            .into_iter()
            .find_map(|t| self.held_loc(self.tier_slot(key, t)?, engine))
    }

    /// Adds the lower-tier overlaps of this index's ranks to `out`, whose `scores` from
    /// `first` on are this index's device overlaps for `chain`.
    pub(super) fn lower_matches(
        &self,
        chain: &mut PrefixChain<'_>,
        first: usize,
        out: &mut OverlapScores,
    ) {
        let n = chain.len();
        if n == 0 {
            return;
        }
        // The query's path through the runs, held by anyone or not: (run, query start, length).
        let mut path: SmallVec<[(u32, usize, usize); 16]> = SmallVec::new();
        let mut i = 0;
        while i < n {
            let Some(run) = self.runs.head(chain.get(i)) else {
                break;
            };
            let end = n.min(i + self.runs.get(run).len());
            let m = self.runs.matched(run, chain.ids(i, end));
            if m == 0 {
                break;
            }
            path.push((run, i, m));
            i += m;
        }
        let Some(&(first_run, ..)) = path.first() else {
            return;
        };
        // The first query block not held by any of `slots` from `from` on.
        let held_until = |from: usize, slots: &[Option<u32>]| -> usize {
            for &(run, start, m) in &path {
                if start + m <= from {
                    continue;
                }
                let r = self.runs.get(run);
                let bits = slots.iter().flatten().fold(0, |b, &s| b | r.bits(s));
                let off = from.saturating_sub(start);
                let gap = (!(bits >> off)).trailing_zeros() as usize;
                if off + gap < m {
                    return start + off + gap;
                }
            }
            i.max(from)
        };
        let shared_alone = match self.shared {
            Some(_) => held_until(0, &[self.shared]),
            None => 0,
        };
        out.shared_blocks = out.shared_blocks.max(shared_alone as u32);

        // A rank with any overlap holds the first block in some tier, or shared storage does.
        let mut candidates: SmallVec<[WorkerKey; 16]> =
            out.scores[first..].iter().map(|(k, _)| *k).collect();
        let r = self.runs.get(first_run);
        candidates.extend(
            r.holders[r.device_holders().len()..]
                .iter()
                .filter(|h| h.bits & 1 != 0 && Some(h.slot) != self.shared)
                .map(|h| self.slot(h.slot).key),
        );
        if shared_alone > 0 {
            candidates.extend(self.keys.keys().copied());
        }
        candidates.sort_unstable();
        candidates.dedup();

        let device: FxHashMap<WorkerKey, u32> = out.scores[first..].iter().copied().collect();
        for key in candidates {
            let Some(state) = self.keys.get(&key) else {
                continue; // another shard's rank
            };
            let d = device.get(&key).copied().unwrap_or(0) as usize;
            let (dev, host, disk) = (Some(state.dev), state.host, state.disk);
            let p1 = held_until(d, &[dev, host]);
            let p2 = held_until(p1, &[dev, host, disk]);
            let p3 = held_until(p2, &[dev, host, disk, self.shared]);
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

    /// Engine hash of every prefix `key` holds in any tier and that a dump can rebuild:
    /// reachable from the root through blocks the rank holds (a block below a removed
    /// ancestor, or below shared storage, is left out).
    pub(super) fn engine_hashes_of(&self, key: WorkerKey) -> FxHashMap<u64, u64> {
        let Some(state) = self.keys.get(&key) else {
            return FxHashMap::default();
        };
        // parent -> (prefix, engine hash) of every held block
        let mut children: FxHashMap<u64, Vec<(u64, u64)>> = FxHashMap::default();
        for slot in [Some(state.dev), state.host, state.disk]
            .into_iter()
            .flatten()
        {
            for (engine, loc) in self.slot(slot).aliases.iter() {
                if self.runs.holds(loc, slot) {
                    children
                        .entry(self.runs.parent_id(loc))
                        .or_default()
                        .push((self.runs.id(loc), engine));
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

//! The lower tiers of one rank's KV cache: host memory, then disk, each an LRU of the
//! registered blocks the tier above evicted (as vLLM's CPU offloading, LMCache or SGLang's
//! hierarchical cache keep them).
//!
//! Tiers are exclusive: a block lives in one tier at a time. A block the device evicts moves
//! to the host (or straight to disk without a host tier); the host's least recently used
//! block moves to disk when the host is full; the disk's drops out. A block that a request
//! loads back is registered on the device again and leaves its lower tier (see
//! `KvCache::commit`).
//!
//! Moves come out in the order their events must go out: a tier drops its overflow before it
//! takes a block (so a reader bounding each tier, like a bridge's mirror, never sees it over
//! capacity), and a block is stored in its new tier before it leaves the old one (so a
//! reader never loses sight of it: a bridge maps a tokenless offload event through the
//! block it already knows). Parents: the device evicts a prompt's tail before its head, so
//! in each tier a parent is newer than its children and is never dropped before them.

use kvrouter_protocol::{EngineBlockHash, LocalBlockHash, SequenceHash, Tier};
use rustc_hash::FxHashMap;
use std::collections::BTreeMap;

/// What a registered block is, in any tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BlockMeta {
    pub(crate) seq: SequenceHash,
    pub(crate) engine: EngineBlockHash,
    pub(crate) parent: Option<EngineBlockHash>,
    pub(crate) local: LocalBlockHash,
}

/// One change to the lower tiers, as the KV event that reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Move {
    Stored(Tier, BlockMeta),
    Removed(Tier, EngineBlockHash),
}

/// A bounded LRU of blocks keyed by prefix identity.
#[derive(Debug, Default)]
struct Lru {
    capacity: usize,
    blocks: FxHashMap<SequenceHash, (BlockMeta, u64)>,
    /// Use stamp → block, oldest first.
    order: BTreeMap<u64, SequenceHash>,
    clock: u64,
}

impl Lru {
    fn new(capacity: usize) -> Self {
        Self {
            capacity,
            ..Self::default()
        }
    }

    /// Inserts `m` as the newest block; returns the oldest one if that overflowed the tier.
    fn insert(&mut self, m: BlockMeta) -> Option<BlockMeta> {
        self.clock += 1;
        if let Some((_, old)) = self.blocks.insert(m.seq, (m, self.clock)) {
            self.order.remove(&old);
        }
        self.order.insert(self.clock, m.seq);
        if self.blocks.len() <= self.capacity {
            return None;
        }
        let (_, seq) = self.order.pop_first()?;
        self.blocks.remove(&seq).map(|(m, _)| m)
    }

    fn remove(&mut self, seq: SequenceHash) -> Option<BlockMeta> {
        let (m, stamp) = self.blocks.remove(&seq)?;
        self.order.remove(&stamp);
        Some(m)
    }

    fn clear(&mut self) {
        self.blocks.clear();
        self.order.clear();
    }
}

/// The host and disk tiers of one rank. See the module docs.
#[derive(Debug)]
pub(crate) struct LowerTiers {
    host: Lru,
    disk: Lru,
}

impl LowerTiers {
    /// Tiers of these capacities (blocks); `None` when both are 0.
    pub(crate) fn new(host_capacity: usize, disk_capacity: usize) -> Option<Self> {
        (host_capacity > 0 || disk_capacity > 0).then(|| Self {
            host: Lru::new(host_capacity),
            disk: Lru::new(disk_capacity),
        })
    }

    fn lru(&mut self, tier: Tier) -> &mut Lru {
        match tier {
            Tier::Disk => &mut self.disk,
            _ => &mut self.host,
        }
    }

    /// A block the device evicted: into the first lower tier, each overflow one tier down.
    /// The moves come out bottom up, so no tier ever reports more blocks than it holds.
    pub(crate) fn offload(&mut self, m: BlockMeta, out: &mut Vec<Move>) {
        let tiers = [
            (Tier::Host, self.host.capacity),
            (Tier::Disk, self.disk.capacity),
        ];
        // (tier, the block entering it), top down.
        let mut steps: Vec<(Tier, BlockMeta)> = Vec::with_capacity(2);
        let mut moving = Some(m);
        for (tier, _) in tiers.into_iter().filter(|&(_, c)| c > 0) {
            let Some(b) = moving else { break };
            steps.push((tier, b));
            moving = self.lru(tier).insert(b);
        }
        if let (Some(dropped), Some(&(last, _))) = (moving, steps.last()) {
            out.push(Move::Removed(last, dropped.engine));
        }
        for i in (0..steps.len()).rev() {
            let (tier, b) = steps[i];
            out.push(Move::Stored(tier, b));
            if let Some(&(above, _)) = i.checked_sub(1).map(|j| &steps[j]) {
                out.push(Move::Removed(above, b.engine));
            }
        }
    }

    /// The tier holding `seq`, if a lower one does.
    pub(crate) fn tier_of(&self, seq: SequenceHash) -> Option<Tier> {
        if self.host.blocks.contains_key(&seq) {
            Some(Tier::Host)
        } else if self.disk.blocks.contains_key(&seq) {
            Some(Tier::Disk)
        } else {
            None
        }
    }

    /// Takes `seq` out of its lower tier (it is back on the device).
    pub(crate) fn take(&mut self, seq: SequenceHash) -> Option<(Tier, BlockMeta)> {
        let tier = self.tier_of(seq)?;
        self.lru(tier).remove(seq).map(|m| (tier, m))
    }

    /// Drops every block (a `Cleared` event covers every tier).
    pub(crate) fn clear(&mut self) {
        self.host.clear();
        self.disk.clear();
    }

    /// Blocks held in `tier`, in no order.
    pub(crate) fn blocks(&self, tier: Tier) -> impl Iterator<Item = BlockMeta> + '_ {
        let lru = match tier {
            Tier::Host => Some(&self.host),
            Tier::Disk => Some(&self.disk),
            _ => None,
        };
        lru.into_iter()
            .flat_map(|l| l.blocks.values().map(|&(m, _)| m))
    }

    /// Blocks held in `tier`.
    pub(crate) fn len(&self, tier: Tier) -> usize {
        match tier {
            Tier::Host => self.host.blocks.len(),
            Tier::Disk => self.disk.blocks.len(),
            _ => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(i: u64) -> BlockMeta {
        BlockMeta {
            seq: SequenceHash(i),
            engine: EngineBlockHash(100 + i),
            parent: None,
            local: LocalBlockHash(i),
        }
    }

    #[test]
    fn evicted_blocks_move_down_and_out_stored_before_removed() {
        let mut t = LowerTiers::new(2, 1).unwrap();
        let mut out = Vec::new();
        for i in 1..=3 {
            t.offload(meta(i), &mut out);
        }
        // The third overflowed the host: its oldest (1) went to disk.
        assert_eq!(
            out[2..],
            [
                Move::Stored(Tier::Disk, meta(1)),
                Move::Removed(Tier::Host, meta(1).engine),
                Move::Stored(Tier::Host, meta(3)),
            ]
        );
        out.clear();
        t.offload(meta(4), &mut out);
        // 2 goes to disk, pushing 1 out of every tier; bottom up.
        assert_eq!(
            out,
            [
                Move::Removed(Tier::Disk, meta(1).engine),
                Move::Stored(Tier::Disk, meta(2)),
                Move::Removed(Tier::Host, meta(2).engine),
                Move::Stored(Tier::Host, meta(4)),
            ]
        );
        assert_eq!(t.tier_of(SequenceHash(1)), None);
        assert_eq!(t.tier_of(SequenceHash(2)), Some(Tier::Disk));
        assert_eq!(t.take(SequenceHash(3)), Some((Tier::Host, meta(3))));
        assert_eq!((t.len(Tier::Host), t.len(Tier::Disk)), (1, 1));
        t.clear();
        assert_eq!(
            t.blocks(Tier::Host).count() + t.blocks(Tier::Disk).count(),
            0
        );
    }

    #[test]
    fn without_a_host_tier_blocks_go_to_disk_and_without_tiers_there_is_none() {
        assert!(LowerTiers::new(0, 0).is_none());
        let mut t = LowerTiers::new(0, 1).unwrap();
        let mut out = Vec::new();
        t.offload(meta(1), &mut out);
        t.offload(meta(2), &mut out);
        assert_eq!(
            out,
            [
                Move::Stored(Tier::Disk, meta(1)),
                Move::Removed(Tier::Disk, meta(1).engine),
                Move::Stored(Tier::Disk, meta(2)),
            ]
        );
    }
}

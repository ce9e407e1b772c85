//! Which worker slots of a shard hold a block.
//!
//! A set is one `u64`: slots 0..63 as an inline bit mask, which covers every block of a shard
//! serving up to 63 worker ranks at 8 bytes per block. A set that holds a higher slot spills
//! to a side arena (bit mask plus a sorted list of the higher slots) and the `u64` becomes a
//! tagged index into it.

use smallvec::SmallVec;

/// Slots below this are kept in the inline mask.
pub const INLINE_SLOTS: u32 = 63;
const SPILL_TAG: u64 = 1 << 63;

/// A set of slots; the meaning of a spilled set depends on the [`HolderArena`] that owns it.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Holders(u64);

impl Holders {
    pub const EMPTY: Holders = Holders(0);

    #[inline(always)]
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    #[inline(always)]
    pub fn inline_mask(self) -> Option<u64> {
        (self.0 & SPILL_TAG == 0).then_some(self.0)
    }

    #[inline(always)]
    fn spill_index(self) -> usize {
        (self.0 & !SPILL_TAG) as usize
    }
}

/// A spilled set: inline-range slots as a mask, higher slots as a sorted list.
#[derive(Clone, Debug, Default)]
pub struct WideSet {
    pub mask: u64,
    pub high: SmallVec<[u32; 4]>,
}

/// Owns every spilled set of one shard.
#[derive(Default, Debug)]
pub struct HolderArena {
    sets: Vec<WideSet>,
    free: Vec<usize>,
}

impl HolderArena {
    /// Borrow a set as (inline mask, higher slots).
    #[inline]
    pub fn view(&self, h: Holders) -> (u64, &[u32]) {
        match h.inline_mask() {
            Some(mask) => (mask, &[]),
            None => {
                let s = &self.sets[h.spill_index()];
                (s.mask, &s.high)
            }
        }
    }

    pub fn contains(&self, h: Holders, slot: u32) -> bool {
        let (mask, high) = self.view(h);
        if slot < INLINE_SLOTS {
            mask & (1 << slot) != 0
        } else {
            high.binary_search(&slot).is_ok()
        }
    }

    /// Adds `slot`; returns whether it was absent.
    pub fn insert(&mut self, h: &mut Holders, slot: u32) -> bool {
        if slot < INLINE_SLOTS {
            let bit = 1u64 << slot;
            return match h.inline_mask() {
                Some(mask) => {
                    h.0 = mask | bit;
                    mask & bit == 0
                }
                None => {
                    let s = &mut self.sets[h.spill_index()];
                    let added = s.mask & bit == 0;
                    s.mask |= bit;
                    added
                }
            };
        }
        if let Some(mask) = h.inline_mask() {
            let mut high = SmallVec::new();
            high.push(slot);
            *h = self.alloc(WideSet { mask, high });
            return true;
        }
        let s = &mut self.sets[h.spill_index()];
        match s.high.binary_search(&slot) {
            Ok(_) => false,
            Err(pos) => {
                s.high.insert(pos, slot);
                true
            }
        }
    }

    /// Removes `slot`; returns whether it was present. An emptied or inline-sized spilled set
    /// goes back inline.
    pub fn remove(&mut self, h: &mut Holders, slot: u32) -> bool {
        if let Some(mask) = h.inline_mask() {
            if slot >= INLINE_SLOTS {
                return false;
            }
            let bit = 1u64 << slot;
            h.0 = mask & !bit;
            return mask & bit != 0;
        }
        let idx = h.spill_index();
        let s = &mut self.sets[idx];
        let removed = if slot < INLINE_SLOTS {
            let bit = 1u64 << slot;
            let had = s.mask & bit != 0;
            s.mask &= !bit;
            had
        } else {
            match s.high.binary_search(&slot) {
                Ok(pos) => {
                    s.high.remove(pos);
                    true
                }
                Err(_) => false,
            }
        };
        if s.high.is_empty() {
            h.0 = s.mask;
            self.release(idx);
        }
        removed
    }

    /// Frees the spill storage of a set that is being dropped.
    pub fn discard(&mut self, h: Holders) {
        if h.inline_mask().is_none() {
            self.release(h.spill_index());
        }
    }

    /// Number of spilled sets alive (for stats and tests).
    pub fn spilled(&self) -> usize {
        self.sets.len() - self.free.len()
    }

    fn alloc(&mut self, set: WideSet) -> Holders {
        let idx = match self.free.pop() {
            Some(i) => {
                self.sets[i] = set;
                i
            }
            None => {
                self.sets.push(set);
                self.sets.len() - 1
            }
        };
        Holders(SPILL_TAG | idx as u64)
    }

    fn release(&mut self, idx: usize) {
        self.sets[idx] = WideSet::default();
        self.free.push(idx);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    proptest! {
        #[test]
        fn behaves_like_a_set(ops in prop::collection::vec((any::<bool>(), 0u32..200), 0..200)) {
            let mut arena = HolderArena::default();
            let mut h = Holders::EMPTY;
            let mut model = BTreeSet::new();
            for (add, slot) in ops {
                if add {
                    prop_assert_eq!(arena.insert(&mut h, slot), model.insert(slot));
                } else {
                    prop_assert_eq!(arena.remove(&mut h, slot), model.remove(&slot));
                }
                for s in 0..200 {
                    prop_assert_eq!(arena.contains(h, s), model.contains(&s));
                }
                prop_assert_eq!(h.is_empty(), model.is_empty());
                prop_assert!(arena.spilled() <= 1);
            }
        }
    }
}

//! Which worker slots of a shard hold a block.
//!
//! A set is one `u64` in one of three forms, told apart by its top two bits:
//! - slots 0..61 as an inline bit mask, which covers every block of a shard serving up to
//!   62 worker ranks at 8 bytes per block;
//! - one slot of any number (a block only one rank holds, the common case in big fleets);
//! - an index into a side arena of spilled sets (bit mask plus a sorted list of the higher
//!   slots), for anything else.

use smallvec::SmallVec;

/// Slots below this are kept in the inline mask.
pub const INLINE_SLOTS: u32 = 62;
const SINGLE_TAG: u64 = 1 << 62;
const SPILL_TAG: u64 = 1 << 63;
const TAGS: u64 = SINGLE_TAG | SPILL_TAG;

/// A set of slots; the meaning of a spilled set depends on the [`HolderArena`] that owns it.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Holders(u64);

enum Form {
    Mask(u64),
    Single(u32),
    Spilled(usize),
}

impl Holders {
    pub const EMPTY: Holders = Holders(0);

    #[inline(always)]
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    #[inline(always)]
    fn form(self) -> Form {
        match self.0 & TAGS {
            0 => Form::Mask(self.0),
            SINGLE_TAG => Form::Single(self.0 as u32),
            _ => Form::Spilled((self.0 & !TAGS) as usize),
        }
    }

    fn single(slot: u32) -> Self {
        Holders(SINGLE_TAG | slot as u64)
    }
}

/// A spilled set: inline-range slots as a mask, higher slots as a sorted list.
#[derive(Clone, Debug, Default)]
pub struct WideSet {
    pub mask: u64,
    pub high: SmallVec<[u32; 4]>,
}

/// A set as seen by a lookup: the inline-range mask and the higher slots, sorted.
pub struct View<'a> {
    pub mask: u64,
    high: High<'a>,
}

enum High<'a> {
    Slice(&'a [u32]),
    One([u32; 1]),
}

impl View<'_> {
    #[inline(always)]
    pub fn high(&self) -> &[u32] {
        match &self.high {
            High::Slice(s) => s,
            High::One(one) => one,
        }
    }
}

/// Owns every spilled set of one shard.
#[derive(Default, Debug)]
pub struct HolderArena {
    sets: Vec<WideSet>,
    free: Vec<usize>,
}

impl HolderArena {
    #[inline]
    pub fn view(&self, h: Holders) -> View<'_> {
        match h.form() {
            Form::Mask(mask) => View {
                mask,
                high: High::Slice(&[]),
            },
            Form::Single(s) if s < INLINE_SLOTS => View {
                mask: 1 << s,
                high: High::Slice(&[]),
            },
            Form::Single(s) => View {
                mask: 0,
                high: High::One([s]),
            },
            Form::Spilled(i) => {
                let s = &self.sets[i];
                View {
                    mask: s.mask,
                    high: High::Slice(&s.high),
                }
            }
        }
    }

    pub fn contains(&self, h: Holders, slot: u32) -> bool {
        let v = self.view(h);
        if slot < INLINE_SLOTS {
            v.mask & (1 << slot) != 0
        } else {
            v.high().binary_search(&slot).is_ok()
        }
    }

    /// Adds `slot`; returns whether it was absent.
    pub fn insert(&mut self, h: &mut Holders, slot: u32) -> bool {
        match h.form() {
            Form::Mask(mask) if slot < INLINE_SLOTS => {
                h.0 = mask | 1 << slot;
                mask & (1 << slot) == 0
            }
            Form::Mask(0) => {
                *h = Holders::single(slot);
                true
            }
            Form::Mask(mask) => {
                *h = self.alloc(WideSet {
                    mask,
                    high: SmallVec::from_slice(&[slot]),
                });
                true
            }
            Form::Single(s) if s == slot => false,
            Form::Single(s) => {
                let mut set = WideSet::default();
                for x in [s, slot] {
                    if x < INLINE_SLOTS {
                        set.mask |= 1 << x;
                    } else {
                        set.high.push(x);
                    }
                }
                set.high.sort_unstable();
                *h = self.alloc(set);
                true
            }
            Form::Spilled(i) => {
                let s = &mut self.sets[i];
                if slot < INLINE_SLOTS {
                    let added = s.mask & (1 << slot) == 0;
                    s.mask |= 1 << slot;
                    return added;
                }
                match s.high.binary_search(&slot) {
                    Ok(_) => false,
                    Err(pos) => {
                        s.high.insert(pos, slot);
                        true
                    }
                }
            }
        }
    }

    /// Removes `slot`; returns whether it was present. A spilled set that no longer needs
    /// the arena goes back to an inline form.
    pub fn remove(&mut self, h: &mut Holders, slot: u32) -> bool {
        match h.form() {
            Form::Mask(mask) => {
                if slot >= INLINE_SLOTS {
                    return false;
                }
                h.0 = mask & !(1 << slot);
                mask & (1 << slot) != 0
            }
            Form::Single(s) => {
                if s != slot {
                    return false;
                }
                *h = Holders::EMPTY;
                true
            }
            Form::Spilled(i) => {
                let s = &mut self.sets[i];
                let removed = if slot < INLINE_SLOTS {
                    let had = s.mask & (1 << slot) != 0;
                    s.mask &= !(1 << slot);
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
                match (s.mask, s.high.as_slice()) {
                    (mask, []) => {
                        h.0 = mask;
                        self.release(i);
                    }
                    (0, [one]) => {
                        *h = Holders::single(*one);
                        self.release(i);
                    }
                    _ => {}
                }
                removed
            }
        }
    }

    /// Frees the spill storage of a set that is being dropped.
    pub fn discard(&mut self, h: Holders) {
        if let Form::Spilled(i) = h.form() {
            self.release(i);
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
                let v = arena.view(h);
                let mut seen: BTreeSet<u32> = v.high().iter().copied().collect();
                seen.extend((0..INLINE_SLOTS).filter(|s| v.mask & (1 << s) != 0));
                prop_assert_eq!(&seen, &model);
                prop_assert!(v.high().windows(2).all(|w| w[0] < w[1]));
                prop_assert_eq!(h.is_empty(), model.is_empty());
                // a set of one slot never needs the arena
                prop_assert_eq!(arena.spilled(), usize::from(model.len() > 1 && model.iter().any(|&s| s >= INLINE_SLOTS)));
            }
        }
    }
}

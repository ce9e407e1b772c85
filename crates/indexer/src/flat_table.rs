//! An open-addressing hash table with linear probing, sized for the index's two tables.
//!
//! Why not hashbrown: the index is bound by memory latency, one miss per block of an event
//! or a lookup. Knowing where an entry lives lets the index prefetch the entries of blocks
//! a few steps ahead, so their misses overlap instead of following one another. Deletion
//! shifts entries back (no tombstones), so a table under churn neither degrades nor grows.
//! Entries are stored inline, no control bytes; an entry is empty when its `is_empty`
//! says so (the index never stores the value that marks it).

use allocator_api2::vec::Vec as AVec;
use std::alloc::System;

/// An entry type: `Copy`, with a value that marks an empty slot.
pub trait Slot: Copy {
    const EMPTY: Self;
    fn is_empty(&self) -> bool;
}

/// Grow past 4/5 full, by half; shrink below 1/4 full to 3/5 full. Sizes need not be
/// powers of two (the slot is picked by a multiply, not a mask), so the load stays between
/// about 0.53 and 0.8 instead of halving at every doubling.
const GROW_NUM: usize = 4;
const GROW_DEN: usize = 5;
const MIN_SLOTS: usize = 16;

/// A table of `T`, each placed by a 64-bit hash the caller computes (its high bits pick the
/// slot, so the hash must be mixed in its high bits). The slots come from the system
/// allocator: a large table is its own mapping, returned to the OS when a resize frees it.
pub struct FlatTable<T: Slot> {
    slots: AVec<T, System>,
    len: usize,
}

impl<T: Slot> Default for FlatTable<T> {
    fn default() -> Self {
        Self {
            slots: AVec::new_in(System),
            len: 0,
        }
    }
}

impl<T: Slot> FlatTable<T> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of the slot array.
    pub fn allocation_size(&self) -> usize {
        self.slots.len() * std::mem::size_of::<T>()
    }

    /// The first slot to probe: `hash` scaled onto `0..len` (multiply-shift, high bits).
    #[inline(always)]
    fn home(&self, hash: u64) -> usize {
        ((hash as u128 * self.slots.len() as u128) >> 64) as usize
    }

    #[inline(always)]
    fn next(&self, i: usize) -> usize {
        if i + 1 == self.slots.len() {
            0
        } else {
            i + 1
        }
    }

    /// Probe steps from `from` forward to `to`.
    #[inline(always)]
    fn distance(&self, from: usize, to: usize) -> usize {
        if to >= from {
            to - from
        } else {
            to + self.slots.len() - from
        }
    }

    /// Hints the CPU to fetch the slot where `hash` starts probing.
    #[inline(always)]
    pub fn prefetch(&self, hash: u64) {
        if self.slots.is_empty() {
            return;
        }
        let p = unsafe { self.slots.as_ptr().add(self.home(hash)) };
        prefetch(p);
    }

    #[inline]
    fn position(&self, hash: u64, mut eq: impl FnMut(&T) -> bool) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        let mut i = self.home(hash);
        loop {
            let s = &self.slots[i];
            if s.is_empty() {
                return None;
            }
            if eq(s) {
                return Some(i);
            }
            i = self.next(i);
        }
    }

    #[inline]
    pub fn find(&self, hash: u64, eq: impl FnMut(&T) -> bool) -> Option<&T> {
        self.position(hash, eq).map(|i| &self.slots[i])
    }

    #[inline]
    pub fn find_mut(&mut self, hash: u64, eq: impl FnMut(&T) -> bool) -> Option<&mut T> {
        self.position(hash, eq).map(|i| &mut self.slots[i])
    }

    /// The entry `eq` picks, or a new one made by `make`.
    #[inline]
    pub fn find_or_insert(
        &mut self,
        hash: u64,
        eq: impl FnMut(&T) -> bool,
        make: impl FnOnce() -> T,
        hasher: impl Fn(&T) -> u64,
    ) -> &mut T {
        match self.position(hash, eq) {
            Some(i) => &mut self.slots[i],
            None => {
                let i = self.insert_unique(hash, make(), hasher);
                &mut self.slots[i]
            }
        }
    }

    /// Inserts an entry the caller knows is absent; returns its slot.
    pub fn insert_unique(&mut self, hash: u64, value: T, hasher: impl Fn(&T) -> u64) -> usize {
        if (self.len + 1) * GROW_DEN > self.slots.len() * GROW_NUM {
            let n = (self.slots.len() * 3 / 2).max(MIN_SLOTS);
            self.resize(n, &hasher);
        }
        let mut i = self.home(hash);
        while !self.slots[i].is_empty() {
            i = self.next(i);
        }
        self.slots[i] = value;
        self.len += 1;
        i
    }

    /// Removes the entry `eq` picks, shifting later entries of its run back.
    pub fn remove(
        &mut self,
        hash: u64,
        eq: impl FnMut(&T) -> bool,
        hasher: impl Fn(&T) -> u64,
    ) -> Option<T> {
        let mut hole = self.position(hash, eq)?;
        let out = self.slots[hole];
        let mut j = hole;
        loop {
            j = self.next(j);
            let s = self.slots[j];
            if s.is_empty() {
                break;
            }
            let home = self.home(hasher(&s));
            // The entry at j may fill the hole if the hole lies on its probe path.
            if self.distance(home, j) >= self.distance(hole, j) {
                self.slots[hole] = s;
                hole = j;
            }
        }
        self.slots[hole] = T::EMPTY;
        self.len -= 1;
        Some(out)
    }

    /// Shrinks the table to 3/5 full once it is under 1/4 full.
    pub fn shrink_if_sparse(&mut self, hasher: impl Fn(&T) -> u64) {
        let n = self.slots.len();
        if n > MIN_SLOTS && self.len * 4 < n {
            let to = if self.len == 0 {
                0
            } else {
                (self.len * 5 / 3).max(MIN_SLOTS)
            };
            self.resize(to, &hasher);
        }
    }

    /// Empties the table, returning every entry.
    pub fn take_all(&mut self) -> impl Iterator<Item = T> {
        let old = std::mem::take(self);
        old.slots.into_iter().filter(|s| !s.is_empty())
    }

    pub fn iter(&self) -> impl Iterator<Item = &T> + '_ {
        self.slots.iter().filter(|s| !s.is_empty())
    }

    fn resize(&mut self, n: usize, hasher: &impl Fn(&T) -> u64) {
        let mut slots = AVec::with_capacity_in(n, System);
        advise_huge_pages(slots.as_ptr(), n * std::mem::size_of::<T>());
        slots.resize(n, T::EMPTY);
        let old = std::mem::replace(&mut self.slots, slots);
        for s in old.into_iter().filter(|s| !s.is_empty()) {
            let mut i = self.home(hasher(&s));
            while !self.slots[i].is_empty() {
                i = self.next(i);
            }
            self.slots[i] = s;
        }
    }
}

/// Asks for transparent huge pages on a big table (where the kernel's setting is
/// `madvise`): its probes land anywhere in it, and with 4 KiB pages nearly every one also
/// misses the TLB.
fn advise_huge_pages<T>(p: *const T, bytes: usize) {
    const HUGE: usize = 2 << 20;
    if bytes < 2 * HUGE {
        return;
    }
    #[cfg(target_os = "linux")]
    {
        let start = (p as usize).next_multiple_of(HUGE);
        let end = (p as usize + bytes) / HUGE * HUGE;
        if end > start {
            // SAFETY: advice on pages of our own allocation; it never changes their contents.
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = p;
}

#[inline(always)]
fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint; it never faults, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p as *const i8);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    #[derive(Clone, Copy, Debug, PartialEq)]
    struct E {
        k: u64,
        v: u64,
    }
    impl Slot for E {
        const EMPTY: E = E { k: 0, v: 0 };
        fn is_empty(&self) -> bool {
            self.k == 0
        }
    }
    /// A deliberately poor hash (few distinct homes) to exercise long runs and wrap-around.
    fn h(k: u64) -> u64 {
        (k % 7).wrapping_mul(0x9E37_79B9_7F4A_7C15) | (k & 1) << 63
    }

    proptest! {
        #[test]
        fn behaves_like_a_map(ops in prop::collection::vec((0u8..3, 1u64..60, any::<u64>()), 0..400)) {
            let mut t: FlatTable<E> = FlatTable::default();
            let mut model: HashMap<u64, u64> = HashMap::new();
            for (op, k, v) in ops {
                match op {
                    0 => {
                        let e = t.find_or_insert(h(k), |e| e.k == k, || E { k, v }, |e| h(e.k));
                        let m = *model.entry(k).or_insert(v);
                        prop_assert_eq!(e.v, m);
                    }
                    1 => {
                        let got = t.remove(h(k), |e| e.k == k, |e| h(e.k)).map(|e| e.v);
                        prop_assert_eq!(got, model.remove(&k));
                        t.shrink_if_sparse(|e| h(e.k));
                    }
                    _ => {
                        prop_assert_eq!(t.find(h(k), |e| e.k == k).map(|e| e.v), model.get(&k).copied());
                    }
                }
                prop_assert_eq!(t.len(), model.len());
                for k in 1..60 {
                    prop_assert_eq!(t.find(h(k), |e| e.k == k).map(|e| e.v), model.get(&k).copied());
                }
            }
            let mut all: Vec<(u64, u64)> = t.take_all().map(|e| (e.k, e.v)).collect();
            all.sort_unstable();
            let mut want: Vec<(u64, u64)> = model.into_iter().collect();
            want.sort_unstable();
            prop_assert_eq!(all, want);
            prop_assert!(t.is_empty());
        }
    }

    #[test]
    fn grows_and_shrinks_with_its_contents() {
        let mut t: FlatTable<E> = FlatTable::default();
        let hh = |k: u64| k.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        for k in 1..=10_000 {
            t.insert_unique(hh(k), E { k, v: k }, |e| hh(e.k));
        }
        assert!(t.allocation_size() >= 10_000 * 16 * 5 / 4);
        assert!(t.allocation_size() <= 10_000 * 16 * 2);
        let big = t.allocation_size();
        for k in 1..=9_900 {
            assert!(t.remove(hh(k), |e| e.k == k, |e| hh(e.k)).is_some());
        }
        t.shrink_if_sparse(|e| hh(e.k));
        assert!(
            t.allocation_size() * 16 < big,
            "{} of {big}",
            t.allocation_size()
        );
        for k in 9_901..=10_000 {
            assert_eq!(t.find(hh(k), |e| e.k == k).unwrap().v, k);
        }
    }
}

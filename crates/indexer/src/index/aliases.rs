//! One holder slot's names for its blocks: engine block hash → location.
//!
//! An open-addressing table with linear probing and backward-shift deletion (no tombstones:
//! LRU churn removes as many names as it adds), 16 bytes an entry. Its own rather than
//! hashbrown's because a `Removed` of cold blocks is one cache miss per name: knowing where
//! each name's entry sits lets the index prefetch a window of them ahead and keep several
//! misses in flight instead of one.

use super::runs::Loc;
use crate::table_alloc::TableAlloc;
use allocator_api2::vec::Vec;

#[derive(Clone, Copy)]
struct Entry {
    engine: u64,
    /// `EMPTY` for a free entry.
    run: u32,
    pos: u32,
}

const EMPTY: u32 = u32::MAX;
const FREE: Entry = Entry {
    engine: 0,
    run: EMPTY,
    pos: 0,
};
const MIN_CAPACITY: usize = 16;

/// Fibonacci hashing: the top bits of one multiply (engine hashes may be small or
/// sequential; the multiply spreads them, the top bits are its best mixed).
const FIB: u64 = 0x9E37_79B9_7F4A_7C15;

pub(super) struct Aliases {
    entries: Vec<Entry, TableAlloc>,
    len: usize,
    /// 64 - log2(capacity).
    shift: u32,
}

impl Default for Aliases {
    fn default() -> Self {
        Self {
            entries: Vec::new_in(TableAlloc),
            len: 0,
            shift: 63,
        }
    }
}

impl Aliases {
    #[inline(always)]
    fn mask(&self) -> usize {
        self.entries.len().wrapping_sub(1)
    }

    #[inline(always)]
    fn home(&self, engine: u64) -> usize {
        (engine.wrapping_mul(FIB) >> self.shift) as usize
    }

    /// Index of `engine`'s entry, or of the free entry where it would go.
    #[inline]
    fn probe(&self, engine: u64) -> Result<usize, usize> {
        let mask = self.mask();
        let mut i = self.home(engine);
        loop {
            let e = &self.entries[i];
            if e.run == EMPTY {
                return Err(i);
            }
            if e.engine == engine {
                return Ok(i);
            }
            i = (i + 1) & mask;
        }
    }

    /// Asks the CPU to bring `engine`'s entry into cache, and the line after it (a probe or
    /// a backward shift often runs on into it): a later lookup of it, a few names on, then
    /// finds both there.
    #[inline(always)]
    pub fn prefetch(&self, engine: u64) {
        if self.entries.is_empty() {
            return;
        }
        let i = self.home(engine);
        prefetch(&self.entries[i]);
        // Four entries a line: the first entry of the next group of four (exactly the next
        // line for big tables, which are page-aligned mappings).
        if let Some(next) = self.entries.get((i | 3) + 1) {
            prefetch(next);
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.len
    }

    #[inline]
    pub fn get(&self, engine: u64) -> Option<Loc> {
        if self.len == 0 {
            return None;
        }
        self.probe(engine).ok().map(|i| {
            let e = &self.entries[i];
            Loc {
                run: e.run,
                pos: e.pos,
            }
        })
    }

    /// Names `loc` `engine`; returns what the name named before, if anything.
    #[inline]
    pub fn insert(&mut self, engine: u64, loc: Loc) -> Option<Loc> {
        if (self.len + 1) * 4 > self.entries.len() * 3 {
            self.resize((self.entries.len() * 2).max(MIN_CAPACITY));
        }
        let (i, old) = match self.probe(engine) {
            Ok(i) => {
                let e = self.entries[i];
                (
                    i,
                    Some(Loc {
                        run: e.run,
                        pos: e.pos,
                    }),
                )
            }
            Err(i) => {
                self.len += 1;
                (i, None)
            }
        };
        self.entries[i] = Entry {
            engine,
            run: loc.run,
            pos: loc.pos,
        };
        old
    }

    /// Forgets `engine`; returns what it named.
    #[inline]
    pub fn remove(&mut self, engine: u64) -> Option<Loc> {
        if self.len == 0 {
            return None;
        }
        let mut i = self.probe(engine).ok()?;
        let e = self.entries[i];
        self.len -= 1;
        // Backward shift: pull later entries of the probe sequence into the hole.
        let mask = self.mask();
        let mut j = i;
        loop {
            j = (j + 1) & mask;
            let next = self.entries[j];
            if next.run == EMPTY {
                break;
            }
            let k = self.home(next.engine);
            // `next` may move to `i` unless its home lies cyclically in (i, j].
            let stays = if i <= j {
                i < k && k <= j
            } else {
                i < k || k <= j
            };
            if !stays {
                self.entries[i] = next;
                i = j;
            }
        }
        self.entries[i] = FREE;
        Some(Loc {
            run: e.run,
            pos: e.pos,
        })
    }

    /// Shrinks a table that churn left mostly empty.
    pub fn maybe_shrink(&mut self) {
        let cap = self.entries.len();
        if cap > 64 && self.len * 8 < cap {
            self.resize((self.len * 5 / 2).next_power_of_two().max(MIN_CAPACITY));
        }
    }

    fn resize(&mut self, capacity: usize) {
        let mut entries = Vec::with_capacity_in(capacity, TableAlloc);
        entries.resize(capacity, FREE);
        let old = std::mem::replace(&mut self.entries, entries);
        self.shift = 64 - capacity.trailing_zeros();
        let mask = capacity - 1;
        for e in old.iter().filter(|e| e.run != EMPTY) {
            let mut i = self.home(e.engine);
            while self.entries[i].run != EMPTY {
                i = (i + 1) & mask;
            }
            self.entries[i] = *e;
        }
    }

    /// Every (engine hash, location).
    pub fn iter(&self) -> impl Iterator<Item = (u64, Loc)> + '_ {
        self.entries.iter().filter(|e| e.run != EMPTY).map(|e| {
            (
                e.engine,
                Loc {
                    run: e.run,
                    pos: e.pos,
                },
            )
        })
    }

    pub fn allocation_size(&self) -> usize {
        self.entries.capacity() * std::mem::size_of::<Entry>()
    }
}

#[inline(always)]
fn prefetch(e: &Entry) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint; it never faults, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch(
            e as *const Entry as *const i8,
            std::arch::x86_64::_MM_HINT_T0,
        );
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = e;
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    proptest! {
        /// Behaves like a map through growth, shrinking and backward-shift deletion (small
        /// key ranges make long probe runs and wrap-arounds).
        #[test]
        fn behaves_like_a_map(ops in prop::collection::vec((any::<bool>(), 0u64..300, 0u32..1000), 0..600)) {
            let mut t = Aliases::default();
            let mut model = HashMap::new();
            for (insert, e, v) in ops {
                let loc = Loc { run: v, pos: v % 64 };
                if insert {
                    prop_assert_eq!(t.insert(e, loc), model.insert(e, loc));
                } else {
                    prop_assert_eq!(t.remove(e), model.remove(&e));
                    t.maybe_shrink();
                }
                prop_assert_eq!(t.len(), model.len());
                for k in 0..300u64 {
                    prop_assert_eq!(t.get(k), model.get(&k).copied());
                }
            }
            let mut all: std::vec::Vec<_> = t.iter().collect();
            all.sort_by_key(|(e, _)| *e);
            let mut want: std::vec::Vec<_> = model.into_iter().collect();
            want.sort_by_key(|(e, _)| *e);
            prop_assert_eq!(all, want);
        }
    }
}

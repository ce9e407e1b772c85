//! Runs: the index's blocks as chains of up to [`RUN_CAP`] prefixes of one branch.
//!
//! A run holds the prefix ids of consecutive blocks (block `k > 0`'s parent is block `k - 1`)
//! and, per holder slot, a bitmap of the positions it holds. Runs are found by the prefix id
//! of their first block (the heads table); a run records its parent's prefix id, not a
//! pointer, so a run whose parent went away is reachable again once the parent is stored anew.
//!
//! Invariant (one location per prefix): a stored prefix is at exactly one `(run, pos)`, and a
//! block whose parent sits at `(r, q)` is either at `(r, q + 1)` or the head of a run. So a
//! lookup enters every run at its head and, where a run ends or the query leaves it, finds
//! the next block (if any) in the heads table. A block never moves, so a rank's alias (engine
//! hash → location) stays valid while it exists; `refs` keeps a run alive while an alias names
//! one of its positions.
//!
//! This module keeps the structure; which slot holds what, and the aliases, are the index's.

use super::Table;
use smallvec::SmallVec;

/// Blocks per run: one `u64` bitmap per holder.
pub(super) const RUN_CAP: usize = 64;

/// Holder slots from here on are lower-tier slots (host, disk, shared storage).
pub(super) const LOWER_BASE: u32 = 1 << 30;

/// Where a block is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Loc {
    pub run: u32,
    pub pos: u32,
}

/// The positions one slot holds in a run.
#[derive(Clone, Copy, Debug)]
pub(super) struct Holder {
    pub bits: u64,
    pub slot: u32,
}

pub(super) struct Run {
    /// Prefix id of the block before `ids[0]` (`prefix::ROOT` for a first block).
    pub parent: u64,
    /// `ids`' last: a lookup that covers the run compares it without reading `ids`.
    pub last: u64,
    pub ids: Vec<u64>,
    /// Sorted by slot: device slots first.
    pub holders: SmallVec<[Holder; 2]>,
    /// Positions held by any slot.
    pub any: u64,
    /// Positions held by a device slot.
    pub dev: u64,
    /// Alias entries (any slot) naming a position here.
    pub refs: u32,
}

impl Run {
    #[inline]
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    #[inline]
    pub fn bits(&self, slot: u32) -> u64 {
        match self.holders.binary_search_by_key(&slot, |h| h.slot) {
            Ok(i) => self.holders[i].bits,
            Err(_) => 0,
        }
    }

    /// Device holders (the sorted prefix of `holders` below [`LOWER_BASE`]).
    #[inline]
    pub fn device_holders(&self) -> &[Holder] {
        let n = self.holders.partition_point(|h| h.slot < LOWER_BASE);
        &self.holders[..n]
    }
}

#[derive(Clone, Copy)]
struct Head {
    id: u64,
    run: u32,
}

/// What a change of holder bits did.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Delta {
    /// (block, slot) pairs added or removed.
    pub pairs: usize,
    /// Blocks that gained or lost their last device holder.
    pub dev_blocks: usize,
}

pub(super) struct Runs {
    runs: Vec<Run>,
    free: Vec<u32>,
    heads: Table<Head>,
    /// Capacity of every run's id list, for the byte count.
    id_words: usize,
    /// Holder lists spilled to the heap (more than two holders), in entries.
    spilled_holders: usize,
    /// Runs whose parent's prefix id falls in each slot (a counting filter by parent): a
    /// block appended at a run's end skips the heads probe where no run hangs below it.
    below: Vec<u32>,
    below_shift: u32,
}

impl Default for Runs {
    fn default() -> Self {
        Self {
            runs: Vec::new(),
            free: Vec::new(),
            heads: super::new_table(),
            id_words: 0,
            spilled_holders: 0,
            below: Vec::new(),
            below_shift: 64,
        }
    }
}

impl Runs {
    #[inline]
    pub fn get(&self, run: u32) -> &Run {
        &self.runs[run as usize]
    }

    #[inline]
    pub fn head(&self, id: u64) -> Option<u32> {
        self.heads.find(id, |h| h.id == id).map(|h| h.run)
    }

    #[inline]
    pub fn id(&self, loc: Loc) -> u64 {
        self.runs[loc.run as usize].ids[loc.pos as usize]
    }

    /// The prefix id of the block before `loc`.
    pub fn parent_id(&self, loc: Loc) -> u64 {
        let r = &self.runs[loc.run as usize];
        match loc.pos {
            0 => r.parent,
            p => r.ids[p as usize - 1],
        }
    }

    #[inline]
    pub fn holds(&self, loc: Loc, slot: u32) -> bool {
        self.runs[loc.run as usize].bits(slot) >> loc.pos & 1 != 0
    }

    /// The existing location of the block with prefix id `id` whose parent, prefix id
    /// `parent`, is at `at` (the root when `None`).
    #[inline]
    pub fn find_child(&self, at: Option<Loc>, parent: u64, id: u64) -> Option<Loc> {
        if let Some(a) = at {
            let r = &self.runs[a.run as usize];
            if r.ids.get(a.pos as usize + 1) == Some(&id) {
                return Some(Loc {
                    run: a.run,
                    pos: a.pos + 1,
                });
            }
            // Most new blocks extend a run below which no run hangs: no heads probe then.
            if self.below[self.below_slot(parent)] == 0 {
                return None;
            }
        }
        self.head(id).map(|run| Loc { run, pos: 0 })
    }

    #[inline(always)]
    fn below_slot(&self, parent: u64) -> usize {
        // Prefix ids are well mixed: their top bits index the filter.
        (parent >> self.below_shift) as usize
    }

    /// Counts a run hanging below `parent` (or uncounts it), growing the filter with the runs
    /// (a new run is already in `runs`: a rebuild counts it).
    fn count_below(&mut self, parent: u64, add: bool) {
        if add && self.live() * 2 > self.below.len() {
            let len = (self.below.len() * 2).max(1024);
            self.below = vec![0; len];
            self.below_shift = 64 - len.trailing_zeros();
            for i in 0..self.runs.len() {
                if !self.runs[i].ids.is_empty() {
                    let slot = self.below_slot(self.runs[i].parent);
                    self.below[slot] += 1;
                }
            }
            return;
        }
        let slot = self.below_slot(parent);
        if add {
            self.below[slot] += 1;
        } else {
            self.below[slot] = self.below[slot].saturating_sub(1);
        }
    }

    /// Whether a block may be added after `at`: it is its run's last block and there is room.
    /// (Other holders' bitmaps do not cover the new position, so whoever holds the run may
    /// extend it.)
    #[inline]
    pub fn appendable(&self, at: Loc) -> bool {
        let r = &self.runs[at.run as usize];
        at.pos as usize + 1 == r.len() && r.len() < RUN_CAP
    }

    /// Adds a block after the last one of `run`; the caller checked [`Runs::appendable`].
    pub fn append(&mut self, run: u32, id: u64) -> Loc {
        let r = &mut self.runs[run as usize];
        let cap = r.ids.capacity();
        r.ids.push(id);
        r.last = id;
        self.id_words += r.ids.capacity() - cap;
        Loc {
            run,
            pos: r.len() as u32 - 1,
        }
    }

    /// A new run of one block, `id`, below the prefix `parent`.
    pub fn create(&mut self, parent: u64, id: u64) -> Loc {
        let mut ids = Vec::with_capacity(4);
        ids.push(id);
        self.id_words += ids.capacity();
        let run = Run {
            parent,
            last: id,
            ids,
            holders: SmallVec::new(),
            any: 0,
            dev: 0,
            refs: 0,
        };
        let n = match self.free.pop() {
            Some(n) => {
                self.runs[n as usize] = run;
                n
            }
            None => {
                self.runs.push(run);
                self.runs.len() as u32 - 1
            }
        };
        self.heads.insert_unique(id, Head { id, run: n }, |h| h.id);
        self.count_below(parent, true);
        Loc { run: n, pos: 0 }
    }

    pub fn add_ref(&mut self, run: u32) {
        self.runs[run as usize].refs += 1;
    }

    /// Drops `n` aliases naming `run`, freeing the run if nothing holds or names it any more.
    pub fn drop_refs(&mut self, run: u32, n: u32) {
        let r = &mut self.runs[run as usize];
        r.refs = r.refs.saturating_sub(n);
        self.free_if_unused(run);
    }

    /// Frees `run` when no slot holds a block of it and no alias names one.
    pub fn free_if_unused(&mut self, run: u32) {
        let r = &self.runs[run as usize];
        if r.any != 0 || r.refs != 0 || r.ids.is_empty() {
            return;
        }
        let head = r.ids[0];
        if let Ok(e) = self.heads.find_entry(head, |h| h.run == run) {
            e.remove();
        }
        let parent = r.parent;
        self.count_below(parent, false);
        let r = &mut self.runs[run as usize];
        self.id_words -= r.ids.capacity();
        self.spilled_holders -= spilled(&r.holders);
        r.ids = Vec::new();
        r.holders = SmallVec::new();
        self.free.push(run);
        super::maybe_shrink(&mut self.heads, |h| h.id);
    }

    /// Marks `bits` of `run` held by `slot`.
    pub fn set_bits(&mut self, run: u32, slot: u32, bits: u64) -> Delta {
        let r = &mut self.runs[run as usize];
        let before = (r.any, r.dev);
        let added = match r.holders.binary_search_by_key(&slot, |h| h.slot) {
            Ok(i) => {
                let h = &mut r.holders[i];
                let added = bits & !h.bits;
                h.bits |= bits;
                added
            }
            Err(i) => {
                let before = spilled(&r.holders);
                r.holders.insert(i, Holder { bits, slot });
                self.spilled_holders += spilled(&r.holders) - before;
                bits
            }
        };
        if added == 0 {
            return Delta::default();
        }
        r.any |= added;
        if slot < LOWER_BASE {
            r.dev |= added;
        }
        Delta {
            pairs: added.count_ones() as usize,
            dev_blocks: (r.dev & !before.1).count_ones() as usize,
        }
    }

    /// Marks `bits` of `run` no longer held by `slot`, freeing the run if that leaves it
    /// unused.
    pub fn clear_bits(&mut self, run: u32, slot: u32, bits: u64) -> Delta {
        let r = &mut self.runs[run as usize];
        let Ok(i) = r.holders.binary_search_by_key(&slot, |h| h.slot) else {
            return Delta::default();
        };
        let cleared = r.holders[i].bits & bits;
        if cleared == 0 {
            return Delta::default();
        }
        r.holders[i].bits &= !bits;
        if r.holders[i].bits == 0 {
            r.holders.remove(i);
        }
        // Positions no other holder keeps; stop as soon as every cleared one is kept (big
        // fleets share runs among many holders).
        let mut gone = cleared;
        let mut gone_dev = if slot < LOWER_BASE { cleared } else { 0 };
        for h in &r.holders {
            gone &= !h.bits;
            if h.slot < LOWER_BASE {
                gone_dev &= !h.bits;
            } else if gone == 0 {
                break;
            }
            if gone == 0 && gone_dev == 0 {
                break;
            }
        }
        r.any &= !gone;
        r.dev &= !gone_dev;
        let d = Delta {
            pairs: cleared.count_ones() as usize,
            dev_blocks: gone_dev.count_ones() as usize,
        };
        self.free_if_unused(run);
        d
    }

    /// Runs in use.
    pub fn live(&self) -> usize {
        self.runs.len() - self.free.len()
    }

    pub fn bytes(&self) -> usize {
        self.runs.capacity() * std::mem::size_of::<Run>()
            + self.free.capacity() * 4
            + self.heads.allocation_size()
            + self.id_words * 8
            + self.spilled_holders * std::mem::size_of::<Holder>()
    }

    pub fn is_empty(&self) -> bool {
        self.heads.is_empty()
    }

    /// Blocks of the query `ids` (prefix ids from `from` on) that follow `run`'s head in
    /// order: how far the query stays in the run.
    #[inline]
    pub fn matched(&self, run: u32, query: &[u64]) -> usize {
        let r = &self.runs[run as usize];
        let rem = r.len().min(query.len());
        if rem == 0 {
            return 0;
        }
        let end = if rem == r.len() {
            r.last
        } else {
            r.ids[rem - 1]
        };
        if end == query[rem - 1] {
            return rem;
        }
        // Ids are chained: once the query leaves the run it never comes back.
        r.ids[..rem - 1]
            .iter()
            .zip(query)
            .position(|(a, b)| a != b)
            .unwrap_or(rem - 1)
    }
}

/// Heap entries of a holder list (none while it fits inline).
#[inline]
fn spilled(h: &SmallVec<[Holder; 2]>) -> usize {
    if h.spilled() {
        h.capacity()
    } else {
        0
    }
}

//! The index's own prefix ids.
//!
//! The index names a prefix of blocks by a 64-bit id chained from local hashes. It does not
//! reuse the xxh3 sequence hash: one step here is two multiplies and a rotate (about 2 ns of
//! latency against 7-10 ns for xxh3), lookups compute one step per block, and the step is
//! invertible, so a stored block's local hash is recovered from its id and its parent's id
//! instead of being stored.

use kvrouter_protocol::LocalBlockHash;

/// The id of the empty prefix: the parent of every first block.
pub const ROOT: u64 = 0;

const M1: u64 = 0x9E37_79B9_7F4A_7C15;
const M2: u64 = 0xD6E8_FEB8_6659_FD93;
/// Keeps the empty prefix from being a fixed point (`extend(ROOT, 0)` must not be `ROOT`).
const K: u64 = 0x2545_F491_4F6C_DD1D;
const M1_INV: u64 = mod_inverse(M1);
const M2_INV: u64 = mod_inverse(M2);

/// Multiplicative inverse of an odd number modulo 2^64 (Newton's iteration).
const fn mod_inverse(x: u64) -> u64 {
    let mut inv = x;
    let mut i = 0;
    while i < 6 {
        inv = inv.wrapping_mul(2u64.wrapping_sub(x.wrapping_mul(inv)));
        i += 1;
    }
    inv
}

/// The id of `parent` extended by one block. Well mixed in every bit, so it serves directly
/// as the hash-table hash.
#[inline(always)]
pub fn extend(parent: u64, local: u64) -> u64 {
    (parent ^ local)
        .wrapping_mul(M1)
        .rotate_left(32)
        .wrapping_mul(M2)
        ^ K
}

/// The local hash of the block that extended `parent` into `prefix`.
#[inline]
pub fn local_of(prefix: u64, parent: u64) -> u64 {
    (prefix ^ K)
        .wrapping_mul(M2_INV)
        .rotate_right(32)
        .wrapping_mul(M1_INV)
        ^ parent
}

/// Prefix ids of a query, computed lazily and shared by every shard a lookup visits.
pub struct PrefixChain<'a> {
    local: &'a [LocalBlockHash],
    ids: Vec<u64>,
}

impl<'a> PrefixChain<'a> {
    pub fn new(local: &'a [LocalBlockHash]) -> Self {
        Self {
            local,
            ids: Vec::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.local.len()
    }

    pub fn is_empty(&self) -> bool {
        self.local.is_empty()
    }

    /// The id of the prefix of blocks `0..=i`; `i` must be below `len()`.
    #[inline]
    pub fn get(&mut self, i: usize) -> u64 {
        while self.ids.len() <= i {
            let parent = self.ids.last().copied().unwrap_or(ROOT);
            self.ids.push(extend(parent, self.local[self.ids.len()].0));
        }
        self.ids[i]
    }

    /// The ids of the prefixes `from..to`; `to` must not exceed `len()`.
    #[inline]
    pub fn ids(&mut self, from: usize, to: usize) -> &[u64] {
        if to > from {
            self.get(to - 1);
        }
        &self.ids[from..to]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inverse_recovers_the_local_hash() {
        for (p, l) in [(ROOT, 0u64), (ROOT, 7), (123, u64::MAX), (0xdead_beef, 42)] {
            assert_eq!(local_of(extend(p, l), p), l);
        }
        assert_eq!(M1.wrapping_mul(M1_INV), 1);
        assert_eq!(M2.wrapping_mul(M2_INV), 1);
        assert_ne!(extend(ROOT, 0), ROOT);
    }

    #[test]
    fn order_matters_and_chain_is_lazy() {
        let a = [LocalBlockHash(1), LocalBlockHash(2)];
        let b = [LocalBlockHash(2), LocalBlockHash(1)];
        let mut ca = PrefixChain::new(&a);
        let mut cb = PrefixChain::new(&b);
        assert_ne!(ca.get(1), cb.get(1));
        assert_eq!(ca.get(0), extend(ROOT, 1));
        assert_eq!(ca.get(1), extend(extend(ROOT, 1), 2));
    }
}

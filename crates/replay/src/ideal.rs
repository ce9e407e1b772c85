//! What a perfect router could reach: the hit rates of two ideal caches on the block sequence
//! the workers see.
//!
//! Every request's prompt is cut into full blocks of `block_size` tokens, each named by its
//! sequence hash (the same hashing the workers and the router use). Requests are taken in
//! arrival order (trace order among equal arrivals). A request's hits are its *leading* blocks
//! already cached — prefix semantics, counting stops at the first miss, as a prefix cache
//! can only reuse a prefix — and then all its blocks are inserted or refreshed.
//!
//! - *Unlimited*: one cache that never evicts (the reuse the trace holds at all).
//! - *Pooled LRU*: one cache holding the whole fleet's capacity (workers × dp ranks × blocks per
//!   rank), evicting the least recently used block. A request's blocks are refreshed tail first,
//!   so its prefix is more recent than its extensions, and tails go first, as engines evict.
//!
//! Hit rate = hits / prompt blocks (0 when there are no full blocks).

use crate::requests::ReplayRequest;
use kvrouter_protocol::hashing::{local_block_hashes, sequence_hashes};
use lru::LruCache;
use rustc_hash::{FxBuildHasher, FxHashSet};
use serde::Serialize;
use std::num::NonZeroUsize;

/// Hits of the two ideal caches over a whole trace.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Ideals {
    /// Full prompt blocks over all requests.
    pub prompt_blocks: u64,
    pub unlimited_hits: u64,
    pub pooled_hits: u64,
    pub unlimited_hit_rate: f64,
    pub pooled_hit_rate: f64,
    pub pooled_capacity_blocks: u64,
}

impl Ideals {
    /// Prompt tokens the pooled ideal has to prefill: its missed blocks × the block size.
    pub fn pooled_uncached_prompt_tokens(&self, block_size: usize) -> u64 {
        self.prompt_blocks.saturating_sub(self.pooled_hits) * block_size as u64
    }
}

/// The two ideals for `requests` at `block_size` (no blocks at all for block size 0).
pub fn ideal_hit_rates(
    requests: &[ReplayRequest],
    block_size: usize,
    pooled_capacity_blocks: usize,
) -> Ideals {
    let mut order: Vec<&ReplayRequest> = requests.iter().collect();
    order.sort_by_key(|r| (r.arrival, r.index));
    let blocks: Vec<Vec<u64>> = order
        .iter()
        .map(|r| {
            let local = local_block_hashes(&r.tokens, block_size, None).unwrap_or_default();
            sequence_hashes(&local).into_iter().map(|s| s.0).collect()
        })
        .collect();
    ideals_of_blocks(&blocks, pooled_capacity_blocks)
}

/// The two ideals over requests given as their blocks' names, in arrival order.
pub fn ideals_of_blocks(blocks: &[Vec<u64>], pooled_capacity_blocks: usize) -> Ideals {
    let prompt_blocks: u64 = blocks.iter().map(|b| b.len() as u64).sum();

    let mut seen: FxHashSet<u64> = FxHashSet::default();
    let mut unlimited_hits = 0u64;
    for req in blocks {
        unlimited_hits += req.iter().take_while(|b| seen.contains(*b)).count() as u64;
        seen.extend(req.iter().copied());
    }

    // A pool holding every distinct block never evicts: it is the unlimited cache. Capping
    // the capacity there keeps the LRU's allocation to what the trace needs.
    let pooled_hits = if pooled_capacity_blocks >= seen.len() {
        unlimited_hits
    } else {
        match NonZeroUsize::new(pooled_capacity_blocks) {
            None => 0,
            Some(cap) => {
                let mut lru: LruCache<u64, (), FxBuildHasher> =
                    LruCache::with_hasher(cap, FxBuildHasher);
                let mut hits = 0u64;
                for req in blocks {
                    hits += req.iter().take_while(|b| lru.contains(*b)).count() as u64;
                    for &b in req.iter().rev() {
                        lru.put(b, ());
                    }
                }
                hits
            }
        }
    };

    let rate = |hits: u64| {
        if prompt_blocks == 0 {
            0.0
        } else {
            hits as f64 / prompt_blocks as f64
        }
    };
    Ideals {
        prompt_blocks,
        unlimited_hits,
        pooled_hits,
        unlimited_hit_rate: rate(unlimited_hits),
        pooled_hit_rate: rate(pooled_hits),
        pooled_capacity_blocks: pooled_capacity_blocks as u64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn req(index: usize, arrival_ms: u64, tokens: &[u32]) -> ReplayRequest {
        ReplayRequest {
            index,
            arrival: Duration::from_millis(arrival_ms),
            tokens: tokens.to_vec(),
            output_tokens: 1,
        }
    }

    /// Tokens for blocks of 2 named by letters: block `c` is `[c, c]`.
    fn toks(blocks: &str) -> Vec<u32> {
        blocks.bytes().flat_map(|c| [c as u32, c as u32]).collect()
    }

    #[test]
    fn prefix_hits_stop_at_first_miss() {
        // A B C | A B D | A X C (C after X is a different block: its prefix differs)
        let reqs = [
            req(0, 0, &toks("ABC")),
            req(1, 1, &toks("ABD")),
            req(2, 2, &toks("AXC")),
        ];
        let ideal = ideal_hit_rates(&reqs, 2, 100);
        assert_eq!(ideal.prompt_blocks, 9);
        assert_eq!(ideal.unlimited_hits, 3); // 0 + 2 + 1
        assert_eq!(ideal.pooled_hits, 3);
        assert!((ideal.unlimited_hit_rate - 3.0 / 9.0).abs() < 1e-12);
    }

    #[test]
    fn partial_blocks_and_arrival_order() {
        // Given out of order: request 1 arrives first. Trailing partial block ignored.
        let mut late = toks("AB");
        late.push(9);
        let reqs = [req(0, 5, &late), req(1, 0, &toks("A"))];
        let ideal = ideal_hit_rates(&reqs, 2, 100);
        assert_eq!(ideal.prompt_blocks, 3);
        assert_eq!(ideal.unlimited_hits, 1);
    }

    #[test]
    fn pooled_lru_evicts_tails_first() {
        // Capacity 3 blocks.
        // r0: A B      -> miss 2; cache (MRU first) A B
        // r1: C D      -> miss 2; insert D then C: C D A (B evicted)
        // r2: A B      -> A hits, B missed: 1 hit; insert B, A: A B C (D evicted)
        // r3: C D      -> C hits, D missed: 1 hit
        // r4: A        -> hit 1
        let reqs = [
            req(0, 0, &toks("AB")),
            req(1, 1, &toks("CD")),
            req(2, 2, &toks("AB")),
            req(3, 3, &toks("CD")),
            req(4, 4, &toks("A")),
        ];
        let ideal = ideal_hit_rates(&reqs, 2, 3);
        assert_eq!(ideal.prompt_blocks, 9);
        assert_eq!(ideal.unlimited_hits, 5);
        assert_eq!(ideal.pooled_hits, 3);
        assert_eq!(ideal.pooled_capacity_blocks, 3);
        assert!((ideal.pooled_hit_rate - 3.0 / 9.0).abs() < 1e-12);
        assert_eq!(ideal.pooled_uncached_prompt_tokens(2), 12);

        // Enough room for every block: pooled = unlimited; no room: no hits.
        assert_eq!(ideal_hit_rates(&reqs, 2, 4).pooled_hits, 5);
        assert_eq!(ideal_hit_rates(&reqs, 2, 0).pooled_hits, 0);
    }

    #[test]
    fn request_longer_than_the_pool_keeps_its_head() {
        // Capacity 2: r0 A B C inserts C, B, A: B and A survive; r1 A B C hits A B.
        let reqs = [req(0, 0, &toks("ABC")), req(1, 1, &toks("ABC"))];
        let ideal = ideal_hit_rates(&reqs, 2, 2);
        assert_eq!(ideal.pooled_hits, 2);
        assert_eq!(ideal.unlimited_hits, 3);
    }

    #[test]
    fn zero_block_size_has_no_blocks() {
        let ideal = ideal_hit_rates(&[req(0, 0, &toks("AB"))], 0, 10);
        assert_eq!(ideal.prompt_blocks, 0);
        assert_eq!(ideal.unlimited_hit_rate, 0.0);
    }
}

//! The cost of sending a request to a worker key, and the choice among candidates.
//!
//! For a candidate key, with `request_blocks = ceil(prompt_tokens / block_size)`:
//!
//! ```text
//! credit         = overlap_credit * device overlap
//!                + host_cache_hit_weight * host extension
//!                + disk_cache_hit_weight * disk extension
//!                + shared_cache_hit_weight * shared-storage extension
//!                + active_prefix_credit * predicted extension
//! prefill_blocks = max(request_blocks - credit, 0)
//!                + min(in-flight prefill tokens on the key, prefill_queue_cap_tokens)
//!                  / block_size
//! decode_blocks  = active blocks on the key
//!                + the request's blocks (sequence hashes) not already active there
//! cost           = prefill_load_scale * prefill_blocks + decode_blocks
//! ```
//!
//! The predicted extension: leading prompt blocks past every cached tier that belong to a
//! request active on the key (routed there and not freed): cached there by the time this
//! request's prefill runs, though no KV event has said so yet.
//!
//! The cap (`prefill_queue_cap_tokens`, 0: none): past seconds of queued prefill on every
//! candidate, a shorter queue drains no sooner than the work a cached prefix saves, so queue
//! depth stops outweighing the cache (under overload, spreading off the cache holders loses
//! the hits that set throughput).
//!
//! Temperature 0: the lowest cost wins, ties broken uniformly at random. Temperature
//! `T > 0`: a key is drawn with probability ∝ `exp(-(cost / max_cost) / T)`.

use fastrand::Rng;
use kvrouter_protocol::TierBlocks;

/// The config values the formula uses.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct CostParams {
    pub block_size: u32,
    pub overlap_credit: f64,
    pub prefill_load_scale: f64,
    pub host_cache_hit_weight: f64,
    pub disk_cache_hit_weight: f64,
    pub shared_cache_hit_weight: f64,
    pub active_prefix_credit: f64,
    /// In-flight prefill tokens past this many count no more (0: no cap).
    pub prefill_queue_cap_tokens: u64,
}

impl CostParams {
    /// Prefill blocks a key's cached prefix saves: each tier's blocks at its weight.
    pub fn credit(&self, cached: &TierBlocks) -> f64 {
        self.overlap_credit * f64::from(cached.device)
            + self.host_cache_hit_weight * f64::from(cached.host)
            + self.disk_cache_hit_weight * f64::from(cached.disk)
            + self.shared_cache_hit_weight * f64::from(cached.shared)
    }

    /// `credit` plus the predicted blocks: of the `active_prefix` leading blocks active on
    /// the key, those past every cached tier, at `active_prefix_credit` each.
    pub fn credit_with_predicted(&self, cached: &TierBlocks, active_prefix: u32) -> f64 {
        let tiers = cached.device + cached.host + cached.disk + cached.shared;
        self.credit(cached)
            + self.active_prefix_credit * f64::from(active_prefix.saturating_sub(tiers))
    }
}

/// One key's cost, split into its parts.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct KeyCost {
    pub prefill_blocks: f64,
    pub decode_blocks: u64,
    pub cost: f64,
}

/// `ceil(prompt_tokens / block_size)`.
pub fn request_blocks(prompt_tokens: usize, block_size: u32) -> u64 {
    (prompt_tokens as u64).div_ceil(u64::from(block_size.max(1)))
}

/// Prefill tokens a request leaves on a key: its prompt minus the cached blocks.
pub fn uncached_prefill_tokens(prompt_tokens: usize, overlap_blocks: u32, block_size: u32) -> u64 {
    (prompt_tokens as u64).saturating_sub(u64::from(overlap_blocks) * u64::from(block_size))
}

/// The cost formula (see the module docs).
///
/// `cached` is the key's overlap by tier; `active_prefix` the request's leading blocks
/// active on the key; `new_blocks` is the number of the request's distinct blocks not
/// already active on the key; `active_blocks` and `inflight_prefill_tokens` are the key's
/// current load.
#[allow(clippy::too_many_arguments)]
pub fn key_cost(
    p: &CostParams,
    request_blocks: u64,
    cached: TierBlocks,
    active_prefix: u32,
    inflight_prefill_tokens: u64,
    active_blocks: u64,
    new_blocks: u64,
) -> KeyCost {
    let uncached =
        (request_blocks as f64 - p.credit_with_predicted(&cached, active_prefix)).max(0.0);
    let queued = match p.prefill_queue_cap_tokens {
        0 => inflight_prefill_tokens,
        cap => inflight_prefill_tokens.min(cap),
    };
    let prefill_blocks = uncached + queued as f64 / f64::from(p.block_size);
    let decode_blocks = active_blocks + new_blocks;
    KeyCost {
        prefill_blocks,
        decode_blocks,
        cost: p.prefill_load_scale * prefill_blocks + decode_blocks as f64,
    }
}

/// Picks an index in `0..n` given each index's cost: the cheapest (uniform among ties)
/// when `temperature` is 0, else softmax sampling. `weights` is reusable scratch.
pub fn choose(
    rng: &mut Rng,
    temperature: f64,
    n: usize,
    cost: impl Fn(usize) -> f64,
    weights: &mut Vec<f64>,
) -> Option<usize> {
    if n == 0 {
        None
    } else if temperature > 0.0 {
        Some(choose_softmax(rng, temperature, n, cost, weights))
    } else {
        Some(choose_min(rng, n, cost))
    }
}

/// Lowest cost, ties broken uniformly at random (reservoir sampling, no allocation).
fn choose_min(rng: &mut Rng, n: usize, cost: impl Fn(usize) -> f64) -> usize {
    let mut best = 0;
    let mut best_cost = cost(0);
    let mut tied = 1usize;
    for i in 1..n {
        let c = cost(i);
        if c < best_cost {
            best = i;
            best_cost = c;
            tied = 1;
        } else if c == best_cost {
            tied += 1;
            if rng.usize(..tied) == 0 {
                best = i;
            }
        }
    }
    best
}

/// Probability ∝ `exp(-(cost / max_cost) / T)`. Computed relative to the cheapest
/// candidate (same proportions, no underflow to an all-zero total); when every cost is 0
/// the draw is uniform.
fn choose_softmax(
    rng: &mut Rng,
    temperature: f64,
    n: usize,
    cost: impl Fn(usize) -> f64,
    weights: &mut Vec<f64>,
) -> usize {
    let (mut min, mut max) = (f64::INFINITY, f64::NEG_INFINITY);
    for i in 0..n {
        let c = cost(i);
        min = min.min(c);
        max = max.max(c);
    }
    if !max.is_finite() || max <= 0.0 {
        return rng.usize(..n);
    }
    weights.clear();
    let mut total = 0.0;
    for i in 0..n {
        let w = (-((cost(i) - min) / max) / temperature).exp();
        total += w;
        weights.push(w);
    }
    let mut r = rng.f64() * total;
    let mut last_positive = 0;
    for (i, &w) in weights.iter().enumerate() {
        if w > 0.0 {
            if r < w {
                return i;
            }
            r -= w;
            last_positive = i;
        }
    }
    // Rounding left `r` past the end: the last candidate with any weight.
    last_positive
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: CostParams = CostParams {
        block_size: 16,
        overlap_credit: 1.0,
        prefill_load_scale: 1.0,
        host_cache_hit_weight: 0.75,
        disk_cache_hit_weight: 0.25,
        shared_cache_hit_weight: 0.25,
        active_prefix_credit: 0.5,
        prefill_queue_cap_tokens: 0,
    };

    #[test]
    fn formula() {
        assert_eq!(request_blocks(0, 16), 0);
        assert_eq!(request_blocks(1, 16), 1);
        assert_eq!(request_blocks(32, 16), 2);
        assert_eq!(request_blocks(33, 16), 3);
        assert_eq!(uncached_prefill_tokens(40, 2, 16), 8);
        assert_eq!(uncached_prefill_tokens(40, 3, 16), 0);

        // 3 request blocks, 1 cached, 8 in-flight prefill tokens (0.5 block),
        // 10 active blocks, 2 new ones.
        let c = key_cost(&P, 3, TierBlocks::on_device(1), 0, 8, 10, 2);
        assert_eq!(c.prefill_blocks, 2.5);
        assert_eq!(c.decode_blocks, 12);
        assert_eq!(c.cost, 14.5);

        // Overlap credit cannot make prefill negative; scale weights prefill only.
        let p = CostParams {
            overlap_credit: 2.0,
            prefill_load_scale: 3.0,
            ..P
        };
        let c = key_cost(&p, 3, TierBlocks::on_device(2), 0, 16, 0, 0);
        assert_eq!(c.prefill_blocks, 1.0);
        assert_eq!(c.cost, 3.0);

        // Lower tiers earn their weights: 2 device + 4 host + 4 disk + 2 shared of 16 blocks.
        let cached = TierBlocks {
            device: 2,
            host: 4,
            disk: 4,
            shared: 2,
        };
        assert_eq!(P.credit(&cached), 2.0 + 3.0 + 1.0 + 0.5);
        let c = key_cost(&P, 16, cached, 0, 0, 0, 0);
        assert_eq!(c.prefill_blocks, 16.0 - 6.5);
        // A host hit is worth less than a device hit, more than none.
        let host = key_cost(
            &P,
            16,
            TierBlocks {
                host: 8,
                ..TierBlocks::default()
            },
            0,
            0,
            0,
            0,
        );
        let device = key_cost(&P, 16, TierBlocks::on_device(8), 0, 0, 0, 0);
        let none = key_cost(&P, 16, TierBlocks::default(), 0, 0, 0, 0);
        assert!(device.cost < host.cost && host.cost < none.cost);
    }

    #[test]
    fn predicted_blocks_count_past_the_cached_tiers() {
        // 16 blocks, 4 on the device, 10 leading blocks active on the key: 6 predicted at
        // 0.5 each.
        let c = key_cost(&P, 16, TierBlocks::on_device(4), 10, 0, 0, 0);
        assert_eq!(c.prefill_blocks, 16.0 - 4.0 - 3.0);
        // An active prefix inside the cached prefix adds nothing.
        let c = key_cost(&P, 16, TierBlocks::on_device(12), 10, 0, 0, 0);
        assert_eq!(c.prefill_blocks, 4.0);
        // Off: no credit.
        let p = CostParams {
            active_prefix_credit: 0.0,
            ..P
        };
        let c = key_cost(&p, 16, TierBlocks::default(), 10, 0, 0, 0);
        assert_eq!(c.prefill_blocks, 16.0);
    }

    #[test]
    fn queued_prefill_past_the_cap_stops_counting() {
        let p = CostParams {
            prefill_queue_cap_tokens: 160, // 10 blocks
            ..P
        };
        // Under the cap a queue counts whole; past it, only up to the cap.
        assert_eq!(
            key_cost(&p, 4, TierBlocks::default(), 0, 80, 0, 0).prefill_blocks,
            9.0
        );
        assert_eq!(
            key_cost(&p, 4, TierBlocks::default(), 0, 800, 0, 0).prefill_blocks,
            14.0
        );
        // Two backlogged keys: the one holding the prefix wins however deep its queue ...
        let holder = key_cost(&p, 4, TierBlocks::on_device(3), 0, 8000, 0, 0);
        let other = key_cost(&p, 4, TierBlocks::default(), 0, 400, 0, 0);
        assert!(holder.cost < other.cost);
        // ... while without the cap the shorter queue would.
        let holder = key_cost(&P, 4, TierBlocks::on_device(3), 0, 8000, 0, 0);
        let other = key_cost(&P, 4, TierBlocks::default(), 0, 400, 0, 0);
        assert!(holder.cost > other.cost);
        // A key under the cap still beats a backlogged holder by the difference.
        let idle = key_cost(&p, 4, TierBlocks::default(), 0, 0, 0, 0);
        let holder = key_cost(&p, 4, TierBlocks::on_device(3), 0, 8000, 0, 0);
        assert!(idle.cost < holder.cost);
    }

    #[test]
    fn min_wins_and_ties_are_uniform() {
        let mut rng = Rng::with_seed(7);
        let mut w = Vec::new();
        let costs = [3.0, 1.0, 2.0];
        for _ in 0..100 {
            assert_eq!(choose(&mut rng, 0.0, 3, |i| costs[i], &mut w), Some(1));
        }
        assert_eq!(choose(&mut rng, 0.0, 0, |_| 0.0, &mut w), None);

        let costs = [1.0, 5.0, 1.0, 1.0, 9.0, 1.0];
        let mut counts = [0u32; 6];
        for _ in 0..4000 {
            counts[choose(&mut rng, 0.0, 6, |i| costs[i], &mut w).unwrap()] += 1;
        }
        assert_eq!(counts[1] + counts[4], 0);
        for i in [0, 2, 3, 5] {
            assert!((800..1200).contains(&counts[i]), "{counts:?}");
        }
    }

    #[test]
    fn softmax_prefers_cheap_but_not_exclusively() {
        let mut rng = Rng::with_seed(11);
        let mut w = Vec::new();
        let costs = [10.0, 20.0, 40.0];
        let mut counts = [0u32; 3];
        for _ in 0..10_000 {
            counts[choose(&mut rng, 0.5, 3, |i| costs[i], &mut w).unwrap()] += 1;
        }
        assert!(counts[0] > counts[1] && counts[1] > counts[2], "{counts:?}");
        assert!(counts[2] > 0, "{counts:?}");
        // Expected ratio p0/p1 = exp(0.25 / 0.5) ≈ 1.65.
        let ratio = f64::from(counts[0]) / f64::from(counts[1]);
        assert!((1.4..1.9).contains(&ratio), "{ratio}");

        // All zero: uniform.
        let mut counts = [0u32; 4];
        for _ in 0..4000 {
            counts[choose(&mut rng, 1.0, 4, |_| 0.0, &mut w).unwrap()] += 1;
        }
        assert!(
            counts.iter().all(|&c| (800..1200).contains(&c)),
            "{counts:?}"
        );

        // Tiny temperature: effectively argmin, no NaN.
        for _ in 0..100 {
            assert_eq!(choose(&mut rng, 1e-300, 3, |i| costs[i], &mut w), Some(0));
        }
    }
}

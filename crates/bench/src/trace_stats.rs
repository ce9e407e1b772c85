//! `kvrouter bench trace-stats`: the shape of a Mooncake trace, so a generated trace can be
//! compared with a real one.

use crate::trace::TraceRequest;
use rustc_hash::{FxHashMap, FxHashSet};
use serde::Serialize;

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TraceStats {
    pub requests: usize,
    /// First to last timestamp.
    pub duration_mins: f64,
    pub prompt_blocks_mean: f64,
    pub prompt_blocks_median: usize,
    pub prompt_blocks_p90: usize,
    pub prompt_blocks_max: usize,
    pub prompt_blocks_total: u64,
    pub distinct_blocks: usize,
    /// Prompt blocks whose hash id an earlier request had: an unlimited cache's hit rate.
    pub seen_before_ratio: f64,
    /// Requests whose first block an earlier request had.
    pub prefix_reuse_requests: f64,
    pub input_tokens_mean: f64,
    pub output_tokens_mean: f64,
    pub distinct_first_blocks: usize,
    /// Share of requests starting with the most common first block (a shared system prompt).
    pub top_first_block_share: f64,
}

impl TraceStats {
    pub fn of<'a>(requests: impl IntoIterator<Item = &'a TraceRequest>) -> Self {
        let mut lens = Vec::new();
        let mut seen: FxHashSet<u64> = FxHashSet::default();
        let mut firsts: FxHashMap<u64, usize> = FxHashMap::default();
        let (mut hits, mut total, mut reuse) = (0u64, 0u64, 0usize);
        let (mut input, mut output) = (0u64, 0u64);
        let (mut t_min, mut t_max) = (u64::MAX, 0u64);
        for r in requests {
            lens.push(r.hash_ids.len());
            input += r.input_length;
            output += r.output_length;
            t_min = t_min.min(r.timestamp);
            t_max = t_max.max(r.timestamp);
            if let Some(&f) = r.hash_ids.first() {
                reuse += seen.contains(&f) as usize;
                *firsts.entry(f).or_default() += 1;
            }
            for h in &r.hash_ids {
                total += 1;
                hits += !seen.insert(*h) as u64;
            }
        }
        let n = lens.len();
        if n == 0 {
            return Self::default();
        }
        lens.sort_unstable();
        let nf = n as f64;
        let at = |p: f64| lens[((nf * p) as usize).min(n - 1)];
        Self {
            requests: n,
            duration_mins: (t_max - t_min) as f64 / 60_000.0,
            prompt_blocks_mean: total as f64 / nf,
            prompt_blocks_median: at(0.5),
            prompt_blocks_p90: at(0.9),
            prompt_blocks_max: lens[n - 1],
            prompt_blocks_total: total,
            distinct_blocks: seen.len(),
            seen_before_ratio: hits as f64 / (total.max(1)) as f64,
            prefix_reuse_requests: reuse as f64 / nf,
            input_tokens_mean: input as f64 / nf,
            output_tokens_mean: output as f64 / nf,
            distinct_first_blocks: firsts.len(),
            top_first_block_share: firsts.values().max().copied().unwrap_or(0) as f64 / nf,
        }
    }

    /// A few lines for people.
    pub fn render(&self) -> String {
        format!(
            "  requests       {} over {:.1} min ({:.2} requests/s)\n\
             \x20 prompt blocks  mean {:.1}, median {}, p90 {}, max {} (512 tokens each)\n\
             \x20 distinct       {} of {} prompt blocks; {:.1}% seen before (an unlimited cache's hit rate)\n\
             \x20 first blocks   {} distinct; the most common starts {:.1}% of requests; {:.1}% of requests start with a seen block\n\
             \x20 tokens         input mean {:.0}, output mean {:.0}\n",
            self.requests,
            self.duration_mins,
            self.requests as f64 / (self.duration_mins * 60.0).max(1e-9),
            self.prompt_blocks_mean,
            self.prompt_blocks_median,
            self.prompt_blocks_p90,
            self.prompt_blocks_max,
            self.distinct_blocks,
            self.prompt_blocks_total,
            100.0 * self.seen_before_ratio,
            self.distinct_first_blocks,
            100.0 * self.top_first_block_share,
            100.0 * self.prefix_reuse_requests,
            self.input_tokens_mean,
            self.output_tokens_mean,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(t: u64, ids: &[u64]) -> TraceRequest {
        TraceRequest {
            timestamp: t,
            input_length: ids.len() as u64 * 512,
            output_length: 10,
            hash_ids: ids.to_vec(),
        }
    }

    #[test]
    fn counts_against_a_hand_computed_trace() {
        let reqs = [
            req(0, &[0, 1, 2]),
            req(60_000, &[0, 1, 3, 4]),
            req(120_000, &[5]),
            req(180_000, &[0, 6]),
        ];
        let s = TraceStats::of(reqs.iter());
        assert_eq!(s.requests, 4);
        assert_eq!(s.duration_mins, 3.0);
        assert_eq!(s.prompt_blocks_total, 10);
        assert_eq!(s.prompt_blocks_mean, 2.5);
        assert_eq!(s.prompt_blocks_median, 3); // sorted 1, 2, 3, 4
        assert_eq!(s.prompt_blocks_max, 4);
        assert_eq!(s.distinct_blocks, 7);
        assert_eq!(s.seen_before_ratio, 0.3); // 0, 1 in request 2; 0 in request 4
        assert_eq!(s.prefix_reuse_requests, 0.5);
        assert_eq!(s.distinct_first_blocks, 2);
        assert_eq!(s.top_first_block_share, 0.75);
        assert_eq!(TraceStats::of([].iter()), TraceStats::default());
    }
}

//! Nearest-rank percentiles, shared by the route latency bench and the replay report.

/// Nearest-rank percentile of sorted samples: the smallest sample with at least a fraction
/// `q` of all samples at or below it. `None` for no samples.
pub fn percentile(sorted: &[u64], q: f64) -> Option<u64> {
    if sorted.is_empty() {
        return None;
    }
    let n = sorted.len();
    let rank = (q.clamp(0.0, 1.0) * n as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, n) - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&v, 0.50), Some(50));
        assert_eq!(percentile(&v, 0.99), Some(99));
        assert_eq!(percentile(&v, 0.999), Some(100));
        assert_eq!(percentile(&v, 1.0), Some(100));
        assert_eq!(percentile(&v, 0.0), Some(1));
        assert_eq!(percentile(&[], 0.5), None);
        assert_eq!(percentile(&[7], 0.999), Some(7));
        let v: Vec<u64> = (1..=1000).collect();
        assert_eq!(percentile(&v, 0.999), Some(999));
        assert_eq!(percentile(&v, 0.99), Some(990));
        let v: Vec<u64> = (1..=10_000).collect();
        assert_eq!(percentile(&v, 0.999), Some(9990));
        // Two samples: the median is the lower one.
        assert_eq!(percentile(&[10, 20], 0.5), Some(10));
        assert_eq!(percentile(&[10, 20], 0.51), Some(20));
    }
}

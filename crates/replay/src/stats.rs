//! The statistics every bench reports: nearest-rank percentiles of samples, and the
//! min/median/max of a figure over repeated runs.

use serde::Serialize;

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

/// Min, median and max of one figure over runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Spread {
    pub min: f64,
    pub median: f64,
    pub max: f64,
}

impl Spread {
    /// Over the finite values (NaN and infinities are left out); `None` when there are none.
    /// The median of an even count is the mean of the two middle values.
    pub fn of(values: impl IntoIterator<Item = f64>) -> Option<Self> {
        let mut v: Vec<f64> = values.into_iter().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Some(Self {
            min: v[0],
            median,
            max: v[n - 1],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_of_odd_even_and_non_finite_runs() {
        let s = |v: &[f64]| Spread::of(v.iter().copied());
        assert_eq!(s(&[]), None);
        assert_eq!(s(&[f64::NAN, f64::INFINITY]), None);
        let one = Spread {
            min: 3.0,
            median: 3.0,
            max: 3.0,
        };
        assert_eq!(s(&[3.0]), Some(one));
        let odd = Spread {
            min: 1.0,
            median: 2.0,
            max: 9.0,
        };
        assert_eq!(s(&[9.0, 1.0, 2.0]), Some(odd));
        let even = Spread {
            min: 1.0,
            median: 2.5,
            max: 9.0,
        };
        assert_eq!(s(&[9.0, f64::NAN, 2.0, 1.0, 3.0]), Some(even));
    }

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

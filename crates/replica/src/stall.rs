//! Noticing that this process was stalled (SIGSTOPped, frozen, starved of CPU) for longer
//! than callers wait for an answer.
//!
//! Requests that piled up in the socket meanwhile are read at once when the process runs
//! again, long after their callers gave up and asked another replica: routed, they would book
//! load nobody frees. So for a moment after such a stall the replica turns routes away
//! (`unavailable`: the client asks another replica) instead of booking them. It runs on the
//! runtime's clock (`crate::clock`), so a replay's virtual time never looks like a stall.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A stall longer than the client library's route timeout (2 s): whatever waited through it
/// has been given up on.
pub const STALL_THRESHOLD: Duration = Duration::from_secs(2);
/// How long after a stall is noticed routes are still turned away (the backlog is read within
/// it).
const AFTER_STALL: Duration = Duration::from_millis(250);

/// The last watchdog tick and the last stall, read without locks by every route.
pub struct StallWatch {
    base: Instant,
    /// Milliseconds since `base` of the last tick.
    last_tick: AtomicU64,
    /// Milliseconds since `base` when the last stall was noticed (0: never), and its length.
    stall_seen: AtomicU64,
    stall_ms: AtomicU64,
}

impl StallWatch {
    pub fn new(now: Instant) -> Self {
        Self {
            base: now,
            last_tick: AtomicU64::new(0),
            stall_seen: AtomicU64::new(0),
            stall_ms: AtomicU64::new(0),
        }
    }

    fn ms(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.base).as_millis() as u64
    }

    /// The watchdog's tick (every 100 ms or so): returns the stall it ends, if any.
    pub fn tick(&self, now: Instant) -> Option<Duration> {
        let now_ms = self.ms(now);
        let gap = now_ms.saturating_sub(self.last_tick.swap(now_ms, Ordering::Relaxed));
        (gap > STALL_THRESHOLD.as_millis() as u64).then(|| {
            self.stall_ms.store(gap, Ordering::Relaxed);
            self.stall_seen.store(now_ms.max(1), Ordering::Relaxed);
            Duration::from_millis(gap)
        })
    }

    /// `Some(stall)` while requests read now may have waited through a stall: the watchdog
    /// has not run for longer than the threshold (the process just woke, before it), or it
    /// noticed a stall a moment ago.
    pub fn stalled(&self, now: Instant) -> Option<Duration> {
        let now_ms = self.ms(now);
        let since_tick = now_ms.saturating_sub(self.last_tick.load(Ordering::Relaxed));
        if since_tick > STALL_THRESHOLD.as_millis() as u64 {
            return Some(Duration::from_millis(since_tick));
        }
        let seen = self.stall_seen.load(Ordering::Relaxed);
        (seen > 0 && now_ms.saturating_sub(seen) < AFTER_STALL.as_millis() as u64)
            .then(|| Duration::from_millis(self.stall_ms.load(Ordering::Relaxed)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stall_longer_than_the_threshold_turns_routes_away_for_a_moment() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let w = StallWatch::new(t0);
        // Ticking along: never stalled, even with a slow tick.
        for ms in (100..=3000).step_by(100) {
            assert_eq!(w.tick(at(ms)), None);
            assert_eq!(w.stalled(at(ms + 50)), None);
        }
        assert_eq!(w.tick(at(4500)), None, "1.5 s is within what callers wait");
        // Stopped for 5 s: a route read before the watchdog runs again is turned away...
        assert_eq!(w.stalled(at(9500)), Some(Duration::from_millis(5000)));
        // ... and so are those read just after it noticed.
        assert_eq!(w.tick(at(9510)), Some(Duration::from_millis(5010)));
        assert_eq!(w.stalled(at(9600)), Some(Duration::from_millis(5010)));
        assert_eq!(w.tick(at(9610)), None);
        assert_eq!(w.stalled(at(9800)), None, "the backlog is behind us");
    }
}

//! Whether a rank's KV events have gone quiet while its engine is busy: a plain core, fed
//! each load scrape with what it shows (requests running, batches received so far).
//!
//! An idle engine publishes nothing, and rightly; an engine running requests stores new
//! blocks as it decodes, so minutes of running requests without one batch mean the events
//! go somewhere else: the engine connecting where it should bind, another topic, another
//! rank's port, events not enabled. Nothing else shows that: the router just routes
//! without affinity.

use std::time::{Duration, Instant};

/// One rank's watch.
#[derive(Debug, Clone)]
struct Rank {
    /// Batches received when last scraped.
    batches: u64,
    /// When the last batch was seen (or the watch started).
    last_batch: Instant,
    /// Since the last batch, the first scrape that showed the engine busy.
    busy_since: Option<Instant>,
    silent: bool,
}

/// What a scrape changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SilenceChange {
    /// The rank has been busy for the whole window without a batch: it just became silent.
    Silent { for_secs: u64 },
    /// A silent rank's batches arrive again.
    Resumed,
}

/// Every rank's watch.
#[derive(Debug, Clone)]
pub struct EventSilence {
    ranks: Vec<Rank>,
    after: Duration,
}

impl EventSilence {
    /// `ranks` ranks, silent once busy for `after` without a batch.
    pub fn new(ranks: usize, after: Duration, now: Instant) -> Self {
        Self {
            ranks: vec![
                Rank {
                    batches: 0,
                    last_batch: now,
                    busy_since: None,
                    silent: false,
                };
                ranks
            ],
            after,
        }
    }

    /// A scrape of rank `slot`: `batches` received so far, whether the engine runs requests
    /// on it.
    pub fn scrape(
        &mut self,
        slot: usize,
        batches: u64,
        busy: bool,
        now: Instant,
    ) -> Option<SilenceChange> {
        let after = self.after;
        let r = self.ranks.get_mut(slot)?;
        if batches != r.batches {
            r.batches = batches;
            r.last_batch = now;
            r.busy_since = None;
            return std::mem::take(&mut r.silent).then_some(SilenceChange::Resumed);
        }
        if !busy {
            return None;
        }
        let since = *r.busy_since.get_or_insert(now);
        if !r.silent && now.duration_since(since) >= after {
            r.silent = true;
            let for_secs = now.duration_since(r.last_batch).as_secs();
            return Some(SilenceChange::Silent { for_secs });
        }
        None
    }

    /// Time since rank `slot`'s last batch (since the watch started if none came).
    pub fn since_last_batch(&self, slot: usize, now: Instant) -> Duration {
        self.ranks
            .get(slot)
            .map_or(Duration::ZERO, |r| now.duration_since(r.last_batch))
    }

    pub fn is_silent(&self, slot: usize) -> bool {
        self.ranks.get(slot).is_some_and(|r| r.silent)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn busy_without_batches_for_the_window_is_silent_once() {
        let t0 = Instant::now();
        let mut w = EventSilence::new(2, 10 * S, t0);
        // Idle for a long time: nothing to say.
        assert_eq!(w.scrape(0, 0, false, t0 + 100 * S), None);
        // Busy from 100 s on: silent at 110 s, said once.
        assert_eq!(w.scrape(0, 0, true, t0 + 100 * S), None);
        assert_eq!(w.scrape(0, 0, true, t0 + 109 * S), None);
        assert_eq!(
            w.scrape(0, 0, true, t0 + 110 * S),
            Some(SilenceChange::Silent { for_secs: 110 })
        );
        assert!(w.is_silent(0));
        assert_eq!(w.scrape(0, 0, true, t0 + 200 * S), None);
        assert_eq!(w.since_last_batch(0, t0 + 200 * S), 200 * S);
        // The other rank is its own.
        assert!(!w.is_silent(1));
        // A batch: resumed, said once, and the clock starts again.
        assert_eq!(
            w.scrape(0, 3, true, t0 + 201 * S),
            Some(SilenceChange::Resumed)
        );
        assert_eq!(w.scrape(0, 3, true, t0 + 202 * S), None);
        assert_eq!(w.since_last_batch(0, t0 + 202 * S), S);
        assert!(!w.is_silent(0));
        assert_eq!(w.scrape(0, 3, true, t0 + 211 * S), None);
        assert_eq!(
            w.scrape(0, 3, true, t0 + 212 * S),
            Some(SilenceChange::Silent { for_secs: 11 })
        );
    }

    #[test]
    fn batches_while_busy_keep_it_quiet() {
        let t0 = Instant::now();
        let mut w = EventSilence::new(1, 10 * S, t0);
        for i in 0..100u64 {
            assert_eq!(w.scrape(0, i / 5, true, t0 + S * i as u32), None, "{i}");
        }
        assert_eq!(w.scrape(7, 0, true, t0), None, "no such rank");
    }
}

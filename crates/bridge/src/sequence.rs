//! The sequence numbers of one rank's ZMQ stream: in order, a gap (batches lost), or a
//! restart (the engine process started again and counts from 0).

/// What one sequence number means after the ones before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqStep {
    /// The first one seen since the bridge (re)connected: never a gap.
    First,
    /// The one after the last.
    Next,
    /// Batches `missing.0 .. missing.1` were lost (this one is `missing.1`).
    Gap { from: u64, to: u64 },
    /// Not above the last one: the engine restarted.
    Restart,
}

#[derive(Debug, Default, Clone)]
pub struct SeqTracker {
    last: Option<u64>,
    /// The last batch applied: its number and a digest of its payload.
    applied: Option<(u64, u64)>,
}

impl SeqTracker {
    pub fn observe(&mut self, seq: u64) -> SeqStep {
        let step = match self.last {
            None => SeqStep::First,
            Some(last) if seq == last.wrapping_add(1) => SeqStep::Next,
            Some(last) if seq > last => SeqStep::Gap {
                from: last + 1,
                to: seq,
            },
            Some(_) => SeqStep::Restart,
        };
        self.last = Some(seq);
        step
    }

    /// Forget the stream (a reconnect): the next number is a `First`.
    pub fn reset(&mut self) {
        self.last = None;
        self.applied = None;
    }

    /// Batch `seq` with this payload was applied.
    pub fn applied(&mut self, seq: u64, payload: &[u8]) {
        self.applied = Some((seq, xxhash_rust::xxh3::xxh3_64(payload)));
    }

    /// What a replay endpoint sent for "every batch from the last applied one on" (numbers
    /// and payloads, in the order they came) says about the publisher behind a new
    /// connection: a publisher that still holds that batch holds it unchanged; a new process
    /// has other payloads under those numbers, or none that high yet.
    pub fn rejoined<'a>(&self, got: impl IntoIterator<Item = (u64, &'a [u8])>) -> Rejoined {
        let Some((last, digest)) = self.applied else {
            return Rejoined::Unknown;
        };
        for (s, payload) in got {
            if s < last {
                continue;
            }
            if s > last {
                // The buffer rolled past it: nothing to compare.
                return Rejoined::Unknown;
            }
            return if xxhash_rust::xxh3::xxh3_64(payload) == digest {
                Rejoined::Same
            } else {
                Rejoined::Restarted
            };
        }
        Rejoined::Restarted
    }

    /// The last number seen (or caught up to).
    pub fn last(&self) -> Option<u64> {
        self.last
    }

    /// Batches up to `seq` were had another way (a catch-up replay): the stream goes on
    /// after it.
    pub fn caught_up_to(&mut self, seq: u64) {
        self.last = Some(seq);
    }
}

/// Who publishes behind a connection made again (see [`SeqTracker::rejoined`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejoined {
    /// The publisher seen before: its stream goes on after the last batch applied.
    Same,
    /// A new process counting from 0 (the engine, or its rank, restarted).
    Restarted,
    /// Cannot tell (nothing applied yet, or the replay buffer no longer holds it).
    Unknown,
}

/// What a catch-up replay holds: the sequence numbers a replay endpoint sent for "every
/// batch from `from` on", in the order they came. `Some((first, last))`: the run of
/// consecutive numbers from the first at or above `from` (`first > from`: the endpoint no
/// longer holds `from .. first`; they are lost); `None`: nothing at or above `from`.
pub fn catch_up_run(from: u64, seqs: impl IntoIterator<Item = u64>) -> Option<(u64, u64)> {
    let mut run: Option<(u64, u64)> = None;
    for s in seqs {
        if s < from {
            continue;
        }
        match run {
            None => run = Some((s, s)),
            Some((first, last)) if s == last.wrapping_add(1) => run = Some((first, s)),
            Some(_) => break,
        }
    }
    run
}

/// Whether replayed sequence numbers (in the order they came) hold exactly `from .. to`.
pub fn replay_covers(from: u64, to: u64, seqs: impl IntoIterator<Item = u64>) -> bool {
    let mut want = from;
    for s in seqs {
        if s < want {
            continue; // older than the gap: already applied
        }
        if s != want || want >= to {
            return want >= to;
        }
        want += 1;
    }
    want >= to
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps() {
        let mut t = SeqTracker::default();
        assert_eq!(t.observe(7), SeqStep::First);
        assert_eq!(t.observe(8), SeqStep::Next);
        assert_eq!(t.observe(11), SeqStep::Gap { from: 9, to: 11 });
        assert_eq!(t.observe(12), SeqStep::Next);
        assert_eq!(t.observe(0), SeqStep::Restart);
        assert_eq!(t.observe(1), SeqStep::Next);
        assert_eq!(t.observe(1), SeqStep::Restart);
        t.reset();
        assert_eq!(t.observe(40), SeqStep::First);
    }

    /// A reconnection to the same publisher finds the last batch applied unchanged; a
    /// restarted one has another payload under that number, or no number that high; a
    /// buffer that rolled past it cannot tell.
    #[test]
    fn a_rejoined_publisher_is_told_by_its_last_batch() {
        let mut t = SeqTracker::default();
        let got = |v: &[(u64, &'static [u8])]| v.to_vec();
        assert_eq!(t.rejoined(got(&[(3, b"c")])), Rejoined::Unknown);
        t.observe(3);
        t.applied(3, b"c");
        assert_eq!(t.rejoined(got(&[(3, b"c"), (4, b"d")])), Rejoined::Same);
        assert_eq!(t.rejoined(got(&[(2, b"x"), (3, b"c")])), Rejoined::Same);
        assert_eq!(
            t.rejoined(got(&[(3, b"C"), (4, b"d")])),
            Rejoined::Restarted
        );
        assert_eq!(
            t.rejoined(got(&[(0, b"a"), (1, b"b")])),
            Rejoined::Restarted
        );
        assert_eq!(t.rejoined(got(&[])), Rejoined::Restarted);
        assert_eq!(t.rejoined(got(&[(5, b"e")])), Rejoined::Unknown);
        t.reset();
        assert_eq!(t.rejoined(got(&[(3, b"C")])), Rejoined::Unknown);
    }

    #[test]
    fn catch_up_takes_the_leading_run_of_consecutive_numbers() {
        assert_eq!(catch_up_run(0, []), None);
        assert_eq!(catch_up_run(0, [0, 1, 2]), Some((0, 2)));
        // The buffer rolled over: 0..5 are lost, 5..=7 are had.
        assert_eq!(catch_up_run(0, [5, 6, 7]), Some((5, 7)));
        // Older ones are skipped, a hole ends the run.
        assert_eq!(catch_up_run(3, [1, 2, 3, 4, 6, 7]), Some((3, 4)));
        assert_eq!(catch_up_run(9, [1, 2, 3]), None);
        let mut t = SeqTracker::default();
        t.caught_up_to(4);
        assert_eq!(t.last(), Some(4));
        assert_eq!(t.observe(5), SeqStep::Next);
    }

    #[test]
    fn replay_coverage() {
        assert!(replay_covers(3, 6, [1, 2, 3, 4, 5, 6, 7]));
        assert!(replay_covers(3, 6, [3, 4, 5]));
        assert!(replay_covers(3, 3, []));
        assert!(!replay_covers(3, 6, [4, 5, 6])); // the buffer no longer holds 3
        assert!(!replay_covers(3, 6, [3, 5]));
        assert!(!replay_covers(3, 6, []));
    }
}

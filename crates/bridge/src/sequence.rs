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
    }
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

//! Peer echo: the load synced peers are probably adding right now, guessed from our own
//! decisions.
//!
//! With replica sync every replica routes on one shared view, and a peer's decision reaches
//! the others only after it was made. Replicas routing one burst of arrivals at the same
//! moment therefore see the same costs and pile onto the same keys: each sees only its own
//! share of the burst. So for a short window after each decision, this replica counts the
//! decision once more per live peer, as if each peer had just sent a like request to the
//! same key. By the time the window closes, the peers' real decisions have arrived through
//! sync and the guess is dropped.
//!
//! Replicas routing one burst also decide at the same moment on the same view, so left
//! alone they would all take the same best key for their next requests; while a burst is
//! under way each replica therefore first charges the picks of the peers ahead of it in
//! their common order (see `Scheduler::charge_peers_first`), and they fan out.
//!
//! The guesses only steer the cost; busy thresholds, potential loads, metrics and peers see
//! tracked load alone.

use crate::active::Slot;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Guessed extra load on one key.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct EchoLoad {
    pub blocks: u64,
    pub prefill_tokens: u64,
}

#[derive(Debug, Default)]
pub(crate) struct PeerEcho {
    peers: u32,
    /// Live peers before this replica in the replicas' common order.
    ahead: u32,
    window: Duration,
    by_slot: Vec<EchoLoad>,
    /// (expiry, slot, load), in expiry order while the window is unchanged.
    pending: VecDeque<(Instant, Slot, EchoLoad)>,
}

impl PeerEcho {
    pub fn set(&mut self, peers: u32, ahead: u32, window: Duration) {
        self.peers = peers;
        self.ahead = ahead.min(peers);
        self.window = window;
    }

    /// Peers whose simultaneous decisions this one should assume were made first: those
    /// ahead of it, while a burst is under way (one of our guesses is still standing).
    pub fn peers_first(&self) -> u32 {
        if self.pending.is_empty() {
            0
        } else {
            self.ahead
        }
    }

    fn is_on(&self) -> bool {
        self.peers > 0 && !self.window.is_zero()
    }

    /// One of our decisions added `blocks` new active blocks and `prefill_tokens` to `slot`.
    pub fn record(&mut self, slot: Slot, blocks: u64, prefill_tokens: u64, now: Instant) {
        if !self.is_on() {
            return;
        }
        let peers = u64::from(self.peers);
        let load = EchoLoad {
            blocks: blocks.saturating_mul(peers),
            prefill_tokens: prefill_tokens.saturating_mul(peers),
        };
        let i = slot as usize;
        if self.by_slot.len() <= i {
            self.by_slot.resize(i + 1, EchoLoad::default());
        }
        let s = &mut self.by_slot[i];
        s.blocks = s.blocks.saturating_add(load.blocks);
        s.prefill_tokens = s.prefill_tokens.saturating_add(load.prefill_tokens);
        self.pending.push_back((now + self.window, slot, load));
    }

    /// Drops the guesses whose window has closed.
    pub fn expire(&mut self, now: Instant) {
        while let Some(&(until, slot, load)) = self.pending.front() {
            if until > now {
                break;
            }
            self.pending.pop_front();
            if let Some(s) = self.by_slot.get_mut(slot as usize) {
                s.blocks = s.blocks.saturating_sub(load.blocks);
                s.prefill_tokens = s.prefill_tokens.saturating_sub(load.prefill_tokens);
            }
        }
    }

    pub fn load(&self, slot: Slot) -> EchoLoad {
        self.by_slot.get(slot as usize).copied().unwrap_or_default()
    }

    /// The key of `slot` left (the slot may be reused by another key).
    pub fn clear_slot(&mut self, slot: Slot) {
        if let Some(s) = self.by_slot.get_mut(slot as usize) {
            *s = EchoLoad::default();
        }
        self.pending.retain(|&(_, s, _)| s != slot);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_once_per_peer_until_the_window_closes() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut e = PeerEcho::default();
        e.record(0, 5, 100, t0);
        assert_eq!(e.load(0), EchoLoad::default(), "off without peers");
        e.set(2, 1, Duration::ZERO);
        e.record(0, 5, 100, t0);
        assert_eq!(e.load(0), EchoLoad::default(), "off with a zero window");

        e.set(2, 1, ms(10));
        assert_eq!(e.peers_first(), 0, "no burst yet");
        e.record(0, 5, 100, t0);
        assert_eq!(e.peers_first(), 1);
        e.record(1, 1, 0, t0 + ms(4));
        e.record(0, 2, 10, t0 + ms(6));
        assert_eq!(
            e.load(0),
            EchoLoad {
                blocks: 14,
                prefill_tokens: 220
            }
        );
        e.expire(t0 + ms(9));
        assert_eq!(e.load(0).blocks, 14);
        e.expire(t0 + ms(10));
        assert_eq!(
            e.load(0),
            EchoLoad {
                blocks: 4,
                prefill_tokens: 20
            }
        );
        assert_eq!(e.load(1).blocks, 2);
        e.clear_slot(1);
        assert_eq!(e.load(1), EchoLoad::default());
        e.expire(t0 + ms(16));
        assert_eq!(e.load(0), EchoLoad::default());
        assert_eq!(e.peers_first(), 0, "the burst is over");
        assert_eq!(e.load(7), EchoLoad::default());
        assert!(e.pending.is_empty());
    }
}

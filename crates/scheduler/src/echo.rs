//! Peer echo: the load synced peers are probably adding right now, guessed from our own
//! decisions.
//!
//! With replica sync, every replica routes on one shared view, and a peer's decision reaches
//! the others only after it was made. Peers deciding at the same moment (a burst of
//! arrivals spread over the replicas) therefore make the same choices and pile onto the
//! same keys. So each decision is taken as one turn of a round: every live replica, in
//! replica-id order, places a request like this one; the turns before ours and after ours
//! are the peers' guessed picks (each on the view the turns before it left), ours is real.
//! The peers' picks count as load for a short window; by the time it closes their real
//! decisions have arrived through sync. Replicas in a burst thus spread like one router
//! placing the burst in turn, and the first picks of a burst no longer collide.
//!
//! The guess only steers the cost; busy thresholds, metrics and peers see tracked load alone.

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
    /// Live peers ranked before and after this replica.
    pub before: u32,
    pub after: u32,
    window: Duration,
    by_slot: Vec<EchoLoad>,
    /// (expiry, slot, load), in expiry order while the window is unchanged.
    pending: VecDeque<(Instant, Slot, EchoLoad)>,
}

impl PeerEcho {
    pub fn set(&mut self, before: u32, after: u32, window: Duration) {
        self.before = before;
        self.after = after;
        self.window = window;
    }

    pub fn window(&self) -> Duration {
        self.window
    }

    pub fn is_on(&self) -> bool {
        self.before + self.after > 0 && !self.window.is_zero()
    }

    /// A peer's guessed pick adds `blocks` new active blocks and `prefill_tokens` to `slot`.
    pub fn record(&mut self, slot: Slot, blocks: u64, prefill_tokens: u64, now: Instant) {
        let load = EchoLoad {
            blocks,
            prefill_tokens,
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
        if self.pending.len() < std::env::var("KVR_ECHO_MIN").ok().and_then(|v| v.parse().ok()).unwrap_or(1) {
            return EchoLoad::default();
        }
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
    fn guesses_count_until_the_window_closes() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut e = PeerEcho::default();
        assert!(!e.is_on());
        e.set(0, 2, ms(10));
        assert!(e.is_on());
        e.record(0, 5, 100, t0);
        e.record(1, 1, 0, t0 + ms(4));
        e.record(0, 2, 10, t0 + ms(6));
        assert_eq!(
            e.load(0),
            EchoLoad {
                blocks: 7,
                prefill_tokens: 110
            }
        );
        e.expire(t0 + ms(10));
        assert_eq!(
            e.load(0),
            EchoLoad {
                blocks: 2,
                prefill_tokens: 10
            }
        );
        assert_eq!(e.load(1).blocks, 1);
        e.clear_slot(1);
        assert_eq!(e.load(1), EchoLoad::default());
        e.expire(t0 + ms(16));
        assert_eq!(e.load(0), EchoLoad::default());
        assert_eq!(e.load(7), EchoLoad::default());
        assert!(e.pending.is_empty());
    }
}

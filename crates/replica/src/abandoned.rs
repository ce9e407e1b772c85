//! Route calls their callers abandoned ([`kvrouter_protocol::Abandon`]): a caller that asked
//! more than one replica keeps the answer it got, and a copy of the call that reaches this
//! replica later (it was stopped, or its socket backed up) must not book load nobody frees.
//!
//! Remembered for [`KEEP`] by (request id, call id, lease): a new call for the same request id
//! (a frontend routing again around a failed worker) has a new call id and is not turned
//! away, and an abandon under another lease than the call's (not its caller's) turns nothing
//! away.

use kvrouter_protocol::Lease;
use rustc_hash::FxHashMap;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// How long an abandoned call is remembered: far longer than a copy of it can wait in a
/// replica's socket before the stall watch turns it away anyway.
pub const KEEP: Duration = Duration::from_secs(60);
/// At most this many are remembered (the oldest go first): abandons are rare, a flood of
/// them must not grow memory.
const MAX: usize = 1 << 16;
/// And at most this many bytes of request ids (plus [`ENTRY_OVERHEAD`] each): 65,536
/// calls of short ids fit, but of ids of the protocol's longest (256 bytes) about 26,000,
/// so a flood of long ids keeps fewer calls. Ids over the protocol's limit are not remembered (replicas refuse
/// such routes anyway).
pub const MAX_BYTES: usize = 8 << 20;
/// What one remembered call costs besides its id's bytes, about (map and queue entries).
const ENTRY_OVERHEAD: usize = 64;

/// Keyed by call id (random, so unique in practice) and lease, with the request id it
/// belongs to: the lookup on every route allocates nothing, and a forged abandon (another
/// lease) neither matches nor displaces the genuine one.
#[derive(Default)]
pub struct Abandoned {
    calls: FxHashMap<(u64, Lease), String>,
    order: VecDeque<(Instant, (u64, Lease))>,
    /// Bytes held: ids plus [`ENTRY_OVERHEAD`] each.
    bytes: usize,
}

impl Abandoned {
    /// Remembers call `call_id` of `request_id`, made under `lease`, as abandoned (call id 0
    /// names no call).
    pub fn insert(&mut self, request_id: &str, call_id: u64, lease: Lease, now: Instant) {
        self.expire(now);
        let call = (call_id, lease);
        if call_id == 0
            || self.calls.contains_key(&call)
            || request_id.len() > kvrouter_protocol::limits::MAX_REQUEST_ID_BYTES
        {
            return;
        }
        let cost = request_id.len() + ENTRY_OVERHEAD;
        while self.order.len() >= MAX || (self.bytes + cost > MAX_BYTES && !self.order.is_empty()) {
            self.pop_oldest();
        }
        self.calls.insert(call, request_id.to_string());
        self.order.push_back((now, call));
        self.bytes += cost;
    }

    fn pop_oldest(&mut self) {
        if let Some((_, call)) = self.order.pop_front() {
            if let Some(id) = self.calls.remove(&call) {
                self.bytes -= id.len() + ENTRY_OVERHEAD;
            }
        }
    }

    /// Whether this call, made under `lease`, was abandoned (within [`KEEP`]).
    pub fn contains(&mut self, request_id: &str, call_id: u64, lease: Lease, now: Instant) -> bool {
        if call_id == 0 || self.calls.is_empty() {
            return false;
        }
        self.expire(now);
        self.calls
            .get(&(call_id, lease))
            .is_some_and(|id| id == request_id)
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.calls.len()
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }

    fn expire(&mut self, now: Instant) {
        while let Some(&(at, _)) = self.order.front() {
            if now.saturating_duration_since(at) < KEEP {
                break;
            }
            self.pop_oldest();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const L: Lease = Lease::NONE;

    #[test]
    fn remembers_the_call_not_the_request_and_forgets_after_keep() {
        let t0 = Instant::now();
        let mut a = Abandoned::default();
        a.insert("r1", 7, L, t0);
        assert!(a.contains("r1", 7, L, t0 + Duration::from_secs(1)));
        // Another call for the same request, another request, no call id: not abandoned.
        assert!(!a.contains("r1", 8, L, t0));
        assert!(!a.contains("r2", 7, L, t0));
        a.insert("r3", 0, L, t0);
        assert!(!a.contains("r3", 0, L, t0));
        assert_eq!(a.len(), 1);
        assert!(!a.contains("r1", 7, L, t0 + KEEP));
        assert!(a.is_empty());
    }

    /// Only an abandon under the call's own lease turns its late copy away, and a forged one
    /// (another lease, same call id) does not keep the genuine one out.
    #[test]
    fn an_abandon_under_another_lease_turns_nothing_away() {
        let t0 = Instant::now();
        let mut a = Abandoned::default();
        let (mine, forged) = (Lease::random(), Lease::random());
        a.insert("r1", 7, forged, t0);
        assert!(!a.contains("r1", 7, mine, t0));
        a.insert("r1", 7, mine, t0);
        assert!(a.contains("r1", 7, mine, t0));
        assert_eq!(a.len(), 2);
    }

    #[test]
    fn holds_at_most_max_dropping_the_oldest() {
        let t0 = Instant::now();
        let mut a = Abandoned::default();
        for i in 0..(MAX as u64 + 10) {
            a.insert(&format!("r{i}"), i + 1, L, t0);
        }
        assert_eq!(a.len(), MAX);
        assert_eq!(a.order.len(), MAX);
        assert!(!a.contains("r0", 1, L, t0));
        assert!(a.contains(&format!("r{}", MAX + 9), MAX as u64 + 10, L, t0));
        assert!(a.bytes <= MAX_BYTES);
    }

    #[test]
    fn holds_at_most_max_bytes_of_ids() {
        let t0 = Instant::now();
        let mut a = Abandoned::default();
        let long = "x".repeat(kvrouter_protocol::limits::MAX_REQUEST_ID_BYTES);
        for i in 0..(MAX as u64) {
            a.insert(&format!("{long}{i}")[..long.len()], i + 1, L, t0);
            assert!(a.bytes <= MAX_BYTES);
        }
        assert_eq!(a.len(), MAX_BYTES / (long.len() + ENTRY_OVERHEAD));
        assert_eq!(
            a.bytes,
            a.calls
                .values()
                .map(|id| id.len() + ENTRY_OVERHEAD)
                .sum::<usize>()
        );
        // Over the protocol's limit: not remembered at all.
        a.insert(&format!("{long}!"), u64::MAX, L, t0);
        assert!(!a.contains(&format!("{long}!"), u64::MAX, L, t0));
        // Expiry gives the bytes back.
        assert!(!a.contains(&long, 1, L, t0 + KEEP));
        assert_eq!((a.len(), a.bytes), (0, 0));
    }
}

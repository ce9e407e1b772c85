//! Event-id continuity per worker rank, and merging a fetched snapshot with live events.
//!
//! A rank is either synced (the next event id it expects is known) or fetching (its state was
//! requested; live events are buffered meanwhile). When the snapshot arrives, buffered events
//! it already contains (id ≤ its last event id) are dropped and the rest applied in order, so
//! none is lost or applied twice. A gap anywhere starts a new fetch.

use kvrouter_protocol::{EventId, KvEvent, WorkerKey};
use rustc_hash::FxHashMap;

/// Live events buffered per fetching rank before the buffer is dropped. Dropping is safe: the
/// first live event after the snapshot then shows a gap and starts another fetch.
const MAX_BUFFERED_EVENTS: usize = 65_536;

enum RankState {
    Fetching { buffer: Vec<KvEvent> },
    Synced { next: EventId },
}

/// What happened to one live event.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum EventOutcome {
    /// In order: apply it.
    Apply,
    /// The rank is fetching its state: kept until the snapshot lands.
    Buffered,
    /// Already applied (duplicate or older): dropped.
    Stale,
    /// Events were lost: the rank now fetches its state (the event is buffered).
    Gap { missing: u64 },
    /// Not a rank we track: dropped.
    Untracked,
}

/// What loading a snapshot left to do.
#[derive(Debug, PartialEq, Eq)]
pub struct AfterSnapshot {
    /// Buffered events newer than the snapshot, in order: apply after it.
    pub apply: Vec<KvEvent>,
    /// The buffer itself had a gap after the snapshot: fetch again.
    pub refetch: bool,
}

#[derive(Default)]
pub struct RankSync {
    ranks: FxHashMap<WorkerKey, RankState>,
}

impl RankSync {
    /// Starts (or restarts) a fetch for `key`; live events are buffered from now on.
    pub fn start_fetch(&mut self, key: WorkerKey) {
        self.ranks
            .insert(key, RankState::Fetching { buffer: Vec::new() });
    }

    pub fn remove(&mut self, key: WorkerKey) {
        self.ranks.remove(&key);
    }

    pub fn remove_worker(&mut self, worker_id: u64) {
        self.ranks.retain(|k, _| k.worker_id != worker_id);
    }

    pub fn is_tracked(&self, key: WorkerKey) -> bool {
        self.ranks.contains_key(&key)
    }

    pub fn is_synced(&self, key: WorkerKey) -> bool {
        matches!(self.ranks.get(&key), Some(RankState::Synced { .. }))
    }

    /// Ranks whose state is still being fetched.
    pub fn unsynced(&self) -> usize {
        self.ranks
            .values()
            .filter(|s| matches!(s, RankState::Fetching { .. }))
            .count()
    }

    pub fn on_event(&mut self, event: &KvEvent) -> EventOutcome {
        let Some(state) = self.ranks.get_mut(&event.key) else {
            return EventOutcome::Untracked;
        };
        match state {
            RankState::Fetching { buffer } => {
                if buffer.len() >= MAX_BUFFERED_EVENTS {
                    buffer.clear();
                }
                buffer.push(event.clone());
                EventOutcome::Buffered
            }
            RankState::Synced { next } => {
                if event.event_id < *next {
                    EventOutcome::Stale
                } else if event.event_id == *next {
                    // Saturating: ids come from workers, and u64::MAX must not overflow.
                    *next = next.saturating_add(1);
                    EventOutcome::Apply
                } else {
                    let missing = event.event_id - *next;
                    *state = RankState::Fetching {
                        buffer: vec![event.clone()],
                    };
                    EventOutcome::Gap { missing }
                }
            }
        }
    }

    /// The snapshot for `key` was loaded; returns the buffered events to apply after it.
    /// `None` when the rank is no longer fetching (removed meanwhile): discard the snapshot.
    pub fn on_snapshot(
        &mut self,
        key: WorkerKey,
        last_event_id: Option<EventId>,
    ) -> Option<AfterSnapshot> {
        let state = self.ranks.get_mut(&key)?;
        let RankState::Fetching { buffer } = state else {
            return None;
        };
        let mut buffer = std::mem::take(buffer);
        buffer.sort_by_key(|e| e.event_id);
        buffer.dedup_by_key(|e| e.event_id);
        let mut next = last_event_id.map_or(0, |l| l.saturating_add(1));
        let mut apply = Vec::new();
        let first = next;
        let mut rest = buffer
            .into_iter()
            .skip_while(|e| e.event_id < first)
            .peekable();
        while let Some(e) = rest.next_if(|e| e.event_id == next) {
            next = next.saturating_add(1);
            apply.push(e);
        }
        let leftover: Vec<KvEvent> = rest.collect();
        let refetch = !leftover.is_empty();
        *state = if refetch {
            RankState::Fetching { buffer: leftover }
        } else {
            RankState::Synced { next }
        };
        Some(AfterSnapshot { apply, refetch })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrouter_protocol::KvEventData;

    const K: WorkerKey = WorkerKey::new(1, 0);

    fn ev(id: u64) -> KvEvent {
        KvEvent {
            key: K,
            event_id: id,
            data: KvEventData::Cleared,
        }
    }

    fn ids(events: &[KvEvent]) -> Vec<u64> {
        events.iter().map(|e| e.event_id).collect()
    }

    #[test]
    fn buffered_events_merge_with_the_snapshot() {
        let mut s = RankSync::default();
        assert_eq!(s.on_event(&ev(0)), EventOutcome::Untracked);
        s.start_fetch(K);
        for id in [3, 4, 5, 6, 5] {
            assert_eq!(s.on_event(&ev(id)), EventOutcome::Buffered);
        }
        assert_eq!(s.unsynced(), 1);
        // The snapshot contains everything up to 4.
        let after = s.on_snapshot(K, Some(4)).unwrap();
        assert_eq!(ids(&after.apply), vec![5, 6]);
        assert!(!after.refetch);
        assert!(s.is_synced(K));
        assert_eq!(s.on_event(&ev(6)), EventOutcome::Stale);
        assert_eq!(s.on_event(&ev(7)), EventOutcome::Apply);
        assert_eq!(s.on_event(&ev(9)), EventOutcome::Gap { missing: 1 });
        assert!(!s.is_synced(K));
    }

    #[test]
    fn event_ids_at_the_top_of_the_range_do_not_overflow() {
        let mut s = RankSync::default();
        s.start_fetch(K);
        s.on_event(&ev(u64::MAX));
        let after = s.on_snapshot(K, Some(u64::MAX - 1)).unwrap();
        assert_eq!(ids(&after.apply), vec![u64::MAX]);
        assert!(s.is_synced(K));
        assert_eq!(s.on_event(&ev(3)), EventOutcome::Stale);
        s.start_fetch(K);
        assert!(s.on_snapshot(K, Some(u64::MAX)).is_some());
    }

    #[test]
    fn a_gap_inside_the_buffer_asks_for_another_fetch() {
        let mut s = RankSync::default();
        s.start_fetch(K);
        for id in [1, 2, 4] {
            s.on_event(&ev(id));
        }
        let after = s.on_snapshot(K, Some(0)).unwrap();
        assert_eq!(ids(&after.apply), vec![1, 2]);
        assert!(after.refetch);
        // The second snapshot covers the hole.
        let after = s.on_snapshot(K, Some(3)).unwrap();
        assert_eq!(ids(&after.apply), vec![4]);
        assert!(s.is_synced(K));
    }

    #[test]
    fn a_fresh_rank_expects_event_zero() {
        let mut s = RankSync::default();
        s.start_fetch(K);
        let after = s.on_snapshot(K, None).unwrap();
        assert!(after.apply.is_empty());
        assert_eq!(s.on_event(&ev(0)), EventOutcome::Apply);
        // A snapshot for a rank no longer fetching is discarded.
        assert!(s.on_snapshot(K, Some(9)).is_none());
        s.remove(K);
        assert!(s.on_snapshot(K, Some(9)).is_none());
    }
}

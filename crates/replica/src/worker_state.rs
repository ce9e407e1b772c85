//! Worker-state sync: the single authority on each worker rank's event ids and on when its
//! state is fetched (not to be confused with replica sync, which shares load between
//! replicas).
//!
//! A rank is either synced (the next event id it expects is known) or fetching (its state is
//! wanted; live events are buffered meanwhile). When the snapshot arrives, buffered events it
//! already contains (id ≤ its last event id) are dropped and the rest applied in order, so
//! none is lost or applied twice. A gap anywhere starts a new fetch.
//!
//! Fetches are scheduled here too, so that no peer can make a replica fetch without bound:
//! at most [`FetchLimits::per_worker`] of one worker's ranks and [`FetchLimits::total`] in all
//! are fetched at once, and a rank whose fetch failed waits 0.5 s, doubling up to 8 s, before
//! the next try. A rank that has never been synced is not routable: a worker that never
//! answers state queries gets no routes and does not hold up readiness past its first try.

use kvrouter_protocol::{EventId, KvEvent, WorkerId, WorkerKey};
use rustc_hash::FxHashMap;
use std::time::{Duration, Instant};

/// Wait before retrying a failed state fetch; doubled by each further failure in a row.
const FETCH_RETRY: Duration = Duration::from_millis(500);
/// The longest wait between retries of one rank's fetch.
const FETCH_RETRY_MAX: Duration = Duration::from_secs(8);

/// Wait before the next fetch of a rank whose last `failures` fetches failed (≥ 1): 0.5 s,
/// doubling, at most [`FETCH_RETRY_MAX`], so a worker whose state endpoint is broken is not
/// asked (and logged) twice a second forever.
pub fn fetch_retry_delay(failures: u32) -> Duration {
    FETCH_RETRY
        .saturating_mul(1 << failures.saturating_sub(1).min(5))
        .min(FETCH_RETRY_MAX)
}

/// How many state fetches may run at once.
#[derive(Copy, Clone, Debug)]
pub struct FetchLimits {
    pub per_worker: usize,
    pub total: usize,
}

impl Default for FetchLimits {
    fn default() -> Self {
        Self {
            per_worker: 4,
            total: 64,
        }
    }
}

/// A failed fetch, as the caller should report it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct FetchFailure {
    /// Failures in a row of this rank.
    pub failures: u32,
    /// Failures of this worker's ranks since one last synced: warn on 1, 2, 4, 8 ... so a
    /// worker with thousands of broken ranks is not thousands of warnings.
    pub worker_failures: u64,
    pub retry_in: Duration,
}

impl FetchFailure {
    pub fn worth_a_warning(&self) -> bool {
        self.worker_failures.is_power_of_two()
    }
}

/// How much of a rank's state answer its registered capacity can explain: every device-tier
/// block it stores is in the worker's KV cache, so at most the index's own bound for that
/// capacity (`block_limit_for_capacity`: capacity plus a quarter plus 64); lower tiers
/// (host, disk, shared storage: not in the registration, usually larger than the GPU's)
/// together up to [`LOWER_TIER_ALLOWANCE`] times that; every other item (a removed hash, a
/// clear) counts as one block of the lower-tier allowance. An answer past either is refused
/// as it streams in: the fetch fails (a warning names the worker and its capacity) and is
/// retried with the usual backoff, the rank staying out of routing until an answer fits.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct StateBound {
    pub device_blocks: u64,
    pub other_items: u64,
    device: u64,
    other: u64,
}

/// Lower-tier blocks (and other items) a state answer may carry, per device block its
/// registered capacity allows.
pub const LOWER_TIER_ALLOWANCE: u64 = 64;

impl StateBound {
    pub fn for_capacity(capacity_blocks: u64) -> Self {
        let device = capacity_blocks
            .saturating_add(capacity_blocks / 4)
            .saturating_add(64);
        Self {
            device_blocks: device,
            other_items: device.saturating_mul(LOWER_TIER_ALLOWANCE),
            device: 0,
            other: 0,
        }
    }

    /// Counts one chunk's events; `Err` with a message once the answer passes the bound.
    pub fn count(&mut self, events: &[KvEvent]) -> Result<(), String> {
        use kvrouter_protocol::{KvEventData, Tier};
        for e in events {
            let n = match &e.data {
                KvEventData::Stored { blocks, .. } => blocks.len() as u64,
                KvEventData::Removed { engine_hashes } => engine_hashes.len() as u64,
                KvEventData::Cleared => 1,
            };
            if e.tier == Tier::Device && matches!(e.data, KvEventData::Stored { .. }) {
                self.device = self.device.saturating_add(n);
            } else {
                self.other = self.other.saturating_add(n);
            }
        }
        if self.device > self.device_blocks {
            return Err(format!(
                "the state answer stores more than {} device blocks, more than the registered capacity explains; refused",
                self.device_blocks
            ));
        }
        if self.other > self.other_items {
            return Err(format!(
                "the state answer carries more than {} lower-tier blocks and other items ({LOWER_TIER_ALLOWANCE} times what the registered capacity explains); refused",
                self.other_items
            ));
        }
        Ok(())
    }
}

/// Live events buffered per fetching rank before the buffer is dropped. Dropping is safe: the
/// first live event after the snapshot then shows a gap and starts another fetch.
const MAX_BUFFERED_EVENTS: usize = 65_536;

enum RankState {
    Fetching {
        buffer: Vec<KvEvent>,
        /// A fetch is under way (its answer is awaited).
        in_flight: bool,
        /// No fetch before this (backoff after failures).
        not_before: Option<Instant>,
    },
    Synced {
        next: EventId,
    },
}

impl RankState {
    fn fetching() -> Self {
        Self::Fetching {
            buffer: Vec::new(),
            in_flight: false,
            not_before: None,
        }
    }
}

struct Rank {
    state: RankState,
    /// When it joined: a first sync taking longer than the patience no longer holds
    /// readiness (one huge worker fetched a few ranks at a time must not).
    joined: Instant,
    /// Synced at least once since it joined: routable.
    routable: bool,
    /// Failed fetches in a row.
    failures: u32,
    /// A worker's mark said the rank had events up to this id that had not arrived yet.
    suspect: Option<EventId>,
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
    /// The buffer itself had a gap after the snapshot: fetched again.
    pub refetch: bool,
    /// The rank's first sync since it joined: it is routable from now on.
    pub first_sync: bool,
}

#[derive(Default)]
pub struct WorkerStateSync {
    ranks: FxHashMap<WorkerKey, Rank>,
    limits: FetchLimits,
    /// How long readiness waits for a rank's first sync.
    patience: Duration,
    /// Fetches under way, per worker.
    in_flight: FxHashMap<WorkerId, usize>,
    /// Failed fetches per worker since one of its ranks last synced (for logging).
    worker_failures: FxHashMap<WorkerId, u64>,
}

impl WorkerStateSync {
    /// `patience`: how long readiness waits for a rank's first sync (its first fetch
    /// failing ends the wait sooner).
    pub fn new(limits: FetchLimits, patience: Duration) -> Self {
        Self {
            limits,
            patience,
            ..Self::default()
        }
    }

    /// A rank joined: its state is wanted (see [`WorkerStateSync::due_fetches`]).
    pub fn add(&mut self, key: WorkerKey, now: Instant) {
        self.remove(key);
        self.ranks.insert(
            key,
            Rank {
                state: RankState::fetching(),
                joined: now,
                routable: false,
                failures: 0,
                suspect: None,
            },
        );
    }

    /// Fetches `key` again (a gap the caller found); live events are buffered from now on.
    /// The rank stays routable if it was.
    pub fn refetch(&mut self, key: WorkerKey) {
        if let Some(r) = self.ranks.get_mut(&key) {
            if !matches!(r.state, RankState::Fetching { .. }) {
                r.state = RankState::fetching();
            }
        }
    }

    pub fn remove(&mut self, key: WorkerKey) {
        if let Some(r) = self.ranks.remove(&key) {
            if matches!(
                r.state,
                RankState::Fetching {
                    in_flight: true,
                    ..
                }
            ) {
                self.fetch_done(key.worker_id);
            }
        }
    }

    pub fn remove_worker(&mut self, worker_id: WorkerId) {
        self.ranks.retain(|k, _| k.worker_id != worker_id);
        self.in_flight.remove(&worker_id);
        self.worker_failures.remove(&worker_id);
    }

    pub fn is_tracked(&self, key: WorkerKey) -> bool {
        self.ranks.contains_key(&key)
    }

    pub fn is_synced(&self, key: WorkerKey) -> bool {
        self.ranks
            .get(&key)
            .is_some_and(|r| matches!(r.state, RankState::Synced { .. }))
    }

    /// Synced at least once since it joined: the index knows its cache.
    pub fn is_routable(&self, key: WorkerKey) -> bool {
        self.ranks.get(&key).is_some_and(|r| r.routable)
    }

    /// Ranks whose state is being fetched (or waits for a retry).
    pub fn unsynced(&self) -> usize {
        self.ranks
            .values()
            .filter(|r| matches!(r.state, RankState::Fetching { .. }))
            .count()
    }

    /// A rank never synced that readiness no longer waits for: its fetch failed, or its
    /// first sync has taken longer than the patience.
    fn stuck(&self, r: &Rank, now: Instant) -> bool {
        !r.routable && (r.failures > 0 || now.saturating_duration_since(r.joined) > self.patience)
    }

    /// Ranks never synced that readiness still waits for.
    pub fn first_syncs(&self, now: Instant) -> usize {
        self.ranks
            .values()
            .filter(|r| !r.routable && !self.stuck(r, now))
            .count()
    }

    /// Ranks never synced that readiness no longer waits for: out of routing until synced.
    pub fn unroutable(&self, now: Instant) -> Vec<WorkerKey> {
        let mut out: Vec<WorkerKey> = self
            .ranks
            .iter()
            .filter(|(_, r)| self.stuck(r, now))
            .map(|(&k, _)| k)
            .collect();
        out.sort_unstable();
        out
    }

    fn fetch_done(&mut self, worker_id: WorkerId) {
        if let Some(n) = self.in_flight.get_mut(&worker_id) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.in_flight.remove(&worker_id);
            }
        }
    }

    /// The fetches to start now, within the limits; each is marked under way until
    /// [`WorkerStateSync::on_snapshot`] or [`WorkerStateSync::on_fetch_failed`].
    pub fn due_fetches(&mut self, now: Instant) -> Vec<WorkerKey> {
        let mut total: usize = self.in_flight.values().sum();
        if total >= self.limits.total {
            return Vec::new();
        }
        let mut due: Vec<WorkerKey> = self
            .ranks
            .iter()
            .filter(|(_, r)| match r.state {
                RankState::Fetching {
                    in_flight: false,
                    not_before,
                    ..
                } => not_before.is_none_or(|t| t <= now),
                _ => false,
            })
            .map(|(&k, _)| k)
            .collect();
        // Never-synced ranks first, then by key, so the order does not depend on the map.
        due.sort_unstable_by_key(|k| (self.ranks[k].routable, *k));
        let mut out = Vec::new();
        for key in due {
            if total >= self.limits.total {
                break;
            }
            let n = self.in_flight.entry(key.worker_id).or_insert(0);
            if *n >= self.limits.per_worker {
                continue;
            }
            *n += 1;
            total += 1;
            if let Some(Rank {
                state: RankState::Fetching { in_flight, .. },
                ..
            }) = self.ranks.get_mut(&key)
            {
                *in_flight = true;
            }
            out.push(key);
        }
        out
    }

    /// A fetch of `key` failed: it is retried after a backoff. `None` if the rank was not
    /// being fetched (removed meanwhile).
    pub fn on_fetch_failed(&mut self, key: WorkerKey, now: Instant) -> Option<FetchFailure> {
        let rank = self.ranks.get_mut(&key)?;
        let RankState::Fetching {
            in_flight,
            not_before,
            ..
        } = &mut rank.state
        else {
            return None;
        };
        if !*in_flight {
            return None;
        }
        *in_flight = false;
        rank.failures = rank.failures.saturating_add(1);
        let retry_in = fetch_retry_delay(rank.failures);
        *not_before = Some(now + retry_in);
        let failures = rank.failures;
        self.fetch_done(key.worker_id);
        let w = self.worker_failures.entry(key.worker_id).or_insert(0);
        *w = w.saturating_add(1);
        Some(FetchFailure {
            failures,
            worker_failures: *w,
            retry_in,
        })
    }

    pub fn on_event(&mut self, event: &KvEvent) -> EventOutcome {
        let Some(rank) = self.ranks.get_mut(&event.key) else {
            return EventOutcome::Untracked;
        };
        let state = &mut rank.state;
        match state {
            RankState::Fetching { buffer, .. } => {
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
                        in_flight: false,
                        not_before: None,
                    };
                    EventOutcome::Gap { missing }
                }
            }
        }
    }

    /// The worker says the last event it gave `key` is `last` (its `EventMarks`). Returns
    /// how many events were lost if the rank now fetches its state: a mark ahead of what
    /// arrived is a suspicion, and the next mark (a second later) still finding those events
    /// missing confirms it. Marks travel apart from events, so one mark may overtake the
    /// last batch; two cannot.
    pub fn on_mark(&mut self, key: WorkerKey, last: EventId) -> Option<u64> {
        let rank = self.ranks.get_mut(&key)?;
        let RankState::Synced { next } = rank.state else {
            rank.suspect = None; // a fetch is wanted or under way anyway
            return None;
        };
        if last < next {
            rank.suspect = None;
            return None;
        }
        match rank.suspect {
            Some(s) if s >= next => {
                rank.suspect = None;
                rank.state = RankState::fetching();
                Some(s - next + 1)
            }
            _ => {
                rank.suspect = Some(last);
                None
            }
        }
    }

    /// The snapshot for `key` arrived; returns the buffered events to apply after it.
    /// `None` when the rank is no longer fetching (removed meanwhile): discard the snapshot.
    pub fn on_snapshot(
        &mut self,
        key: WorkerKey,
        last_event_id: Option<EventId>,
    ) -> Option<AfterSnapshot> {
        let rank = self.ranks.get_mut(&key)?;
        let RankState::Fetching {
            buffer, in_flight, ..
        } = &mut rank.state
        else {
            return None;
        };
        let was_in_flight = std::mem::take(in_flight);
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
        let first_sync = !rank.routable;
        rank.routable = true;
        rank.failures = 0;
        rank.state = if refetch {
            RankState::Fetching {
                buffer: leftover,
                in_flight: false,
                not_before: None,
            }
        } else {
            RankState::Synced { next }
        };
        if was_in_flight {
            self.fetch_done(key.worker_id);
        }
        self.worker_failures.remove(&key.worker_id);
        Some(AfterSnapshot {
            apply,
            refetch,
            first_sync,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrouter_protocol::{KvEventData, Tier};

    const K: WorkerKey = WorkerKey::new(1, 0);

    fn ev(id: u64) -> KvEvent {
        KvEvent {
            tier: Tier::Device,
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
        let mut s = WorkerStateSync::default();
        assert_eq!(s.on_event(&ev(0)), EventOutcome::Untracked);
        s.add(K, Instant::now());
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
    fn a_mark_twice_ahead_of_the_events_starts_a_fetch() {
        let mut s = WorkerStateSync::default();
        s.add(K, Instant::now());
        s.on_snapshot(K, Some(4)).unwrap();
        // In step with the events: nothing to do.
        assert_eq!(s.on_mark(K, 4), None);
        assert_eq!(s.on_mark(K, 4), None);
        // Ahead once (the mark may have overtaken batch 5), then the batch arrives.
        assert_eq!(s.on_mark(K, 5), None);
        assert_eq!(s.on_event(&ev(5)), EventOutcome::Apply);
        assert_eq!(s.on_mark(K, 5), None);
        assert!(s.is_synced(K));
        // Ahead twice with no progress: events 6 and 7 were lost.
        assert_eq!(s.on_mark(K, 7), None);
        assert_eq!(s.on_mark(K, 7), Some(2));
        assert!(!s.is_synced(K));
        assert_eq!(s.due_fetches(Instant::now()), vec![K]);
        // While fetching, marks change nothing; the snapshot syncs the rank.
        assert_eq!(s.on_mark(K, 9), None);
        s.on_snapshot(K, Some(9)).unwrap();
        assert_eq!(s.on_mark(K, 9), None);
        assert_eq!(s.on_mark(K, 9), None);
        assert!(s.is_synced(K));
        // Untracked ranks are ignored.
        assert_eq!(s.on_mark(WorkerKey::new(9, 9), 1), None);
    }

    #[test]
    fn event_ids_at_the_top_of_the_range_do_not_overflow() {
        let mut s = WorkerStateSync::default();
        s.add(K, Instant::now());
        s.on_event(&ev(u64::MAX));
        let after = s.on_snapshot(K, Some(u64::MAX - 1)).unwrap();
        assert_eq!(ids(&after.apply), vec![u64::MAX]);
        assert!(s.is_synced(K));
        assert_eq!(s.on_event(&ev(3)), EventOutcome::Stale);
        s.add(K, Instant::now());
        assert!(s.on_snapshot(K, Some(u64::MAX)).is_some());
    }

    #[test]
    fn a_gap_inside_the_buffer_asks_for_another_fetch() {
        let mut s = WorkerStateSync::default();
        s.add(K, Instant::now());
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
        let mut s = WorkerStateSync::default();
        s.add(K, Instant::now());
        let after = s.on_snapshot(K, None).unwrap();
        assert!(after.apply.is_empty());
        assert_eq!(s.on_event(&ev(0)), EventOutcome::Apply);
        // A snapshot for a rank no longer fetching is discarded.
        assert!(s.on_snapshot(K, Some(9)).is_none());
        s.remove(K);
        assert!(s.on_snapshot(K, Some(9)).is_none());
    }

    #[test]
    fn fetch_retries_back_off_to_a_cap() {
        let ms = |n| fetch_retry_delay(n).as_millis();
        assert_eq!(
            (1..=7).map(ms).collect::<Vec<_>>(),
            vec![500, 1000, 2000, 4000, 8000, 8000, 8000]
        );
        assert_eq!(fetch_retry_delay(u32::MAX), FETCH_RETRY_MAX);
    }

    #[test]
    fn fetches_stay_within_the_limits_per_worker_and_in_all() {
        let now = Instant::now();
        let mut s = WorkerStateSync::new(
            FetchLimits {
                per_worker: 2,
                total: 3,
            },
            Duration::from_secs(2),
        );
        for r in 0..10 {
            s.add(WorkerKey::new(1, r), now);
        }
        s.add(WorkerKey::new(2, 0), now);
        s.add(WorkerKey::new(3, 0), now);
        let first = s.due_fetches(now);
        assert_eq!(
            first,
            vec![
                WorkerKey::new(1, 0),
                WorkerKey::new(1, 1),
                WorkerKey::new(2, 0)
            ]
        );
        assert!(s.due_fetches(now).is_empty(), "all three slots are taken");
        // One answer frees one slot; worker 1 is still at its own limit.
        assert!(
            s.on_snapshot(WorkerKey::new(2, 0), None)
                .unwrap()
                .first_sync
        );
        assert_eq!(s.due_fetches(now), vec![WorkerKey::new(3, 0)]);
        // A failure frees a slot, and the failed rank waits for its backoff.
        let f = s.on_fetch_failed(WorkerKey::new(1, 0), now).unwrap();
        assert_eq!((f.failures, f.worker_failures), (1, 1));
        assert_eq!(s.due_fetches(now), vec![WorkerKey::new(1, 2)]);
        let later = now + fetch_retry_delay(1);
        assert!(s.on_snapshot(WorkerKey::new(1, 1), None).is_some());
        assert_eq!(s.due_fetches(later), vec![WorkerKey::new(1, 0)]);
        // A failure reported twice (or for a rank not fetched) counts once.
        assert!(s.on_fetch_failed(WorkerKey::new(2, 0), now).is_none());
    }

    #[test]
    fn a_rank_is_routable_once_synced_and_stays_so_through_a_refetch() {
        let now = Instant::now();
        let mut s = WorkerStateSync::new(FetchLimits::default(), Duration::from_secs(2));
        s.add(K, now);
        assert_eq!((s.first_syncs(now), s.unroutable(now).len()), (1, 0));
        assert_eq!(s.due_fetches(now), vec![K]);
        s.on_fetch_failed(K, now).unwrap();
        // A failed first fetch no longer holds readiness, but the rank gets no routes.
        assert_eq!((s.first_syncs(now), s.unroutable(now)), (0, vec![K]));
        assert!(!s.is_routable(K));
        assert!(s.due_fetches(now).is_empty(), "backing off");
        assert_eq!(s.due_fetches(now + Duration::from_secs(1)), vec![K]);
        assert!(s.on_snapshot(K, Some(3)).unwrap().first_sync);
        assert!(s.is_routable(K) && s.unroutable(now).is_empty());
        assert_eq!(s.on_event(&ev(6)), EventOutcome::Gap { missing: 2 });
        assert!(
            s.is_routable(K),
            "a gap does not take a synced rank out of routing"
        );
        assert_eq!(s.due_fetches(now), vec![K]);
        assert!(!s.on_snapshot(K, Some(6)).unwrap().first_sync);
    }

    #[test]
    fn warnings_for_one_worker_thin_out() {
        let now = Instant::now();
        let mut s = WorkerStateSync::new(
            FetchLimits {
                per_worker: 64,
                total: 64,
            },
            Duration::from_secs(2),
        );
        for r in 0..64 {
            s.add(WorkerKey::new(9, r), now);
        }
        let keys = s.due_fetches(now);
        let warned = keys
            .iter()
            .filter(|&&k| s.on_fetch_failed(k, now).unwrap().worth_a_warning())
            .count();
        assert_eq!(warned, 7, "1, 2, 4, 8, 16, 32, 64");
    }

    #[test]
    fn a_first_sync_past_the_patience_stops_holding_readiness() {
        let t0 = Instant::now();
        let mut s = WorkerStateSync::new(
            FetchLimits {
                per_worker: 1,
                total: 1,
            },
            Duration::from_secs(2),
        );
        s.add(WorkerKey::new(1, 0), t0);
        s.add(WorkerKey::new(1, 1), t0);
        assert_eq!(s.due_fetches(t0).len(), 1);
        assert_eq!(s.first_syncs(t0), 2, "one fetching, one waiting for a slot");
        let late = t0 + Duration::from_secs(3);
        assert_eq!(s.first_syncs(late), 0);
        assert_eq!(s.unroutable(late).len(), 2);
        // A sync after the patience still makes the rank routable.
        assert!(
            s.on_snapshot(WorkerKey::new(1, 0), None)
                .unwrap()
                .first_sync
        );
        assert_eq!(s.unroutable(late), vec![WorkerKey::new(1, 1)]);
    }

    #[test]
    fn a_state_answer_is_bounded_by_the_registered_capacity() {
        use kvrouter_protocol::{EngineBlockHash, KvEventData, LocalBlockHash, StoredBlock, Tier};
        let stored = |tier: Tier, n: u64| KvEvent {
            key: K,
            event_id: 0,
            tier,
            data: KvEventData::Stored {
                parent: None,
                blocks: (0..n)
                    .map(|i| StoredBlock {
                        engine_hash: EngineBlockHash(i),
                        local_hash: LocalBlockHash(i),
                    })
                    .collect(),
            },
        };
        let mut b = StateBound::for_capacity(100);
        assert_eq!(b.device_blocks, 100 + 25 + 64);
        assert!(b.count(&[stored(Tier::Device, 189)]).is_ok());
        let e = b.count(&[stored(Tier::Device, 1)]).unwrap_err();
        assert!(e.contains("189 device blocks"), "{e}");
        let mut b = StateBound::for_capacity(100);
        for _ in 0..LOWER_TIER_ALLOWANCE {
            assert!(b.count(&[stored(Tier::Host, 189)]).is_ok());
        }
        assert!(b.count(&[stored(Tier::Disk, 1)]).is_err());
        // The largest capacity a registration may claim does not overflow.
        let b = StateBound::for_capacity(u64::MAX);
        assert_eq!(b.other_items, u64::MAX);
    }
}

//! Approximate mode: for routers that receive no KV events, the index is fed from the
//! router's own decisions. A routed request's blocks are assumed cached on the chosen rank
//! until they expire (a TTL renewed by each new decision that includes them) or are evicted,
//! least recently used first, when the whole tracker exceeds its capacity in blocks.

use crate::error::IndexError;
use crate::index::Index;
use kvrouter_protocol::{
    ApproxEntry, EngineBlockHash, KvEventData, LocalBlockHash, SequenceHash, StoredBlock, WorkerId,
    WorkerKey,
};
use rustc_hash::FxHashMap;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Default lifetime of an assumed-cached block.
pub const DEFAULT_TTL: Duration = Duration::from_secs(120);
/// Default bound on assumed-cached (block, rank) pairs across all ranks.
pub const DEFAULT_CAPACITY_BLOCKS: usize = 1 << 22;

#[derive(Clone, Copy, Debug)]
pub struct ApproxConfig {
    pub ttl: Duration,
    pub capacity_blocks: usize,
}

impl Default for ApproxConfig {
    fn default() -> Self {
        Self {
            ttl: DEFAULT_TTL,
            capacity_blocks: DEFAULT_CAPACITY_BLOCKS,
        }
    }
}

/// Tracks when each assumed-cached (rank, sequence hash) was last routed to, and evicts from
/// the index it drives. The sequence hash stands in for the engine hash.
pub struct ApproxTracker {
    config: ApproxConfig,
    /// (rank, sequence hash) -> stamp of its latest touch
    latest: FxHashMap<(WorkerKey, u64), u64>,
    /// Touches in time order; entries whose stamp is no longer the latest are stale.
    queue: VecDeque<Touch>,
    next_stamp: u64,
}

struct Touch {
    key: WorkerKey,
    seq: u64,
    stamp: u64,
    /// The queue is kept in order of this.
    expires: Instant,
}

/// What [`ApproxTracker::import`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Imported {
    /// Blocks now tracked that were not.
    pub added: usize,
    /// Blocks already tracked here: they keep their own expiry.
    pub kept: usize,
    /// Blocks the index refused (their parent is not held, e.g. it expired first).
    pub refused: usize,
}

impl ApproxTracker {
    pub fn new(config: ApproxConfig) -> Self {
        Self {
            config,
            latest: FxHashMap::default(),
            queue: VecDeque::new(),
            next_stamp: 0,
        }
    }

    pub fn config(&self) -> ApproxConfig {
        self.config
    }

    /// Assumed-cached pairs currently tracked.
    pub fn len(&self) -> usize {
        self.latest.len()
    }

    pub fn is_empty(&self) -> bool {
        self.latest.is_empty()
    }

    /// Records that a request with these blocks was routed to `key` at `now`.
    pub fn record(
        &mut self,
        index: &mut Index,
        key: WorkerKey,
        local: &[LocalBlockHash],
        sequence: &[SequenceHash],
        now: Instant,
    ) -> Result<(), IndexError> {
        if local.len() != sequence.len() {
            return Err(IndexError::LengthMismatch {
                local: local.len(),
                sequence: sequence.len(),
            });
        }
        self.expire(index, now);
        // Blocks up to the first untracked one are already in the index; store the rest.
        let start = sequence
            .iter()
            .position(|s| !self.latest.contains_key(&(key, s.0)))
            .unwrap_or(sequence.len());
        if start < sequence.len() {
            let blocks = (start..sequence.len())
                .map(|i| StoredBlock {
                    engine_hash: EngineBlockHash(sequence[i].0),
                    local_hash: local[i],
                })
                .collect();
            let parent = start.checked_sub(1).map(|i| EngineBlockHash(sequence[i].0));
            index.apply_unsequenced(key, &KvEventData::Stored { parent, blocks })?;
        }
        // Touch the tail first so that parents outlive their children.
        let expires = now + self.config.ttl;
        for s in sequence.iter().rev() {
            self.touch(key, s.0, expires);
        }
        self.evict(index, now);
        Ok(())
    }

    fn touch(&mut self, key: WorkerKey, seq: u64, expires: Instant) {
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        self.latest.insert((key, seq), stamp);
        self.queue.push_back(Touch {
            key,
            seq,
            stamp,
            expires,
        });
    }

    /// Drops every pair older than the TTL.
    pub fn expire(&mut self, index: &mut Index, now: Instant) {
        self.evict(index, now);
    }

    /// Every tracked block that has time left at `now`, for a peer to [`import`](Self::import):
    /// each rank's blocks come parents first, each with the time it has left.
    pub fn export(&self, index: &Index, now: Instant) -> Vec<ApproxEntry> {
        let mut expires: FxHashMap<(WorkerKey, u64), Instant> = FxHashMap::default();
        expires.reserve(self.latest.len());
        for t in &self.queue {
            if self.latest.get(&(t.key, t.seq)) == Some(&t.stamp) {
                expires.insert((t.key, t.seq), t.expires);
            }
        }
        let mut keys: Vec<WorkerKey> = self.latest.keys().map(|&(k, _)| k).collect();
        keys.sort_unstable();
        keys.dedup();
        let mut out = Vec::with_capacity(expires.len());
        for key in keys {
            // The index knows each block's local hash and parent; the tracker its expiry.
            let Some(dump) = index.dump(key) else {
                continue;
            };
            for ev in dump.events {
                let KvEventData::Stored { parent, blocks } = ev.data else {
                    continue;
                };
                let mut parent = parent.map(|p| SequenceHash(p.0));
                for b in blocks {
                    let seq = SequenceHash(b.engine_hash.0);
                    let left = expires
                        .get(&(key, seq.0))
                        .map_or(Duration::ZERO, |e| e.saturating_duration_since(now));
                    let expires_in_ms = u64::try_from(left.as_millis()).unwrap_or(u64::MAX);
                    if expires_in_ms > 0 {
                        out.push(ApproxEntry {
                            key,
                            parent,
                            sequence_hash: seq,
                            local_hash: b.local_hash,
                            expires_in_ms,
                        });
                    }
                    parent = Some(seq);
                }
            }
        }
        out
    }

    /// Loads a peer's [`export`](Self::export) at `now`. Each block expires when it would have
    /// on the peer, but within this tracker's TTL; a block already tracked here keeps its own
    /// expiry (what this replica saw is at least as recent), so importing is idempotent and
    /// may follow live decisions. Entries must come parents first, as exported.
    pub fn import(&mut self, index: &mut Index, entries: &[ApproxEntry], now: Instant) -> Imported {
        self.expire(index, now);
        let mut out = Imported::default();
        // (expiry, position in the dump, rank, sequence hash)
        let mut touches: Vec<(Instant, usize, WorkerKey, u64)> = Vec::new();
        for (i, e) in entries.iter().enumerate() {
            let left = Duration::from_millis(e.expires_in_ms).min(self.config.ttl);
            if left.is_zero() {
                continue;
            }
            let id = (e.key, e.sequence_hash.0);
            if self.latest.contains_key(&id) {
                out.kept += 1;
                continue;
            }
            let stored = KvEventData::Stored {
                parent: e.parent.map(|p| EngineBlockHash(p.0)),
                blocks: vec![StoredBlock {
                    engine_hash: EngineBlockHash(e.sequence_hash.0),
                    local_hash: e.local_hash,
                }],
            };
            if index.apply_unsequenced(e.key, &stored).is_err() {
                out.refused += 1;
                continue;
            }
            // Mark it tracked now, so a duplicate later in the dump is kept, not stored twice.
            self.latest.insert(id, u64::MAX);
            touches.push((now + left, i, e.key, e.sequence_hash.0));
            out.added += 1;
        }
        // Expiry order; on a tie, later in the dump (children) first, so parents outlive them.
        touches.sort_unstable_by_key(|&(expires, i, _, _)| (expires, std::cmp::Reverse(i)));
        for (expires, _, key, seq) in touches {
            self.touch(key, seq, expires);
        }
        let in_order = self
            .queue
            .iter()
            .zip(self.queue.iter().skip(1))
            .all(|(a, b)| a.expires <= b.expires);
        if !in_order {
            // Stable: equal expiries keep their order.
            self.queue.make_contiguous().sort_by_key(|t| t.expires);
        }
        self.evict(index, now);
        out
    }

    fn evict(&mut self, index: &mut Index, now: Instant) {
        while let Some(front) = self.queue.front() {
            let expired = now >= front.expires;
            let over = self.latest.len() > self.config.capacity_blocks;
            if !expired && !over {
                break;
            }
            let Some(t) = self.queue.pop_front() else {
                break;
            };
            if self.latest.get(&(t.key, t.seq)) == Some(&t.stamp) {
                self.latest.remove(&(t.key, t.seq));
                // The tracker only stored what the index accepted; a miss is harmless.
                let _ = index.apply_unsequenced(
                    t.key,
                    &KvEventData::Removed {
                        engine_hashes: vec![EngineBlockHash(t.seq)],
                    },
                );
            }
        }
        // Stale touches pile up when the same blocks are routed to again and again.
        if self.queue.len() > 2 * self.latest.len() + 1024 {
            let latest = &self.latest;
            self.queue
                .retain(|t| latest.get(&(t.key, t.seq)) == Some(&t.stamp));
        }
    }

    /// Forgets the pairs of a worker the index no longer has.
    pub fn forget_worker(&mut self, worker_id: WorkerId) {
        self.latest.retain(|(k, _), _| k.worker_id != worker_id);
    }

    /// Forgets the pairs of one rank.
    pub fn forget_rank(&mut self, key: WorkerKey) {
        self.latest.retain(|(k, _), _| *k != key);
    }

    /// Removes every block recorded for `key` from the index and forgets them (a rank whose
    /// KV events flow again: its own events say what it caches). Returns how many.
    pub fn drop_rank(&mut self, index: &mut Index, key: WorkerKey) -> usize {
        let mut engine_hashes = Vec::new();
        self.latest.retain(|&(k, seq), _| {
            if k == key {
                engine_hashes.push(EngineBlockHash(seq));
            }
            k != key
        });
        let n = engine_hashes.len();
        if n > 0 {
            // Only what the tracker stored: a miss is harmless.
            let _ = index.apply_unsequenced(key, &KvEventData::Removed { engine_hashes });
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrouter_protocol::{local_block_hashes, sequence_hashes};

    fn hashes(tokens: &[u32]) -> (Vec<LocalBlockHash>, Vec<SequenceHash>) {
        let l = local_block_hashes(tokens, 4, None).unwrap();
        let s = sequence_hashes(&l);
        (l, s)
    }

    /// A rank's recorded blocks go, and only they: what its own events stored and what
    /// other ranks hold stay.
    #[test]
    fn dropping_a_rank_removes_only_its_recorded_blocks() {
        let mut index = Index::new();
        let mut t = ApproxTracker::new(ApproxConfig {
            ttl: Duration::from_secs(100),
            capacity_blocks: 1000,
        });
        let (a, b) = (WorkerKey::new(1, 0), WorkerKey::new(2, 0));
        let (l, s) = hashes(&(0..16).collect::<Vec<_>>());
        let t0 = Instant::now();
        t.record(&mut index, a, &l, &s, t0).unwrap();
        t.record(&mut index, b, &l, &s, t0).unwrap();
        // What rank a's engine says it stored, under its own block hashes.
        let (own_l, _) = hashes(&(100..108).collect::<Vec<_>>());
        let stored = KvEventData::Stored {
            parent: None,
            blocks: own_l
                .iter()
                .enumerate()
                .map(|(i, &local_hash)| StoredBlock {
                    engine_hash: EngineBlockHash(9000 + i as u64),
                    local_hash,
                })
                .collect(),
        };
        index.apply_unsequenced(a, &stored).unwrap();
        assert_eq!(t.drop_rank(&mut index, a), 4);
        assert_eq!(index.find_matches(&l).get(a), 0);
        assert_eq!(index.find_matches(&l).get(b), 4);
        assert_eq!(index.find_matches(&own_l).get(a), 2);
        assert_eq!(t.len(), 4, "b's pairs are still tracked");
        assert_eq!(t.drop_rank(&mut index, a), 0);
        // Recorded again later, they count again.
        t.record(&mut index, a, &l, &s, t0).unwrap();
        assert_eq!(index.find_matches(&l).get(a), 4);
    }

    #[test]
    fn decisions_become_overlaps_and_expire_after_the_ttl() {
        let mut index = Index::new();
        let mut t = ApproxTracker::new(ApproxConfig {
            ttl: Duration::from_secs(10),
            capacity_blocks: 1000,
        });
        let k = WorkerKey::new(7, 1);
        let (l, s) = hashes(&(0..16).collect::<Vec<_>>());
        let t0 = Instant::now();
        t.record(&mut index, k, &l, &s, t0).unwrap();
        assert_eq!(index.find_matches(&l).get(k), 4);
        // a longer request sharing the prefix extends it
        let (l2, s2) = hashes(&(0..24).collect::<Vec<_>>());
        t.record(&mut index, k, &l2[..], &s2[..], t0 + Duration::from_secs(5))
            .unwrap();
        assert_eq!(index.find_matches(&l2).get(k), 6);
        // at t0+12 the first touches expired but the renewals at t0+5 keep every block
        t.expire(&mut index, t0 + Duration::from_secs(12));
        assert_eq!(index.find_matches(&l2).get(k), 6);
        t.expire(&mut index, t0 + Duration::from_secs(15));
        assert_eq!(index.find_matches(&l2).get(k), 0);
        assert_eq!(index.stats().live_pairs, 0);
        assert!(t.is_empty());
    }

    #[test]
    fn capacity_evicts_least_recently_used_tail_first() {
        let mut index = Index::new();
        let mut t = ApproxTracker::new(ApproxConfig {
            ttl: Duration::from_secs(100),
            capacity_blocks: 5,
        });
        let (a, sa) = hashes(&(0..16).collect::<Vec<_>>());
        let (b, sb) = hashes(&(100..112).collect::<Vec<_>>());
        let now = Instant::now();
        t.record(&mut index, WorkerKey::new(1, 0), &a, &sa, now)
            .unwrap();
        t.record(&mut index, WorkerKey::new(2, 0), &b, &sb, now)
            .unwrap();
        // 7 pairs over a capacity of 5: the two least recent of A (its tail) go
        assert_eq!(t.len(), 5);
        assert_eq!(index.find_matches(&a).get(WorkerKey::new(1, 0)), 2);
        assert_eq!(index.find_matches(&b).get(WorkerKey::new(2, 0)), 3);
    }

    fn tracker(ttl_secs: u64) -> (Index, ApproxTracker) {
        (
            Index::new(),
            ApproxTracker::new(ApproxConfig {
                ttl: Duration::from_secs(ttl_secs),
                capacity_blocks: 1000,
            }),
        )
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn an_export_imported_elsewhere_answers_alike_and_keeps_the_time_left() {
        let (k1, k2) = (WorkerKey::new(1, 0), WorkerKey::new(2, 3));
        let (a, sa) = hashes(&(0..16).collect::<Vec<_>>()); // 4 blocks
        let (b, sb) = hashes(&(0..24).collect::<Vec<_>>()); // a + 2 blocks
        let (c, sc) = hashes(&(500..508).collect::<Vec<_>>());
        let (mut ia, mut ta) = tracker(10);
        let t0 = Instant::now();
        ta.record(&mut ia, k1, &a, &sa, t0).unwrap();
        ta.record(&mut ia, k2, &c, &sc, t0).unwrap();
        ta.record(&mut ia, k1, &b[..2], &sb[..2], t0 + secs(4))
            .unwrap();
        ta.record(&mut ia, k2, &b, &sb, t0 + secs(4)).unwrap();
        let dump = ta.export(&ia, t0 + secs(6));
        assert_eq!(dump.len(), ta.len());
        // Another replica, on its own clock, loads it.
        let (mut ib, mut tb) = tracker(10);
        let t1 = t0 + secs(100);
        let got = tb.import(&mut ib, &dump, t1);
        assert_eq!(
            got,
            Imported {
                added: dump.len(),
                kept: 0,
                refused: 0
            }
        );
        for q in [&a, &b, &c] {
            assert_eq!(ib.find_matches(q), ia.find_matches(q), "{q:?}");
        }
        // k1's blocks 2..4 had 4 s left, its first two 8 s: the same ages here.
        tb.expire(&mut ib, t1 + secs(3));
        assert_eq!(ib.find_matches(&a).get(k1), 4);
        tb.expire(&mut ib, t1 + secs(5));
        assert_eq!(ib.find_matches(&a).get(k1), 2);
        assert_eq!(ib.find_matches(&c).get(k2), 0);
        assert_eq!(ib.find_matches(&b).get(k2), 6);
        tb.expire(&mut ib, t1 + secs(8));
        assert!(tb.is_empty());
        assert_eq!(ib.stats().live_pairs, 0);
        // Exporting again yields the same entries as the original, given the same time left.
        let (mut ic, mut tc) = tracker(10);
        tc.import(&mut ic, &dump, t1);
        let mut again = tc.export(&ic, t1);
        let mut first = dump.clone();
        again.sort_by_key(|e| (e.key, e.sequence_hash));
        first.sort_by_key(|e| (e.key, e.sequence_hash));
        assert_eq!(again, first);
    }

    #[test]
    fn importing_is_idempotent_and_keeps_what_was_seen_live() {
        let k = WorkerKey::new(1, 0);
        let (a, sa) = hashes(&(0..16).collect::<Vec<_>>());
        let (mut ia, mut ta) = tracker(10);
        let t0 = Instant::now();
        ta.record(&mut ia, k, &a, &sa, t0).unwrap();
        let dump = ta.export(&ia, t0 + secs(8)); // 2 s left
        let (mut ib, mut tb) = tracker(10);
        // A live decision for the first two blocks arrives before the dump is loaded.
        tb.record(&mut ib, k, &a[..2], &sa[..2], t0).unwrap();
        let got = tb.import(&mut ib, &dump, t0);
        assert_eq!(
            got,
            Imported {
                added: 2,
                kept: 2,
                refused: 0
            }
        );
        assert_eq!(
            tb.import(&mut ib, &dump, t0),
            Imported {
                added: 0,
                kept: 4,
                refused: 0
            }
        );
        assert_eq!(ib.find_matches(&a).get(k), 4);
        assert_eq!(tb.len(), 4);
        // The imported tail expires with the peer's time left, the live head after a full TTL.
        tb.expire(&mut ib, t0 + secs(3));
        assert_eq!(ib.find_matches(&a).get(k), 2);
        tb.expire(&mut ib, t0 + secs(10));
        assert!(tb.is_empty());
    }

    #[test]
    fn imports_are_capped_at_this_ttl_and_orphans_are_refused() {
        let k = WorkerKey::new(1, 0);
        let (a, sa) = hashes(&(0..12).collect::<Vec<_>>());
        let (mut ia, mut ta) = tracker(100);
        let t0 = Instant::now();
        ta.record(&mut ia, k, &a, &sa, t0).unwrap();
        let dump = ta.export(&ia, t0);
        assert!(dump.iter().all(|e| e.expires_in_ms == 100_000));
        let (mut ib, mut tb) = tracker(2);
        tb.import(&mut ib, &dump, t0);
        tb.expire(&mut ib, t0 + secs(1));
        assert_eq!(ib.find_matches(&a).get(k), 3);
        tb.expire(&mut ib, t0 + secs(2));
        assert!(tb.is_empty());
        // Without its parent a block cannot be stored; expired entries are skipped.
        let (mut ic, mut tc) = tracker(10);
        let mut orphan = dump[1..].to_vec();
        orphan[0].expires_in_ms = 0;
        assert_eq!(
            tc.import(&mut ic, &orphan, t0),
            Imported {
                added: 0,
                kept: 0,
                refused: 1
            }
        );
        assert_eq!(ic.stats().live_pairs, 0);
    }

    #[test]
    fn mismatched_lengths_are_refused() {
        let mut index = Index::new();
        let mut t = ApproxTracker::new(ApproxConfig::default());
        let (l, s) = hashes(&(0..16).collect::<Vec<_>>());
        let err = t
            .record(
                &mut index,
                WorkerKey::new(1, 0),
                &l,
                &s[..3],
                Instant::now(),
            )
            .unwrap_err();
        assert_eq!(
            err,
            IndexError::LengthMismatch {
                local: 4,
                sequence: 3
            }
        );
        assert_eq!(index.stats().live_pairs, 0);
    }
}

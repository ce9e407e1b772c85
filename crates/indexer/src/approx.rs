//! Approximate mode: for routers that receive no KV events, the index is fed from the
//! router's own decisions. A routed request's blocks are assumed cached on the chosen rank
//! until they expire (a TTL renewed by each new decision that includes them) or are evicted,
//! least recently used first, when the whole tracker exceeds its capacity in blocks.

use crate::error::IndexError;
use crate::index::Index;
use kvrouter_protocol::{
    EngineBlockHash, KvEventData, LocalBlockHash, SequenceHash, StoredBlock, WorkerId, WorkerKey,
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
    at: Instant,
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
        for s in sequence.iter().rev() {
            let stamp = self.next_stamp;
            self.next_stamp += 1;
            self.latest.insert((key, s.0), stamp);
            self.queue.push_back(Touch {
                key,
                seq: s.0,
                stamp,
                at: now,
            });
        }
        self.evict(index, now);
        Ok(())
    }

    /// Drops every pair older than the TTL.
    pub fn expire(&mut self, index: &mut Index, now: Instant) {
        self.evict(index, now);
    }

    fn evict(&mut self, index: &mut Index, now: Instant) {
        while let Some(front) = self.queue.front() {
            let expired = now.saturating_duration_since(front.at) >= self.config.ttl;
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

//! Worker keys and the active sequences routed to them.
//!
//! Every worker key gets a dense *slot* so the hot path can keep per-key scratch in plain
//! vectors. Blocks are deduplicated per key by sequence hash: one map from sequence hash to
//! the keys it is active on (with a refcount per key), so "which of this request's blocks
//! are already active, and where" costs one lookup per request block, not one per
//! (block, key) pair.

use crate::error::ScheduleError;
use kvrouter_protocol::{Lease, SequenceHash, WorkerId, WorkerKey};
use rustc_hash::FxHashMap;
use std::collections::hash_map::Entry;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Identifier a caller gives a routed request (unique among active requests of a model).
pub type RequestId = String;

/// Dense index of a worker key inside the scheduler.
pub(crate) type Slot = u32;

/// Load a worker rank reports about itself.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct ReportedLoad {
    /// KV blocks in use on the rank.
    pub active_blocks: u64,
    /// Requests waiting in the engine's own queue.
    pub waiting_requests: u64,
}

/// What the scheduler knows about one worker key's load.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyLoad {
    /// Distinct blocks of the active sequences routed here (decode load).
    pub active_blocks: u64,
    /// Uncached prompt tokens of active sequences not yet past prefill.
    pub prefill_tokens: u64,
    /// Active sequences routed here.
    pub active_requests: u64,
    /// KV capacity of the rank in blocks (0: unknown).
    pub capacity_blocks: u64,
    /// Last load report from the rank, if any.
    pub reported: Option<ReportedLoad>,
}

#[derive(Clone, Debug)]
pub(crate) struct KeyState {
    pub key: WorkerKey,
    pub load: KeyLoad,
}

/// The keys one sequence hash is active on, with a refcount each. Nearly always one key,
/// so that case does not allocate.
#[derive(Clone, Debug)]
enum Holders {
    One(Slot, u32),
    Many(Vec<(Slot, u32)>),
}

impl Holders {
    /// Adds one reference from `slot`; true if the block is newly active there.
    fn incr(&mut self, slot: Slot) -> bool {
        match self {
            Holders::One(s, n) if *s == slot => {
                *n += 1;
                false
            }
            Holders::One(s, n) => {
                *self = Holders::Many(vec![(*s, *n), (slot, 1)]);
                true
            }
            Holders::Many(v) => match v.iter_mut().find(|(s, _)| *s == slot) {
                Some((_, n)) => {
                    *n += 1;
                    false
                }
                None => {
                    v.push((slot, 1));
                    true
                }
            },
        }
    }

    /// Drops one reference from `slot`. Returns (block no longer active on slot, no
    /// holder left).
    fn decr(&mut self, slot: Slot) -> (bool, bool) {
        match self {
            Holders::One(s, n) => {
                debug_assert_eq!(*s, slot);
                *n -= 1;
                (*n == 0, *n == 0)
            }
            Holders::Many(v) => {
                let Some(i) = v.iter().position(|(s, _)| *s == slot) else {
                    debug_assert!(false, "slot {slot} does not hold the block");
                    return (false, v.is_empty());
                };
                v[i].1 -= 1;
                if v[i].1 == 0 {
                    v.swap_remove(i);
                    (true, v.is_empty())
                } else {
                    (false, false)
                }
            }
        }
    }

    fn for_each(&self, mut f: impl FnMut(Slot)) {
        match self {
            Holders::One(s, _) => f(*s),
            Holders::Many(v) => v.iter().for_each(|(s, _)| f(*s)),
        }
    }
}

#[derive(Clone, Debug)]
struct ActiveRequest {
    slot: Slot,
    /// Sorted, distinct.
    hashes: Box<[SequenceHash]>,
    /// Prefill tokens still counted on the key (0 once marked).
    prefill_tokens: u64,
    /// Output blocks counted in the key's decode load (each its own block: output is never
    /// shared).
    output_blocks: u32,
    /// Output blocks generated so far, as the caller reported them.
    generated: u32,
    /// Output blocks the caller expected when it routed the request.
    expected: u32,
    added: (Instant, u64),
    /// What a caller must present to end it ([`Lease::NONE`]: nothing; peers' requests).
    lease: Lease,
}

/// Worker keys, their load and the active sequences on them.
#[derive(Debug, Default)]
pub(crate) struct ActiveSequences {
    keys: Vec<Option<KeyState>>,
    free_slots: Vec<Slot>,
    index: FxHashMap<WorkerKey, Slot>,
    workers: FxHashMap<WorkerId, Vec<Slot>>,
    blocks: FxHashMap<SequenceHash, Holders>,
    requests: FxHashMap<RequestId, ActiveRequest>,
    by_age: BTreeMap<(Instant, u64), RequestId>,
    next_seq: u64,
}

impl ActiveSequences {
    /// Adds a key, or updates its capacity. True if the key is new.
    pub fn add_key(&mut self, key: WorkerKey, capacity_blocks: u64) -> bool {
        if let Some(&slot) = self.index.get(&key) {
            self.state_mut(slot).load.capacity_blocks = capacity_blocks;
            return false;
        }
        let state = KeyState {
            key,
            load: KeyLoad {
                capacity_blocks,
                ..KeyLoad::default()
            },
        };
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                self.keys[slot as usize] = Some(state);
                slot
            }
            None => {
                self.keys.push(Some(state));
                (self.keys.len() - 1) as Slot
            }
        };
        self.index.insert(key, slot);
        self.workers.entry(key.worker_id).or_default().push(slot);
        true
    }

    /// Removes a key and drops its active sequences (returned). None if unknown.
    pub fn remove_key(&mut self, key: WorkerKey) -> Option<Vec<RequestId>> {
        let slot = self.index.remove(&key)?;
        if let Entry::Occupied(mut e) = self.workers.entry(key.worker_id) {
            e.get_mut().retain(|&s| s != slot);
            if e.get().is_empty() {
                e.remove();
            }
        }
        let mut dropped = Vec::new();
        if self.state(slot).load.active_requests > 0 {
            let mut ids: Vec<RequestId> = self
                .requests
                .iter()
                .filter(|(_, r)| r.slot == slot)
                .map(|(id, _)| id.clone())
                .collect();
            // Sorted so the answer does not depend on hash-map order.
            ids.sort_unstable();
            for id in ids {
                let r = self.requests.remove(&id).expect("listed above");
                self.by_age.remove(&r.added);
                self.release(r);
                dropped.push(id);
            }
        }
        self.keys[slot as usize] = None;
        self.free_slots.push(slot);
        Some(dropped)
    }

    /// Removes every key of a worker; returns the dropped active sequences (sorted).
    pub fn remove_worker(&mut self, worker_id: WorkerId) -> Vec<RequestId> {
        let Some(slots) = self.workers.get(&worker_id) else {
            return Vec::new();
        };
        let keys: Vec<WorkerKey> = slots.iter().map(|&s| self.state(s).key).collect();
        let mut dropped = Vec::new();
        for key in keys {
            dropped.extend(self.remove_key(key).unwrap_or_default());
        }
        dropped.sort_unstable();
        dropped
    }

    pub fn slot_of(&self, key: WorkerKey) -> Option<Slot> {
        self.index.get(&key).copied()
    }

    /// The slot of a pinned key: an unknown worker or rank is its own error.
    pub fn pinned_slot(&self, key: WorkerKey) -> Result<Slot, ScheduleError> {
        if !self.has_worker(key.worker_id) {
            return Err(ScheduleError::UnknownWorker(key.worker_id));
        }
        self.slot_of(key).ok_or(ScheduleError::InvalidRank {
            worker_id: key.worker_id,
            dp_rank: key.dp_rank,
        })
    }

    pub fn has_worker(&self, worker_id: WorkerId) -> bool {
        self.workers.contains_key(&worker_id)
    }

    /// Slots of a worker's keys (in the order they were added).
    pub fn worker_slots(&self, worker_id: WorkerId) -> &[Slot] {
        self.workers.get(&worker_id).map_or(&[], Vec::as_slice)
    }

    /// Upper bound of slot numbers (for sizing per-slot scratch).
    pub fn slot_bound(&self) -> usize {
        self.keys.len()
    }

    pub fn key_count(&self) -> usize {
        self.index.len()
    }

    /// Occupied slots, ascending.
    pub fn slots(&self) -> impl Iterator<Item = Slot> + '_ {
        self.keys
            .iter()
            .enumerate()
            .filter(|(_, k)| k.is_some())
            .map(|(i, _)| i as Slot)
    }

    pub fn states(&self) -> impl Iterator<Item = &KeyState> + '_ {
        self.keys.iter().flatten()
    }

    pub fn state(&self, slot: Slot) -> &KeyState {
        self.keys[slot as usize]
            .as_ref()
            .expect("slot of a live key")
    }

    pub fn state_mut(&mut self, slot: Slot) -> &mut KeyState {
        self.keys[slot as usize]
            .as_mut()
            .expect("slot of a live key")
    }

    pub fn contains(&self, request_id: &str) -> bool {
        self.requests.contains_key(request_id)
    }

    pub fn request_count(&self) -> usize {
        self.requests.len()
    }

    /// Calls `f` with every slot the block is active on.
    pub fn for_each_holder(&self, hash: SequenceHash, f: impl FnMut(Slot)) {
        if let Some(h) = self.blocks.get(&hash) {
            h.for_each(f);
        }
    }

    /// Every active sequence: (id, slot, its distinct block hashes, prefill tokens still
    /// counted).
    pub fn requests(&self) -> impl Iterator<Item = (&RequestId, Slot, &[SequenceHash], u64)> + '_ {
        self.requests
            .iter()
            .map(|(id, r)| (id, r.slot, &r.hashes[..], r.prefill_tokens))
    }

    /// One active sequence: its slot, distinct block hashes and prefill tokens still counted.
    pub fn request(&self, request_id: &str) -> Option<(Slot, &[SequenceHash], u64)> {
        self.requests
            .get(request_id)
            .map(|r| (r.slot, &r.hashes[..], r.prefill_tokens))
    }

    /// Adds an active sequence on `slot` without a lease (see [`ActiveSequences::add_leased`]).
    pub fn add(
        &mut self,
        request_id: RequestId,
        slot: Slot,
        hashes: &[SequenceHash],
        prefill_tokens: u64,
        expected_output_blocks: u32,
        now: Instant,
    ) -> Result<(), ScheduleError> {
        let booking = (prefill_tokens, expected_output_blocks, Lease::NONE);
        self.add_leased(request_id, slot, hashes, booking, now)
    }

    /// Adds an active sequence on `slot` with `(prefill tokens, expected output blocks,
    /// lease)`: its output counts the expected blocks from the start, and only a holder of
    /// the lease may end it ([`ActiveSequences::lease_admits`]).
    pub fn add_leased(
        &mut self,
        request_id: RequestId,
        slot: Slot,
        hashes: &[SequenceHash],
        (prefill_tokens, expected_output_blocks, lease): (u64, u32, Lease),
        now: Instant,
    ) -> Result<(), ScheduleError> {
        if self.requests.contains_key(&request_id) {
            return Err(ScheduleError::DuplicateRequest(request_id));
        }
        let mut sorted: Vec<SequenceHash> = hashes.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        let mut new_blocks = 0u64;
        for &h in &sorted {
            match self.blocks.entry(h) {
                Entry::Vacant(e) => {
                    e.insert(Holders::One(slot, 1));
                    new_blocks += 1;
                }
                Entry::Occupied(mut e) => new_blocks += u64::from(e.get_mut().incr(slot)),
            }
        }
        let load = &mut self.state_mut(slot).load;
        load.active_blocks += new_blocks + u64::from(expected_output_blocks);
        load.prefill_tokens += prefill_tokens;
        load.active_requests += 1;
        let added = (now, self.next_seq);
        self.next_seq += 1;
        self.by_age.insert(added, request_id.clone());
        self.requests.insert(
            request_id,
            ActiveRequest {
                slot,
                hashes: sorted.into_boxed_slice(),
                prefill_tokens,
                output_blocks: expected_output_blocks,
                generated: 0,
                expected: expected_output_blocks,
                added,
                lease,
            },
        );
        Ok(())
    }

    /// Whether `presented` may act on the request (its lease, or it has none); `None` if
    /// the request is unknown.
    pub fn lease_admits(&self, request_id: &str, presented: Lease) -> Option<bool> {
        self.requests
            .get(request_id)
            .map(|r| r.lease.admits(presented))
    }

    /// Output blocks the request counts in its key's decode load. None if unknown.
    pub fn output_blocks(&self, request_id: &str) -> Option<u32> {
        self.requests.get(request_id).map(|r| r.output_blocks)
    }

    /// The request's output now counts `blocks` in its key's decode load (a peer's word on
    /// its own request). False if unknown.
    pub fn set_output_blocks(&mut self, request_id: &str, blocks: u32) -> bool {
        let Some(r) = self.requests.get_mut(request_id) else {
            return false;
        };
        let old = std::mem::replace(&mut r.output_blocks, blocks);
        let slot = r.slot;
        let load = &mut self.state_mut(slot).load;
        load.active_blocks = load.active_blocks - u64::from(old) + u64::from(blocks);
        true
    }

    /// The request generated one more output block. Its output then counts the larger of
    /// the blocks generated and those expected, times `decay_fraction` (rounded up; `None`:
    /// 1). Returns the blocks it now counts; None if unknown.
    pub fn add_output_block(
        &mut self,
        request_id: &str,
        decay_fraction: Option<f64>,
    ) -> Option<u32> {
        let r = self.requests.get_mut(request_id)?;
        r.generated = r.generated.saturating_add(1);
        let full = r.generated.max(r.expected);
        let counted = match decay_fraction {
            Some(f) => (f64::from(full) * f.clamp(0.0, 1.0)).ceil() as u32,
            None => full,
        };
        self.set_output_blocks(request_id, counted);
        Some(counted)
    }

    /// The request's prefill is done: its prefill tokens stop counting. False if unknown.
    /// Marking twice is harmless (and true).
    pub fn mark_prefill(&mut self, request_id: &str) -> bool {
        let Some(r) = self.requests.get_mut(request_id) else {
            return false;
        };
        let tokens = std::mem::take(&mut r.prefill_tokens);
        let slot = r.slot;
        self.state_mut(slot).load.prefill_tokens -= tokens;
        true
    }

    /// The request finished: drop it. False if unknown.
    pub fn free(&mut self, request_id: &str) -> bool {
        let Some(r) = self.requests.remove(request_id) else {
            return false;
        };
        self.by_age.remove(&r.added);
        self.release(r);
        true
    }

    fn release(&mut self, r: ActiveRequest) {
        let mut gone = 0u64;
        for h in r.hashes.iter() {
            let Entry::Occupied(mut e) = self.blocks.entry(*h) else {
                debug_assert!(false, "active block missing from the block map");
                continue;
            };
            let (off_slot, empty) = e.get_mut().decr(r.slot);
            gone += u64::from(off_slot);
            if empty {
                e.remove();
            }
        }
        let load = &mut self.state_mut(r.slot).load;
        load.active_blocks -= gone + u64::from(r.output_blocks);
        load.prefill_tokens -= r.prefill_tokens;
        load.active_requests -= 1;
    }

    /// Frees every request added at least `timeout` before `now`; returns their ids,
    /// oldest first.
    pub fn sweep(&mut self, now: Instant, timeout: Duration) -> Vec<RequestId> {
        let Some(cutoff) = now.checked_sub(timeout) else {
            return Vec::new();
        };
        let mut freed = Vec::new();
        while let Some(entry) = self.by_age.first_entry() {
            if entry.key().0 > cutoff {
                break;
            }
            let id = entry.remove();
            if let Some(r) = self.requests.remove(&id) {
                self.release(r);
            }
            freed.push(id);
        }
        freed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(v: &[u64]) -> Vec<SequenceHash> {
        v.iter().map(|&x| SequenceHash(x)).collect()
    }

    fn load(a: &ActiveSequences, key: WorkerKey) -> KeyLoad {
        a.state(a.slot_of(key).unwrap()).load
    }

    #[test]
    fn dedups_blocks_per_key() {
        let mut a = ActiveSequences::default();
        let k0 = WorkerKey::new(1, 0);
        let k1 = WorkerKey::new(1, 1);
        a.add_key(k0, 100);
        a.add_key(k1, 100);
        let now = Instant::now();
        let s0 = a.slot_of(k0).unwrap();
        let s1 = a.slot_of(k1).unwrap();
        a.add("a".into(), s0, &h(&[1, 2, 3]), 10, 0, now).unwrap();
        a.add("b".into(), s0, &h(&[1, 2, 4, 4]), 5, 0, now).unwrap();
        a.add("c".into(), s1, &h(&[1]), 0, 0, now).unwrap();
        assert_eq!(load(&a, k0).active_blocks, 4);
        assert_eq!(load(&a, k0).prefill_tokens, 15);
        assert_eq!(load(&a, k0).active_requests, 2);
        assert_eq!(load(&a, k1).active_blocks, 1);
        let mut holders = vec![];
        a.for_each_holder(SequenceHash(1), |s| holders.push(s));
        holders.sort();
        assert_eq!(holders, vec![s0, s1]);

        assert!(a.mark_prefill("a"));
        assert!(a.mark_prefill("a"));
        assert_eq!(load(&a, k0).prefill_tokens, 5);
        assert!(a.free("a"));
        assert!(!a.free("a"));
        assert!(!a.mark_prefill("a"));
        assert_eq!(load(&a, k0).active_blocks, 3);
        assert_eq!(load(&a, k0).prefill_tokens, 5);
        assert!(a.free("b"));
        assert_eq!(
            load(&a, k0),
            KeyLoad {
                capacity_blocks: 100,
                ..Default::default()
            }
        );
        assert!(a.free("c"));
        assert!(a.blocks.is_empty());
        assert!(a.by_age.is_empty());
    }

    #[test]
    fn duplicate_request_is_an_error() {
        let mut a = ActiveSequences::default();
        a.add_key(WorkerKey::new(1, 0), 10);
        let now = Instant::now();
        a.add("x".into(), 0, &h(&[1]), 1, 0, now).unwrap();
        assert_eq!(
            a.add("x".into(), 0, &h(&[2]), 1, 0, now),
            Err(ScheduleError::DuplicateRequest("x".into()))
        );
        assert_eq!(a.state(0).load.active_blocks, 1);
    }

    #[test]
    fn remove_key_drops_its_sequences_and_reuses_the_slot() {
        let mut a = ActiveSequences::default();
        let k0 = WorkerKey::new(1, 0);
        let k1 = WorkerKey::new(2, 0);
        a.add_key(k0, 10);
        a.add_key(k1, 10);
        let now = Instant::now();
        a.add("a".into(), 0, &h(&[1, 2]), 3, 0, now).unwrap();
        a.add("b".into(), 1, &h(&[1, 2]), 3, 0, now).unwrap();
        a.add("c".into(), 0, &h(&[7]), 3, 0, now).unwrap();
        assert_eq!(
            a.remove_key(k0),
            Some(vec!["a".to_string(), "c".to_string()])
        );
        assert_eq!(a.remove_key(k0), None);
        assert!(!a.has_worker(1));
        assert_eq!(a.blocks.len(), 2);
        assert_eq!(a.by_age.len(), 1);
        let k2 = WorkerKey::new(3, 0);
        assert!(a.add_key(k2, 5));
        assert_eq!(a.slot_of(k2), Some(0));
        assert_eq!(load(&a, k2).active_blocks, 0);
        assert_eq!(a.remove_worker(2), vec!["b".to_string()]);
        assert!(a.blocks.is_empty());
        assert_eq!(a.key_count(), 1);
    }

    #[test]
    fn sweep_frees_old_requests_in_age_order() {
        let mut a = ActiveSequences::default();
        a.add_key(WorkerKey::new(1, 0), 10);
        let t0 = Instant::now();
        let t = |s| t0 + Duration::from_secs(s);
        a.add("late".into(), 0, &h(&[1]), 1, 0, t(5)).unwrap();
        a.add("early".into(), 0, &h(&[2]), 1, 0, t(1)).unwrap();
        a.add("mid".into(), 0, &h(&[3]), 1, 0, t(3)).unwrap();
        let timeout = Duration::from_secs(10);
        assert!(a.sweep(t(10), timeout).is_empty());
        assert_eq!(a.sweep(t(13), timeout), vec!["early", "mid"]);
        assert_eq!(a.state(0).load.active_blocks, 1);
        assert!(a.free("late"));
        assert!(a.sweep(t(100), timeout).is_empty());
    }
}

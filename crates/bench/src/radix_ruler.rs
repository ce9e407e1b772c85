//! The ruler: a plain radix tree over the same event stream, measured in the same run, so a
//! figure of the index from any machine can be read as a ratio to something simple.
//!
//! One node per block, an arena of nodes with a free list, a hash map of children keyed by
//! local hash, a set of holder slots per node, per holder slot a map engine hash → node; no
//! compression, no threads (the shape of Dynamo's one-thread `RadixTree`). A `Stored` walks
//! down from the parent's node, a `Removed` drops the holder and frees nodes left with
//! neither holders nor children, cascading up. A lookup walks the children by the query's
//! local hashes and intersects the holders block by block: a worker's overlap is the depth at
//! which it stops holding, as in the index.
//!
//! It is a ruler, not a target: only device-tier events are applied (others are counted and
//! left out) and event ids are not checked.

use kvrouter_protocol::{KvEvent, KvEventData, LocalBlockHash, StoredBlock, Tier, WorkerKey};
use rustc_hash::{FxHashMap, FxHashSet};

const ROOT: u32 = 0;

struct Node {
    parent: u32,
    local: u64,
    children: FxHashMap<u64, u32>,
    holders: FxHashSet<u32>,
}

impl Node {
    fn new(parent: u32, local: u64) -> Self {
        Self {
            parent,
            local,
            children: FxHashMap::default(),
            holders: FxHashSet::default(),
        }
    }
}

struct Slot {
    key: WorkerKey,
    /// Engine hash → node this slot holds.
    blocks: FxHashMap<u64, u32>,
}

/// What the ruler counted besides applying.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RulerCounters {
    /// `Stored` events whose parent the rank did not hold.
    pub refused_missing_parent: u64,
    /// Events of tiers other than the device's.
    pub ignored_tier: u64,
}

/// The plain radix tree.
pub struct RadixRuler {
    nodes: Vec<Node>,
    free: Vec<u32>,
    slots: Vec<Slot>,
    slot_of: FxHashMap<WorkerKey, u32>,
    live_pairs: usize,
    counters: RulerCounters,
}

impl Default for RadixRuler {
    fn default() -> Self {
        Self {
            nodes: vec![Node::new(ROOT, 0)],
            free: Vec::new(),
            slots: Vec::new(),
            slot_of: FxHashMap::default(),
            live_pairs: 0,
            counters: RulerCounters::default(),
        }
    }
}

impl RadixRuler {
    pub fn new() -> Self {
        Self::default()
    }

    /// (block, rank) pairs held.
    pub fn live_pairs(&self) -> usize {
        self.live_pairs
    }

    /// Nodes in the tree, the root left out.
    pub fn live_nodes(&self) -> usize {
        self.nodes.len() - 1 - self.free.len()
    }

    pub fn counters(&self) -> RulerCounters {
        self.counters
    }

    /// What the arena, the child maps, the holder sets and the slot maps allocated, counting
    /// a hash table's entry and control byte per slot of capacity (an estimate: hashbrown
    /// rounds buckets up to a power of two).
    pub fn table_bytes(&self) -> usize {
        use std::mem::size_of;
        let map = |cap: usize, entry: usize| if cap == 0 { 0 } else { cap * (entry + 1) };
        let nodes: usize = self
            .nodes
            .iter()
            .map(|n| {
                map(n.children.capacity(), size_of::<(u64, u32)>())
                    + map(n.holders.capacity(), size_of::<u32>())
            })
            .sum();
        let slots: usize = self
            .slots
            .iter()
            .map(|s| map(s.blocks.capacity(), size_of::<(u64, u32)>()))
            .sum();
        self.nodes.capacity() * size_of::<Node>()
            + self.free.capacity() * size_of::<u32>()
            + self.slots.capacity() * size_of::<Slot>()
            + map(self.slot_of.capacity(), size_of::<(WorkerKey, u32)>())
            + nodes
            + slots
    }

    fn slot_for(&mut self, key: WorkerKey) -> u32 {
        if let Some(&s) = self.slot_of.get(&key) {
            return s;
        }
        let s = self.slots.len() as u32;
        self.slots.push(Slot {
            key,
            blocks: FxHashMap::default(),
        });
        self.slot_of.insert(key, s);
        s
    }

    fn alloc(&mut self, parent: u32, local: u64) -> u32 {
        match self.free.pop() {
            Some(n) => {
                self.nodes[n as usize] = Node::new(parent, local);
                n
            }
            None => {
                self.nodes.push(Node::new(parent, local));
                (self.nodes.len() - 1) as u32
            }
        }
    }

    /// Applies one event; `false` when it was refused or left out.
    pub fn apply(&mut self, event: &KvEvent) -> bool {
        if event.tier != Tier::Device {
            self.counters.ignored_tier += 1;
            return false;
        }
        let slot = self.slot_for(event.key);
        match &event.data {
            KvEventData::Stored { parent, blocks } => {
                let at = match parent {
                    None => ROOT,
                    Some(e) => match self.slots[slot as usize].blocks.get(&e.0) {
                        Some(&n) => n,
                        None => {
                            self.counters.refused_missing_parent += 1;
                            return false;
                        }
                    },
                };
                self.store(slot, at, blocks);
            }
            KvEventData::Removed { engine_hashes } => {
                for e in engine_hashes {
                    if let Some(n) = self.slots[slot as usize].blocks.remove(&e.0) {
                        self.release(slot, n);
                    }
                }
            }
            KvEventData::Cleared => {
                let held = std::mem::take(&mut self.slots[slot as usize].blocks);
                for (_, n) in held {
                    self.release(slot, n);
                }
            }
        }
        true
    }

    fn store(&mut self, slot: u32, mut at: u32, blocks: &[StoredBlock]) {
        for b in blocks {
            let local = b.local_hash.0;
            let child = match self.nodes[at as usize].children.get(&local) {
                Some(&c) => c,
                None => {
                    let c = self.alloc(at, local);
                    self.nodes[at as usize].children.insert(local, c);
                    c
                }
            };
            if self.nodes[child as usize].holders.insert(slot) {
                self.live_pairs += 1;
            }
            match self.slots[slot as usize]
                .blocks
                .insert(b.engine_hash.0, child)
            {
                // The engine hash named another block: that one is no longer held by it.
                Some(old) if old != child => self.release(slot, old),
                _ => {}
            }
            at = child;
        }
    }

    fn release(&mut self, slot: u32, mut n: u32) {
        if self.nodes[n as usize].holders.remove(&slot) {
            self.live_pairs -= 1;
        }
        while n != ROOT {
            let node = &self.nodes[n as usize];
            if !node.holders.is_empty() || !node.children.is_empty() {
                return;
            }
            let (parent, local) = (node.parent, node.local);
            self.nodes[parent as usize].children.remove(&local);
            // Free the node's maps, as dropping an `Rc` node would.
            self.nodes[n as usize] = Node::new(ROOT, 0);
            self.free.push(n);
            n = parent;
        }
    }

    /// Every worker key holding the query's first block, with how many leading blocks it
    /// holds, in no particular order.
    pub fn find_matches(&self, query: &[LocalBlockHash], out: &mut Vec<(WorkerKey, u32)>) {
        out.clear();
        let mut active: Vec<u32> = Vec::new();
        let mut node = ROOT;
        let mut depth = 0u32;
        for (i, l) in query.iter().enumerate() {
            let Some(&c) = self.nodes[node as usize].children.get(&l.0) else {
                break;
            };
            let holders = &self.nodes[c as usize].holders;
            if i == 0 {
                active.extend(holders.iter().copied());
            } else {
                active.retain(|s| {
                    let keep = holders.contains(s);
                    if !keep {
                        out.push((self.slots[*s as usize].key, i as u32));
                    }
                    keep
                });
            }
            if active.is_empty() {
                return;
            }
            node = c;
            depth = i as u32 + 1;
        }
        out.extend(active.iter().map(|&s| (self.slots[s as usize].key, depth)));
    }

    /// The largest overlap of any worker key (0 when none matched).
    pub fn best(&self, query: &[LocalBlockHash], scratch: &mut Vec<(WorkerKey, u32)>) -> u32 {
        self.find_matches(query, scratch);
        scratch.iter().map(|&(_, n)| n).max().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrouter_indexer::Index;
    use kvrouter_protocol::hashing::chain_sequence_hash;
    use kvrouter_protocol::{EngineBlockHash, SequenceHash};
    use proptest::prelude::*;

    fn key(w: u64) -> WorkerKey {
        WorkerKey::new(w, 0)
    }

    fn stored(w: u64, id: u64, parent: Option<u64>, blocks: &[(u64, u64)]) -> KvEvent {
        KvEvent {
            tier: Tier::Device,
            key: key(w),
            event_id: id,
            data: KvEventData::Stored {
                parent: parent.map(EngineBlockHash),
                blocks: blocks
                    .iter()
                    .map(|&(e, l)| StoredBlock {
                        engine_hash: EngineBlockHash(e),
                        local_hash: LocalBlockHash(l),
                    })
                    .collect(),
            },
        }
    }

    fn removed(w: u64, id: u64, hashes: &[u64]) -> KvEvent {
        KvEvent {
            tier: Tier::Device,
            key: key(w),
            event_id: id,
            data: KvEventData::Removed {
                engine_hashes: hashes.iter().copied().map(EngineBlockHash).collect(),
            },
        }
    }

    fn matches(r: &RadixRuler, q: &[u64]) -> Vec<(WorkerKey, u32)> {
        let q: Vec<LocalBlockHash> = q.iter().copied().map(LocalBlockHash).collect();
        let mut out = vec![];
        r.find_matches(&q, &mut out);
        out.sort_unstable();
        out
    }

    #[test]
    fn store_lookup_remove_and_cascade_free() {
        let mut r = RadixRuler::new();
        // worker 0: a-b-c; worker 1: a-b-d
        assert!(r.apply(&stored(0, 0, None, &[(10, 1), (11, 2), (12, 3)])));
        assert!(r.apply(&stored(1, 0, None, &[(20, 1)])));
        assert!(r.apply(&stored(1, 1, Some(20), &[(21, 2), (22, 4)])));
        assert_eq!(r.live_pairs(), 6);
        assert_eq!(r.live_nodes(), 4);
        assert_eq!(matches(&r, &[1, 2, 3]), vec![(key(0), 3), (key(1), 2)]);
        assert_eq!(matches(&r, &[1, 2, 4, 9]), vec![(key(0), 2), (key(1), 3)]);
        assert_eq!(matches(&r, &[2]), vec![]);
        assert_eq!(matches(&r, &[]), vec![]);

        // an unknown parent is refused
        assert!(!r.apply(&stored(0, 1, Some(99), &[(13, 5)])));
        assert_eq!(r.counters().refused_missing_parent, 1);

        // worker 0 drops its middle block: the node stays (it has a child), the hole stops
        // worker 0's overlap at 1; the leaf c is still held
        r.apply(&removed(0, 2, &[11]));
        assert_eq!(r.live_pairs(), 5);
        assert_eq!(r.live_nodes(), 4);
        assert_eq!(matches(&r, &[1, 2, 3]), vec![(key(0), 1), (key(1), 2)]);
        // re-storing the middle makes the leaf count again
        r.apply(&stored(0, 3, Some(10), &[(11, 2)]));
        assert_eq!(matches(&r, &[1, 2, 3]), vec![(key(0), 3), (key(1), 2)]);

        // worker 1 removes d then b: d is freed; b stays (worker 0 holds it)
        r.apply(&removed(1, 2, &[22, 21]));
        assert_eq!(r.live_nodes(), 3);
        // worker 0 clears: c, b freed; a still held by worker 1
        r.apply(&KvEvent {
            tier: Tier::Device,
            key: key(0),
            event_id: 4,
            data: KvEventData::Cleared,
        });
        assert_eq!(r.live_pairs(), 1);
        assert_eq!(r.live_nodes(), 1);
        assert_eq!(matches(&r, &[1, 2, 3]), vec![(key(1), 1)]);
        // the last holder goes: the tree is empty and the freed nodes are reused
        r.apply(&removed(1, 3, &[20]));
        assert_eq!((r.live_pairs(), r.live_nodes()), (0, 0));
        assert!(r.nodes[ROOT as usize].children.is_empty());
        r.apply(&stored(1, 4, None, &[(30, 7), (31, 8)]));
        assert_eq!(r.live_nodes(), 2);
        assert_eq!(r.nodes.len(), 5, "freed slots were reused");
        assert_eq!(matches(&r, &[7, 8]), vec![(key(1), 2)]);
    }

    #[test]
    fn a_freed_leaf_frees_holderless_ancestors() {
        let mut r = RadixRuler::new();
        r.apply(&stored(0, 0, None, &[(1, 1), (2, 2), (3, 3)]));
        // remove the root-side blocks first: they stay as holder-less interior nodes
        r.apply(&removed(0, 1, &[1, 2]));
        assert_eq!(r.live_nodes(), 3);
        assert_eq!(matches(&r, &[1, 2, 3]), vec![]);
        // removing the leaf frees all three
        r.apply(&removed(0, 2, &[3]));
        assert_eq!(r.live_nodes(), 0);
    }

    #[test]
    fn non_device_events_are_left_out() {
        let mut r = RadixRuler::new();
        let mut ev = stored(0, 0, None, &[(1, 1)]);
        ev.tier = Tier::Host;
        assert!(!r.apply(&ev));
        assert_eq!(r.counters().ignored_tier, 1);
        assert_eq!(r.live_pairs(), 0);
    }

    /// One step of a random stream: a worker stores a chain of local hashes (from the root or
    /// under a prefix it may hold), removes some of what it stored, or clears.
    #[derive(Clone, Debug)]
    enum Step {
        Store {
            worker: u64,
            parent: Option<usize>,
            locals: Vec<u64>,
        },
        Remove {
            worker: u64,
            picks: Vec<usize>,
        },
        Clear {
            worker: u64,
        },
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            6 => (0..3u64, proptest::option::of(0..64usize), prop::collection::vec(1..4u64, 1..5))
                .prop_map(|(worker, parent, locals)| Step::Store { worker, parent, locals }),
            3 => (0..3u64, prop::collection::vec(0..64usize, 1..4))
                .prop_map(|(worker, picks)| Step::Remove { worker, picks }),
            1 => (0..3u64).prop_map(|worker| Step::Clear { worker }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// On the bench's own stream (LRU eviction per worker, K sub-blocks), every request's
        /// overlaps at the end equal the index's.
        #[test]
        fn overlaps_equal_the_index_on_the_bench_stream(
            requests in prop::collection::vec(prop::collection::vec(0..6u64, 0..6), 1..40),
            workers in 1..4u64,
            capacity in 8..24usize,
            sub_blocks in 1..3u64,
        ) {
            use crate::indexer_stream::{request_hashes, StreamBuilder, StreamConfig};
            let mut b = StreamBuilder::new(StreamConfig {
                workers,
                capacity_blocks: capacity,
                sub_blocks,
                engine_hash_salt: Some(0x5a),
            }).unwrap();
            let (mut index, mut ruler, mut events) = (Index::new(), RadixRuler::new(), vec![]);
            for r in &requests {
                // ids from a small alphabet, so requests share prefixes and diverge; a request
                // larger than the capacity is refused by the builder and left out
                if b.push_request(r, &mut events).is_err() { continue; }
            }
            for ev in &events {
                let _ = index.apply(ev);
                ruler.apply(ev);
            }
            prop_assert_eq!(index.stats().live_pairs, ruler.live_pairs());
            prop_assert_eq!(index.stats().live_blocks, ruler.live_nodes());
            let mut out = vec![];
            for (i, r) in requests.iter().enumerate() {
                let (q, _) = request_hashes(i as u64, r, sub_blocks).unwrap();
                ruler.find_matches(&q, &mut out);
                out.sort_unstable();
                prop_assert_eq!(&out, &index.find_matches(&q).sorted().scores);
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        /// On random streams (engine hash = sequence hash, as the bench's stream), every
        /// query's overlaps equal the index's, and so do the live pairs.
        #[test]
        fn overlaps_equal_the_index(
            steps in prop::collection::vec(step(), 1..40),
            queries in prop::collection::vec(prop::collection::vec(1..4u64, 0..7), 1..12),
        ) {
            let mut index = Index::new();
            let mut ruler = RadixRuler::new();
            // every sequence hash each worker ever stored, in order (parents and removals
            // pick from it, so some picks are no longer held)
            let mut seen: Vec<Vec<u64>> = vec![vec![]; 3];
            let mut ids = [0u64; 3];
            for s in steps {
                let ev = match s {
                    Step::Store { worker, parent, locals } => {
                        let w = worker as usize;
                        let parent = parent.and_then(|p| seen[w].get(p % seen[w].len().max(1)).copied());
                        let mut prev = parent.map(SequenceHash);
                        let blocks: Vec<(u64, u64)> = locals.iter().map(|&l| {
                            let s = match prev {
                                None => SequenceHash(l),
                                Some(p) => chain_sequence_hash(p, LocalBlockHash(l)),
                            };
                            prev = Some(s);
                            seen[w].push(s.0);
                            (s.0, l)
                        }).collect();
                        stored(worker, ids[w], parent, &blocks)
                    }
                    Step::Remove { worker, picks } => {
                        let w = worker as usize;
                        if seen[w].is_empty() { continue; }
                        let hashes: Vec<u64> = picks.iter().map(|p| seen[w][p % seen[w].len()]).collect();
                        removed(worker, ids[worker as usize], &hashes)
                    }
                    Step::Clear { worker } => KvEvent {
                        tier: Tier::Device,
                        key: key(worker),
                        event_id: ids[worker as usize],
                        data: KvEventData::Cleared,
                    },
                };
                ids[ev.key.worker_id as usize] += 1;
                let _ = index.apply(&ev);
                ruler.apply(&ev);
            }
            prop_assert_eq!(index.stats().live_pairs, ruler.live_pairs());
            prop_assert_eq!(
                index.stats().counters.rejected_missing_parent,
                ruler.counters().refused_missing_parent
            );
            for q in queries {
                let hashes: Vec<LocalBlockHash> = q.iter().copied().map(LocalBlockHash).collect();
                let want = index.find_matches(&hashes).sorted().scores;
                prop_assert_eq!(matches(&ruler, &q), want, "query {:?}", q);
            }
        }
    }
}

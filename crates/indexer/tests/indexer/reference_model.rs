//! The index against a brute-force reference model on random event streams.
//!
//! The model keeps, per worker key and tier, the set of held block prefixes (as vectors of
//! local hashes) and what each engine hash names, and one shared-storage pool; the device
//! overlap is the longest run of leading query prefixes all held on the device, and each
//! lower tier extends it to the longest run held in that tier or above.

use kvrouter_indexer::{Index, IndexError};
use kvrouter_protocol::{
    EngineBlockHash, KvEvent, KvEventData, LocalBlockHash, StoredBlock, Tier, TierBlocks, WorkerKey,
};
use proptest::prelude::*;
use std::collections::{BTreeMap, HashMap, HashSet};

/// What one tier of one rank (or the shared pool) holds.
#[derive(Default, Clone)]
struct ModelTier {
    aliases: HashMap<u64, Vec<u64>>,
    held: HashSet<Vec<u64>>,
}

impl ModelTier {
    fn prefix_of(&self, engine: u64) -> Option<&Vec<u64>> {
        self.aliases.get(&engine).filter(|p| self.held.contains(*p))
    }
}

#[derive(Default, Clone)]
struct ModelRank {
    /// Device, host, disk.
    tiers: [ModelTier; 3],
    last: Option<u64>,
}

#[derive(Default, Clone)]
struct IndexModel {
    ranks: BTreeMap<WorkerKey, ModelRank>,
    shared: ModelTier,
}

fn tier_no(t: Tier) -> usize {
    match t {
        Tier::Device => 0,
        Tier::Host => 1,
        Tier::Disk => 2,
        Tier::Shared => 3,
    }
}

impl IndexModel {
    /// Mirrors `Index::apply`; returns whether the event was accepted.
    fn apply(&mut self, ev: &KvEvent) -> bool {
        let rank = self.ranks.entry(ev.key).or_default();
        if let Some(last) = rank.last {
            if ev.event_id <= last {
                return false;
            }
        }
        rank.last = Some(ev.event_id);
        let t = tier_no(ev.tier);
        match &ev.data {
            KvEventData::Stored { parent, blocks } => {
                let mut prefix = match parent {
                    None => vec![],
                    // The parent: in the event's tier, else any tier of the rank, else shared.
                    Some(pe) => {
                        let found = [t, 0, 1, 2, 3].into_iter().find_map(|i| match i {
                            3 => self.shared.prefix_of(pe.0),
                            i => rank.tiers[i].prefix_of(pe.0),
                        });
                        match found {
                            Some(p) => p.clone(),
                            None => return false,
                        }
                    }
                };
                let tier = if t == 3 {
                    &mut self.shared
                } else {
                    &mut rank.tiers[t]
                };
                for b in blocks {
                    prefix.push(b.local_hash.0);
                    if let Some(old) = tier.aliases.insert(b.engine_hash.0, prefix.clone()) {
                        if old != prefix {
                            tier.held.remove(&old);
                        }
                    }
                    tier.held.insert(prefix.clone());
                }
            }
            KvEventData::Removed { engine_hashes } => {
                let tier = if t == 3 {
                    &mut self.shared
                } else {
                    &mut rank.tiers[t]
                };
                for e in engine_hashes {
                    if let Some(p) = tier.aliases.remove(&e.0) {
                        tier.held.remove(&p);
                    }
                }
            }
            KvEventData::Cleared => {
                // Every tier of the rank; the shared pool is no rank's.
                rank.tiers = Default::default();
            }
        }
        true
    }

    fn overlaps(&self, q: &[u64]) -> Vec<(WorkerKey, u32)> {
        let mut out = vec![];
        for k in self.ranks.keys() {
            let n = self.tier_blocks(*k, q, true).device;
            if n > 0 {
                out.push((*k, n));
            }
        }
        out
    }

    /// The spec: device prefix, then per lower tier the longest prefix held in it or above,
    /// minus what was counted. An unknown key holds nothing but shared storage.
    fn tier_blocks(&self, key: WorkerKey, q: &[u64], with_shared: bool) -> TierBlocks {
        let none = ModelRank::default();
        let rank = self.ranks.get(&key).unwrap_or(&none);
        let held_at_or_above = |j: usize, t: usize| {
            (0..=t.min(2)).any(|i| rank.tiers[i].held.contains(&q[..j]))
                || (t == 3 && with_shared && self.shared.held.contains(&q[..j]))
        };
        let prefix = |t: usize| {
            (1..=q.len())
                .take_while(|&j| held_at_or_above(j, t))
                .count()
        };
        let p: Vec<u32> = (0..4).map(|t| prefix(t) as u32).collect();
        TierBlocks {
            device: p[0],
            host: p[1] - p[0],
            disk: p[2] - p[1],
            shared: p[3] - p[2],
        }
    }

    fn live_pairs(&self) -> usize {
        self.ranks.values().map(|r| r.tiers[0].held.len()).sum()
    }
}

#[derive(Clone, Debug)]
enum IdMode {
    Next,
    Duplicate,
    Gap,
}

#[derive(Clone, Debug)]
enum IndexOp {
    Event(WorkerKey, IdMode, Tier, KvEventData),
    RemoveWorker(u64),
    RemoveRank(WorkerKey),
}

fn arb_key() -> impl Strategy<Value = WorkerKey> {
    (0u64..3, 0u32..2).prop_map(|(w, r)| WorkerKey::new(w, r))
}

fn arb_data() -> impl Strategy<Value = KvEventData> {
    let block = (0u64..12, 0u64..4).prop_map(|(e, l)| StoredBlock {
        engine_hash: EngineBlockHash(e),
        local_hash: LocalBlockHash(l),
    });
    prop_oneof![
        8 => (proptest::option::of(0u64..12), prop::collection::vec(block, 1..5)).prop_map(
            |(p, blocks)| KvEventData::Stored { parent: p.map(EngineBlockHash), blocks }
        ),
        3 => prop::collection::vec(0u64..12, 1..4).prop_map(|h| KvEventData::Removed {
            engine_hashes: h.into_iter().map(EngineBlockHash).collect()
        }),
        1 => Just(KvEventData::Cleared),
    ]
}

fn arb_op(tiers: bool) -> impl Strategy<Value = IndexOp> {
    let mode =
        prop_oneof![12 => Just(IdMode::Next), 1 => Just(IdMode::Duplicate), 1 => Just(IdMode::Gap)];
    let tier = if tiers {
        prop_oneof![6 => Just(Tier::Device), 3 => Just(Tier::Host), 2 => Just(Tier::Disk), 1 => Just(Tier::Shared)].boxed()
    } else {
        Just(Tier::Device).boxed()
    };
    // Engines name a block by its content, so one engine hash names one block in whichever
    // tier of a rank it is: each tier's hashes get their own range, and a parent may be in
    // any tier (`parent_tier`).
    let parent_tier = if tiers {
        (0u64..4).boxed()
    } else {
        Just(0u64).boxed()
    };
    let event = (arb_key(), mode, tier, arb_data(), parent_tier).prop_map(|(k, m, t, d, pt)| {
        let off = |e: EngineBlockHash, tier: u64| EngineBlockHash(e.0 + 100 * tier);
        let own = tier_no(t) as u64;
        let d = match d {
            KvEventData::Stored { parent, blocks } => KvEventData::Stored {
                parent: parent.map(|p| off(p, pt)),
                blocks: blocks
                    .into_iter()
                    .map(|b| StoredBlock {
                        engine_hash: off(b.engine_hash, own),
                        ..b
                    })
                    .collect(),
            },
            KvEventData::Removed { engine_hashes } => KvEventData::Removed {
                engine_hashes: engine_hashes.into_iter().map(|e| off(e, own)).collect(),
            },
            KvEventData::Cleared => KvEventData::Cleared,
        };
        IndexOp::Event(k, m, t, d)
    });
    prop_oneof![
        20 => event,
        1 => (0u64..3).prop_map(IndexOp::RemoveWorker),
        1 => arb_key().prop_map(IndexOp::RemoveRank),
    ]
}

fn arb_queries() -> impl Strategy<Value = Vec<Vec<u64>>> {
    prop::collection::vec(prop::collection::vec(0u64..4, 1..7), 12)
}

fn locals(q: &[u64]) -> Vec<LocalBlockHash> {
    q.iter().copied().map(LocalBlockHash).collect()
}

/// A one-to-one mapping of engine hashes.
fn remap(e: u64) -> u64 {
    e.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xA5A5_0000_FFFF_1234
}

fn remap_data(d: &KvEventData) -> KvEventData {
    match d {
        KvEventData::Stored { parent, blocks } => KvEventData::Stored {
            parent: parent.map(|p| EngineBlockHash(remap(p.0))),
            blocks: blocks
                .iter()
                .map(|b| StoredBlock {
                    engine_hash: EngineBlockHash(remap(b.engine_hash.0)),
                    local_hash: b.local_hash,
                })
                .collect(),
        },
        KvEventData::Removed { engine_hashes } => KvEventData::Removed {
            engine_hashes: engine_hashes
                .iter()
                .map(|e| EngineBlockHash(remap(e.0)))
                .collect(),
        },
        KvEventData::Cleared => KvEventData::Cleared,
    }
}

fn rebuild(index: &Index) -> Index {
    let mut fresh = Index::new();
    let mut keys: Vec<_> = index.worker_keys().collect();
    keys.sort();
    for k in keys {
        let dump = index.dump(k).expect("known key dumps");
        assert_eq!(dump.last_event_id, index.last_event_id(k));
        fresh.load_rank(&dump).expect("a dump loads cleanly");
    }
    fresh
}

/// Ranks that hold one block no query matches: with 61 of them, the ranks under test take
/// slots 61 and up, past the inline holder mask (single-slot and spilled holder sets).
fn with_fillers(fillers: u64) -> Index {
    let mut index = Index::new();
    for f in 0..fillers {
        index
            .apply(&KvEvent {
                tier: Tier::Device,
                key: WorkerKey::new(1000 + f, 0),
                event_id: 0,
                data: KvEventData::Stored {
                    parent: None,
                    blocks: vec![StoredBlock {
                        engine_hash: EngineBlockHash(f),
                        local_hash: LocalBlockHash(1000 + f),
                    }],
                },
            })
            .unwrap();
    }
    index
}

fn check_against_model(
    ops: &[IndexOp],
    queries: &[Vec<u64>],
    fillers: u64,
) -> Result<(), TestCaseError> {
    let mut index = with_fillers(fillers);
    let mut remapped = with_fillers(fillers);
    let mut model = IndexModel::default();
    for op in ops {
        match op {
            IndexOp::Event(key, mode, tier, data) => {
                let last = model.ranks.get(key).and_then(|r| r.last);
                let event_id = match (mode, last) {
                    (_, None) => 0,
                    (IdMode::Next, Some(l)) => l + 1,
                    (IdMode::Duplicate, Some(l)) => l,
                    (IdMode::Gap, Some(l)) => l + 2,
                };
                let ev = KvEvent {
                    tier: *tier,
                    key: *key,
                    event_id,
                    data: data.clone(),
                };
                let accepted = model.apply(&ev);
                let result = index.apply(&ev);
                prop_assert_eq!(accepted, result.is_ok(), "event {:?}: {:?}", ev, result);
                if let (IdMode::Gap, Some(_), Ok(applied)) = (mode, last, &result) {
                    prop_assert_eq!(applied.gap, 1);
                }
                if let Err(IndexError::StaleEvent { .. }) = result {
                    prop_assert!(matches!(mode, IdMode::Duplicate));
                }
                let ev2 = KvEvent {
                    data: remap_data(data),
                    ..ev
                };
                prop_assert_eq!(remapped.apply(&ev2).is_ok(), accepted);
            }
            IndexOp::RemoveWorker(id) => {
                model.ranks.retain(|k, _| k.worker_id != *id);
                index.remove_worker(*id);
                remapped.remove_worker(*id);
            }
            IndexOp::RemoveRank(key) => {
                model.ranks.remove(key);
                index.remove_worker_rank(*key);
                remapped.remove_worker_rank(*key);
            }
        }
        prop_assert_eq!(
            index.stats().live_pairs,
            model.live_pairs() + fillers as usize
        );
        let rebuilt = rebuild(&index);
        for q in queries {
            let want = model.overlaps(q);
            let got = index.find_matches(&locals(q)).sorted();
            prop_assert_eq!(&got.scores, &want, "query {:?}", q);
            let remapped_got = remapped.find_matches(&locals(q)).sorted();
            prop_assert_eq!(&remapped_got, &got);
            let rebuilt_got = rebuilt.find_matches(&locals(q)).sorted();
            prop_assert_eq!(&rebuilt_got.scores, &want);
            let shared_alone = model.tier_blocks(WorkerKey::new(999, 0), q, true).shared;
            prop_assert_eq!(got.shared_blocks, shared_alone, "query {:?}", q);
            for k in model.ranks.keys().copied().chain([WorkerKey::new(999, 0)]) {
                prop_assert_eq!(
                    got.tier_blocks(k),
                    model.tier_blocks(k, q, true),
                    "{} query {:?}",
                    k,
                    q
                );
                // Dumps carry a rank's tiers, not shared storage (no rank's).
                prop_assert_eq!(
                    rebuilt_got.tier_blocks(k),
                    model.tier_blocks(k, q, false),
                    "rebuilt {} query {:?}",
                    k,
                    q
                );
            }
            // Listed keys are known ones, or fillers that only shared storage reaches.
            for (k, t) in &got.tiers {
                prop_assert!(
                    model.ranks.contains_key(k)
                        || (k.worker_id >= 1000
                            && *t
                                == TierBlocks {
                                    shared: shared_alone,
                                    ..TierBlocks::default()
                                }),
                    "{} {:?}",
                    k,
                    t
                );
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    #[test]
    fn index_matches_reference_model(ops in prop::collection::vec(arb_op(false), 1..80), queries in arb_queries()) {
        check_against_model(&ops, &queries, 0)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    /// Events for host, disk and shared storage too.
    #[test]
    fn tiered_index_matches_reference_model(ops in prop::collection::vec(arb_op(true), 1..80), queries in arb_queries()) {
        check_against_model(&ops, &queries, 0)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// The same with the ranks under test in high slots (a fleet of more than 62 ranks).
    #[test]
    fn index_matches_reference_model_in_high_slots(ops in prop::collection::vec(arb_op(true), 1..80), queries in arb_queries()) {
        check_against_model(&ops, &queries, 61)?;
    }
}

/// Local hash of block `j` of conversation `c`: the first 40 blocks are a system prompt all
/// conversations share.
fn conv_local(c: u64, j: u64) -> u64 {
    if j < 40 {
        j
    } else {
        1000 * (c + 1) + j
    }
}

/// Engines name a block by its content: the same block has the same engine hash everywhere.
fn conv_engine(c: u64, j: u64) -> EngineBlockHash {
    EngineBlockHash(conv_local(c, j) * 7 + 3)
}

/// Long, shared, growing conversations: runs fill up, branch mid-run, lose tails and middles
/// and come back.
fn arb_long_op() -> impl Strategy<Value = IndexOp> {
    let key = (0u64..3).prop_map(|w| WorkerKey::new(w, 0));
    let stored = (key.clone(), 0u64..3, 0u64..150, 1u64..150).prop_map(|(k, c, from, len)| {
        let to = (from + len).min(150);
        let data = KvEventData::Stored {
            parent: (from > 0).then(|| conv_engine(c, from - 1)),
            blocks: (from..to)
                .map(|j| StoredBlock {
                    engine_hash: conv_engine(c, j),
                    local_hash: LocalBlockHash(conv_local(c, j)),
                })
                .collect(),
        };
        IndexOp::Event(k, IdMode::Next, Tier::Device, data)
    });
    let removed = (key, 0u64..3, 0u64..150, 1u64..80).prop_map(|(k, c, from, len)| {
        let data = KvEventData::Removed {
            engine_hashes: (from..(from + len).min(150))
                .map(|j| conv_engine(c, j))
                .collect(),
        };
        IndexOp::Event(k, IdMode::Next, Tier::Device, data)
    });
    prop_oneof![6 => stored, 3 => removed, 1 => (0u64..3).prop_map(IndexOp::RemoveWorker)]
}

fn arb_long_queries() -> impl Strategy<Value = Vec<Vec<u64>>> {
    prop::collection::vec(
        (0u64..3, 1u64..160).prop_map(|(c, n)| (0..n).map(|j| conv_local(c, j)).collect()),
        6,
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Chains longer than a run of blocks (64), shared by ranks and cut anywhere.
    #[test]
    fn long_chains_match_reference_model(ops in prop::collection::vec(arb_long_op(), 1..40), queries in arb_long_queries()) {
        check_against_model(&ops, &queries, 0)?;
    }
}

#[test]
fn gaps_raise_recovery_and_stale_events_are_counted() {
    let mut index = Index::new();
    let k = WorkerKey::new(5, 0);
    let stored = |id, parent: Option<u64>, e, l| KvEvent {
        tier: Tier::Device,
        key: k,
        event_id: id,
        data: KvEventData::Stored {
            parent: parent.map(EngineBlockHash),
            blocks: vec![StoredBlock {
                engine_hash: EngineBlockHash(e),
                local_hash: LocalBlockHash(l),
            }],
        },
    };
    // the first id seen sets the start, whatever it is
    index.apply(&stored(40, None, 1, 10)).unwrap();
    assert!(index.take_needs_recovery().is_empty());
    assert!(matches!(
        index.apply(&stored(40, None, 2, 20)),
        Err(IndexError::StaleEvent { last: 40, .. })
    ));
    let applied = index.apply(&stored(43, Some(1), 3, 30)).unwrap();
    assert_eq!(applied.gap, 2);
    assert_eq!(index.take_needs_recovery(), vec![k]);
    assert!(index.take_needs_recovery().is_empty());
    let c = index.stats().counters;
    assert_eq!((c.stale_events, c.gaps), (1, 1));
    assert_eq!(index.find_matches(&locals(&[10, 30])).get(k), 2);
}

#[test]
fn refused_events_leave_the_index_unchanged() {
    let mut index = Index::new();
    let k = WorkerKey::new(1, 0);
    let ev = |id, parent: Option<u64>, blocks: &[(u64, u64)]| KvEvent {
        tier: Tier::Device,
        key: k,
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
    };
    index.set_block_limit(1, Some(3));
    index.apply(&ev(0, None, &[(1, 1), (2, 2)])).unwrap();
    let before = index.stats();
    // unknown parent: refused whole
    assert!(matches!(
        index.apply(&ev(1, Some(99), &[(3, 3)])),
        Err(IndexError::MissingParent { .. })
    ));
    // over the limit: refused whole
    assert!(matches!(
        index.apply(&ev(2, Some(2), &[(3, 3), (4, 4)])),
        Err(IndexError::BlockLimit {
            held: 2,
            adding: 2,
            limit: 3,
            ..
        })
    ));
    assert_eq!(index.stats().live_pairs, before.live_pairs);
    assert_eq!(index.find_matches(&locals(&[1, 2, 3, 4])).get(k), 2);
    // within the limit it goes through
    index.apply(&ev(3, Some(2), &[(3, 3)])).unwrap();
    assert_eq!(index.find_matches(&locals(&[1, 2, 3, 4])).get(k), 3);
    // Removed: held blocks go, unknown ones are skipped and counted
    let applied = index
        .apply(&KvEvent {
            tier: Tier::Device,
            key: k,
            event_id: 4,
            data: KvEventData::Removed {
                engine_hashes: vec![EngineBlockHash(3), EngineBlockHash(77)],
            },
        })
        .unwrap();
    assert_eq!((applied.removed, applied.skipped), (1, 1));
    let c = index.stats().counters;
    assert_eq!((c.rejected_missing_parent, c.rejected_block_limit), (1, 1));
}

#[test]
fn cleared_drops_only_that_rank_and_many_ranks_spill_correctly() {
    // 100 ranks exercise holder sets beyond the inline mask.
    let mut index = Index::new();
    for w in 0..100u64 {
        let depth = 1 + (w % 4) as usize;
        index
            .apply(&KvEvent {
                tier: Tier::Device,
                key: WorkerKey::new(w, 0),
                event_id: 0,
                data: KvEventData::Stored {
                    parent: None,
                    blocks: (0..depth)
                        .map(|i| StoredBlock {
                            engine_hash: EngineBlockHash(1000 * w + i as u64),
                            local_hash: LocalBlockHash(i as u64),
                        })
                        .collect(),
                },
            })
            .unwrap();
    }
    let q = locals(&[0, 1, 2, 3]);
    let scores = index.find_matches(&q);
    assert_eq!(scores.scores.len(), 100);
    for w in 0..100u64 {
        assert_eq!(scores.get(WorkerKey::new(w, 0)), 1 + (w % 4) as u32);
    }
    index
        .apply(&KvEvent {
            tier: Tier::Device,
            key: WorkerKey::new(70, 0),
            event_id: 1,
            data: KvEventData::Cleared,
        })
        .unwrap();
    let scores = index.find_matches(&q);
    assert_eq!(scores.scores.len(), 99);
    assert_eq!(scores.get(WorkerKey::new(70, 0)), 0);
    assert_eq!(scores.get(WorkerKey::new(71, 0)), 4);
    assert_eq!(index.remove_worker(71), 1);
    assert_eq!(index.find_matches(&q).get(WorkerKey::new(71, 0)), 0);
    assert_eq!(index.stats().worker_keys, 99);
}

#[test]
fn lower_tier_limits_refuse_and_offloaded_blocks_keep_their_local_hash() {
    let mut index = Index::new();
    let k = WorkerKey::new(1, 0);
    let ev = |id, tier, blocks: &[(u64, u64)]| KvEvent {
        key: k,
        event_id: id,
        tier,
        data: KvEventData::Stored {
            parent: None,
            blocks: blocks
                .iter()
                .map(|&(e, l)| StoredBlock {
                    engine_hash: EngineBlockHash(e),
                    local_hash: LocalBlockHash(l),
                })
                .collect(),
        },
    };
    index.set_tier_block_limit(1, Tier::Host, Some(2));
    index
        .apply(&ev(0, Tier::Host, &[(1, 10), (2, 20)]))
        .unwrap();
    assert!(matches!(
        index.apply(&ev(1, Tier::Host, &[(3, 30)])),
        Err(IndexError::BlockLimit { limit: 2, .. })
    ));
    // The device has no limit of its own here, and the host one does not apply to it.
    index.apply(&ev(2, Tier::Device, &[(3, 30)])).unwrap();
    // A block held only in host memory still names its local hash.
    assert_eq!(
        index.local_hash(k, EngineBlockHash(2)),
        Some(LocalBlockHash(20))
    );
    let m = index.find_matches(&locals(&[10, 20]));
    assert_eq!(
        m.tier_blocks(k),
        TierBlocks {
            host: 2,
            ..TierBlocks::default()
        }
    );
    // Cleared clears every tier of the rank.
    index
        .apply(&KvEvent {
            key: k,
            event_id: 3,
            tier: Tier::Device,
            data: KvEventData::Cleared,
        })
        .unwrap();
    assert!(index.find_matches(&locals(&[10, 20])).is_empty());
    assert_eq!(index.local_hash(k, EngineBlockHash(2)), None);
}

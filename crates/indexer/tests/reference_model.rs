//! The index against a brute-force reference model on random event streams.
//!
//! The model keeps, per worker key, the set of held block prefixes (as vectors of local
//! hashes) and what each engine hash names; overlap is the longest run of leading query
//! prefixes all held.

use kvrouter_indexer::{Index, IndexError};
use kvrouter_protocol::{
    EngineBlockHash, KvEvent, KvEventData, LocalBlockHash, StoredBlock, WorkerKey,
};
use proptest::prelude::*;
use std::collections::{BTreeMap, HashMap, HashSet};

#[derive(Default, Clone)]
struct ModelRank {
    aliases: HashMap<u64, Vec<u64>>,
    held: HashSet<Vec<u64>>,
    last: Option<u64>,
}

#[derive(Default, Clone)]
struct Model {
    ranks: BTreeMap<WorkerKey, ModelRank>,
}

impl Model {
    /// Mirrors `Index::apply`; returns whether the event was accepted.
    fn apply(&mut self, ev: &KvEvent) -> bool {
        let rank = self.ranks.entry(ev.key).or_default();
        if let Some(last) = rank.last {
            if ev.event_id <= last {
                return false;
            }
        }
        rank.last = Some(ev.event_id);
        match &ev.data {
            KvEventData::Stored { parent, blocks } => {
                let mut prefix = match parent {
                    None => vec![],
                    Some(pe) => match rank.aliases.get(&pe.0) {
                        Some(p) if rank.held.contains(p) => p.clone(),
                        _ => return false,
                    },
                };
                for b in blocks {
                    prefix.push(b.local_hash.0);
                    if let Some(old) = rank.aliases.insert(b.engine_hash.0, prefix.clone()) {
                        if old != prefix {
                            rank.held.remove(&old);
                        }
                    }
                    rank.held.insert(prefix.clone());
                }
            }
            KvEventData::Removed { engine_hashes } => {
                for e in engine_hashes {
                    if let Some(p) = rank.aliases.remove(&e.0) {
                        rank.held.remove(&p);
                    }
                }
            }
            KvEventData::Cleared => {
                rank.aliases.clear();
                rank.held.clear();
            }
        }
        true
    }

    fn overlaps(&self, q: &[u64]) -> Vec<(WorkerKey, u32)> {
        let mut out = vec![];
        for (k, r) in &self.ranks {
            let n = (1..=q.len())
                .take_while(|&j| r.held.contains(&q[..j]))
                .count();
            if n > 0 {
                out.push((*k, n as u32));
            }
        }
        out
    }

    fn live_pairs(&self) -> usize {
        self.ranks.values().map(|r| r.held.len()).sum()
    }
}

#[derive(Clone, Debug)]
enum IdMode {
    Next,
    Duplicate,
    Gap,
}

#[derive(Clone, Debug)]
enum Op {
    Event(WorkerKey, IdMode, KvEventData),
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

fn arb_op() -> impl Strategy<Value = Op> {
    let mode =
        prop_oneof![12 => Just(IdMode::Next), 1 => Just(IdMode::Duplicate), 1 => Just(IdMode::Gap)];
    prop_oneof![
        20 => (arb_key(), mode, arb_data()).prop_map(|(k, m, d)| Op::Event(k, m, d)),
        1 => (0u64..3).prop_map(Op::RemoveWorker),
        1 => arb_key().prop_map(Op::RemoveRank),
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
    ops: &[Op],
    queries: &[Vec<u64>],
    fillers: u64,
) -> Result<(), TestCaseError> {
    let mut index = with_fillers(fillers);
    let mut remapped = with_fillers(fillers);
    let mut model = Model::default();
    for op in ops {
        match op {
            Op::Event(key, mode, data) => {
                let last = model.ranks.get(key).and_then(|r| r.last);
                let event_id = match (mode, last) {
                    (_, None) => 0,
                    (IdMode::Next, Some(l)) => l + 1,
                    (IdMode::Duplicate, Some(l)) => l,
                    (IdMode::Gap, Some(l)) => l + 2,
                };
                let ev = KvEvent {
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
            Op::RemoveWorker(id) => {
                model.ranks.retain(|k, _| k.worker_id != *id);
                index.remove_worker(*id);
                remapped.remove_worker(*id);
            }
            Op::RemoveRank(key) => {
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
            let got = index.find_matches(&locals(q)).sorted().scores;
            prop_assert_eq!(&got, &want, "query {:?}", q);
            prop_assert_eq!(&remapped.find_matches(&locals(q)).sorted().scores, &want);
            prop_assert_eq!(&rebuilt.find_matches(&locals(q)).sorted().scores, &want);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    #[test]
    fn index_matches_reference_model(ops in prop::collection::vec(arb_op(), 1..80), queries in arb_queries()) {
        check_against_model(&ops, &queries, 0)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// The same with the ranks under test in high slots (a fleet of more than 62 ranks).
    #[test]
    fn index_matches_reference_model_in_high_slots(ops in prop::collection::vec(arb_op(), 1..80), queries in arb_queries()) {
        check_against_model(&ops, &queries, 61)?;
    }
}

#[test]
fn gaps_raise_recovery_and_stale_events_are_counted() {
    let mut index = Index::new();
    let k = WorkerKey::new(5, 0);
    let stored = |id, parent: Option<u64>, e, l| KvEvent {
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

//! Shard actors: assignment, removal routing, approximate mode, and the read path.

use kvrouter_indexer::{ApproxConfig, Index, ShardedIndex, ShardedIndexConfig};
use kvrouter_protocol::{
    local_block_hashes, sequence_hashes, EngineBlockHash, KvEvent, KvEventData, LocalBlockHash,
    StoredBlock, Tier, WorkerKey,
};
use std::time::Duration;

fn chain_event(key: WorkerKey, event_id: u64, locals: &[u64], salt: u64) -> KvEvent {
    KvEvent {
        tier: Tier::Device,
        key,
        event_id,
        data: KvEventData::Stored {
            parent: None,
            blocks: locals
                .iter()
                .enumerate()
                .map(|(i, &l)| StoredBlock {
                    engine_hash: EngineBlockHash(salt + i as u64),
                    local_hash: LocalBlockHash(l),
                })
                .collect(),
        },
    }
}

fn q(v: &[u64]) -> Vec<LocalBlockHash> {
    v.iter().copied().map(LocalBlockHash).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lookup_after_the_acknowledgement_sees_the_event() {
    let index = ShardedIndex::start(ShardedIndexConfig {
        shards: 3,
        ..Default::default()
    })
    .await
    .unwrap();
    let reader = index.reader();
    // Every iteration stores a new block on top of the last and looks it up at once.
    let key = WorkerKey::new(9, 2);
    let mut chain = vec![];
    for i in 0..200u64 {
        chain.push(i * 7 + 1);
        let ev = KvEvent {
            tier: Tier::Device,
            key,
            event_id: i,
            data: KvEventData::Stored {
                parent: (i > 0).then(|| EngineBlockHash(i - 1)),
                blocks: vec![StoredBlock {
                    engine_hash: EngineBlockHash(i),
                    local_hash: LocalBlockHash(*chain.last().unwrap()),
                }],
            },
        };
        index.apply_and_wait(vec![ev]).await.unwrap();
        assert_eq!(reader.find_matches(&q(&chain)).get(key), chain.len() as u32);
    }
    assert_eq!(reader.held_blocks(key), 200);
    assert_eq!(reader.held_blocks(WorkerKey::new(9, 3)), 0);
    index.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_spread_over_shards_keep_them_and_removal_reaches_them() {
    let index = ShardedIndex::start(ShardedIndexConfig {
        shards: 4,
        ..Default::default()
    })
    .await
    .unwrap();
    let mut events = vec![];
    for w in 0..8u64 {
        for r in 0..2u32 {
            events.push(chain_event(
                WorkerKey::new(w, r),
                0,
                &[1, 2, 3][..1 + (w as usize % 3)],
                100 * w,
            ));
        }
    }
    index.apply_and_wait(events).await.unwrap();
    // all ranks of a worker share a shard; 8 workers over 4 shards: two each
    let mut per_shard = [0; 4];
    for w in 0..8u64 {
        per_shard[index.assigned_shard(w).unwrap()] += 1;
    }
    assert_eq!(per_shard, [2, 2, 2, 2]);
    let scores = index.find_matches(&q(&[1, 2, 3]));
    assert_eq!(scores.scores.len(), 16);
    assert_eq!(scores.get(WorkerKey::new(5, 1)), 3);
    // a new worker goes to the shard with the fewest live blocks
    let shard_sizes: Vec<usize> = (0..4)
        .map(|s| {
            (0..8u64)
                .filter(|&w| index.assigned_shard(w) == Some(s))
                .map(|w| 1 + w as usize % 3)
                .sum()
        })
        .collect();
    let lightest = (0..4).min_by_key(|&s| (shard_sizes[s], s)).unwrap();
    assert_eq!(index.shard_of(100), lightest);
    index.remove_worker_rank(WorkerKey::new(5, 1)).unwrap();
    index.remove_worker(2).unwrap();
    index.flush().await.unwrap();
    let scores = index.find_matches(&q(&[1, 2, 3]));
    assert_eq!(scores.get(WorkerKey::new(5, 1)), 0);
    assert_eq!(scores.get(WorkerKey::new(5, 0)), 3);
    assert_eq!(scores.get(WorkerKey::new(2, 0)), 0);
    assert_eq!(scores.scores.len(), 13);
    assert_eq!(index.assigned_shard(2), None);
    // dump and reload through the actors
    let dump = index.dump(WorkerKey::new(5, 0)).await.unwrap().unwrap();
    let mut plain = Index::new();
    plain.load_rank(&dump).unwrap();
    assert_eq!(
        plain.find_matches(&q(&[1, 2, 3])).get(WorkerKey::new(5, 0)),
        3
    );
    index.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_decisions_assign_shards_and_feed_the_index() {
    let index = ShardedIndex::start(ShardedIndexConfig {
        shards: 2,
        approx: Some(ApproxConfig {
            ttl: Duration::from_secs(60),
            capacity_blocks: 1000,
        }),
        fallback: None,
        recovery: None,
    })
    .await
    .unwrap();
    let tokens: Vec<u32> = (0..64).collect();
    let local = local_block_hashes(&tokens, 16, None).unwrap();
    let seq = sequence_hashes(&local);
    let key = WorkerKey::new(3, 1);
    index
        .record_routing_decision(key, local.clone(), seq.clone())
        .await
        .unwrap();
    assert!(index.assigned_shard(3).is_some());
    assert_eq!(index.find_matches(&local).get(key), 4);
    assert!(index
        .record_routing_decision(key, local.clone(), seq[..2].to_vec())
        .await
        .is_err());
    index.remove_worker(3).unwrap();
    index.flush().await.unwrap();
    assert_eq!(index.find_matches(&local).get(key), 0);
    assert_eq!(index.stats().live_pairs, 0);
    index.stop().await;
}

/// Exact mode with a fallback: a (silent) rank's routing decisions feed the index beside its
/// events, and dropping them leaves what its events stored. Without a fallback, exact mode
/// records nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_ranks_recorded_decisions_drop_and_its_events_stay() {
    let plain = ShardedIndex::start(ShardedIndexConfig::default())
        .await
        .unwrap();
    let tokens: Vec<u32> = (0..64).collect();
    let local = local_block_hashes(&tokens, 16, None).unwrap();
    let seq = sequence_hashes(&local);
    let key = WorkerKey::new(3, 0);
    assert!(plain
        .record_routing_decision(key, local.clone(), seq.clone())
        .await
        .is_err());
    plain.stop().await;

    let index = ShardedIndex::start(ShardedIndexConfig {
        shards: 2,
        fallback: Some(ApproxConfig {
            ttl: Duration::from_secs(60),
            capacity_blocks: 1000,
        }),
        ..Default::default()
    })
    .await
    .unwrap();
    index
        .apply_and_wait(vec![chain_event(key, 0, &[1, 2], 0)])
        .await
        .unwrap();
    let before = index.stats().live_pairs;
    index
        .record_routing_decision(key, local.clone(), seq.clone())
        .await
        .unwrap();
    assert_eq!(index.find_matches(&local).get(key), 4);
    index.drop_recorded(key).unwrap();
    index.flush().await.unwrap();
    assert_eq!(index.find_matches(&local).get(key), 0);
    assert_eq!(index.stats().live_pairs, before, "its events' blocks stay");
    index.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gaps_are_reported_for_recovery() {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let index = ShardedIndex::start(ShardedIndexConfig {
        shards: 2,
        approx: None,
        fallback: None,
        recovery: Some(tx),
    })
    .await
    .unwrap();
    let key = WorkerKey::new(1, 0);
    index
        .apply_and_wait(vec![
            chain_event(key, 0, &[1], 0),
            KvEvent {
                tier: Tier::Device,
                key,
                event_id: 5,
                data: KvEventData::Cleared,
            },
        ])
        .await
        .unwrap();
    assert_eq!(rx.recv().await, Some(key));
    assert_eq!(index.stats().counters.gaps, 1);
    index.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approximate_export_loads_into_an_index_with_other_shards() {
    let approx = |shards| ShardedIndexConfig {
        shards,
        approx: Some(ApproxConfig {
            ttl: Duration::from_secs(60),
            capacity_blocks: 10_000,
        }),
        fallback: None,
        recovery: None,
    };
    let a = ShardedIndex::start(approx(3)).await.unwrap();
    let mut prompts = Vec::new();
    for w in 0..6u64 {
        let tokens: Vec<u32> = (0..16 * (w as u32 + 2)).map(|t| t + 7 * w as u32).collect();
        let local = local_block_hashes(&tokens, 16, None).unwrap();
        let seq = sequence_hashes(&local);
        a.record_routing_decision(WorkerKey::new(w, (w % 2) as u32), local.clone(), seq)
            .await
            .unwrap();
        prompts.push(local);
    }
    let dump = a.export_approx().await.unwrap();
    assert_eq!(dump.len(), a.stats().live_pairs);
    let b = ShardedIndex::start(approx(2)).await.unwrap();
    let got = b.import_approx(dump.clone()).await.unwrap();
    assert_eq!((got.added, got.kept, got.refused), (dump.len(), 0, 0));
    for p in &prompts {
        let (mut x, mut y) = (b.find_matches(p).scores, a.find_matches(p).scores);
        x.sort_unstable();
        y.sort_unstable();
        assert!(!y.is_empty());
        assert_eq!(x, y);
    }
    // Not approximate: nothing to export or load.
    let plain = ShardedIndex::start(ShardedIndexConfig::default())
        .await
        .unwrap();
    assert!(plain.export_approx().await.is_err());
    assert!(plain.import_approx(dump).await.is_err());
    a.stop().await;
    b.stop().await;
    plain.stop().await;
}

//! Micro-benchmarks of the index core: applying events and looking up prompts.
//! The end-to-end figures (trace streams, shards, memory) come from `kvrouter bench indexer`.

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use kvrouter_indexer::Index;
use kvrouter_protocol::{
    EngineBlockHash, KvEvent, KvEventData, LocalBlockHash, StoredBlock, Tier, WorkerKey,
};

/// `workers` ranks, each holding `prompts` chains of `depth` blocks; the first `shared`
/// blocks of every chain are common to all (a system prompt).
fn populated(
    workers: u64,
    prompts: u64,
    depth: u64,
    shared: u64,
) -> (Index, Vec<Vec<LocalBlockHash>>) {
    let mut index = Index::new();
    let mut queries = vec![];
    for w in 0..workers {
        for p in 0..prompts {
            let locals: Vec<LocalBlockHash> = (0..depth)
                .map(|i| {
                    LocalBlockHash(if i < shared {
                        i
                    } else {
                        (w * prompts + p) << 20 | i
                    })
                })
                .collect();
            let blocks = locals
                .iter()
                .enumerate()
                .map(|(i, l)| StoredBlock {
                    engine_hash: EngineBlockHash((p << 20) | i as u64),
                    local_hash: *l,
                })
                .collect();
            index
                .apply(&KvEvent {
                    tier: Tier::Device,
                    key: WorkerKey::new(w, 0),
                    event_id: p,
                    data: KvEventData::Stored {
                        parent: None,
                        blocks,
                    },
                })
                .unwrap();
            queries.push(locals);
        }
    }
    (index, queries)
}

fn lookups(c: &mut Criterion) {
    let mut g = c.benchmark_group("find_matches");
    for (workers, depth) in [(16u64, 128u64), (64, 128), (16, 1024)] {
        let (index, queries) = populated(workers, 64, depth, 8);
        g.throughput(Throughput::Elements(depth));
        g.bench_function(format!("w{workers}_depth{depth}"), |b| {
            let mut i = 0;
            b.iter(|| {
                i = (i + 1) % queries.len();
                index.find_matches(&queries[i])
            })
        });
    }
    g.finish();
}

fn apply(c: &mut Criterion) {
    let mut g = c.benchmark_group("apply");
    let depth = 256u64;
    g.throughput(Throughput::Elements(depth * 2));
    g.bench_function("store_then_remove_256_blocks", |b| {
        b.iter_batched(
            || populated(16, 64, 128, 8).0,
            |mut index| {
                let blocks: Vec<StoredBlock> = (0..depth)
                    .map(|i| StoredBlock {
                        engine_hash: EngineBlockHash(1 << 40 | i),
                        local_hash: LocalBlockHash(1 << 41 | i),
                    })
                    .collect();
                let key = WorkerKey::new(3, 0);
                index
                    .apply(&KvEvent {
                        tier: Tier::Device,
                        key,
                        event_id: 100,
                        data: KvEventData::Stored {
                            parent: None,
                            blocks,
                        },
                    })
                    .unwrap();
                index
                    .apply(&KvEvent {
                        tier: Tier::Device,
                        key,
                        event_id: 101,
                        data: KvEventData::Removed {
                            engine_hashes: (0..depth)
                                .map(|i| EngineBlockHash(1 << 40 | i))
                                .collect(),
                        },
                    })
                    .unwrap();
                index
            },
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

criterion_group!(benches, lookups, apply);
criterion_main!(benches);

//! Property test of state sync: a real engine rank emits events; the replica side (WorkerStateSync
//! gluing snapshots and live events into an index core) sees them with losses, a snapshot
//! requested at a random moment and answered at another. After the last event and any
//! refetch it asks for, the index must hold exactly the engine's cache.

use kvrouter_indexer::{Index, RankDump};
use kvrouter_mocker::{EngineConfig, RankEngine, Request};
use kvrouter_protocol::{local_block_hashes, EventId, KvEvent, WorkerKey};
use kvrouter_replica::worker_state::{EventOutcome, WorkerStateSync};
use proptest::prelude::*;
use std::collections::BTreeSet;
use std::time::Duration;

const KEY: WorkerKey = WorkerKey::new(1, 0);
const BLOCK: usize = 4;

/// The engine's run: every event in order, and after each step a snapshot
/// (events emitted so far, the state dump, its last event id).
struct Run {
    events: Vec<KvEvent>,
    snapshots: Vec<(usize, Vec<KvEvent>, Option<EventId>)>,
    prompts: Vec<Vec<u32>>,
}

fn run_engine(prompts: &[(u8, u8)]) -> Run {
    let config = EngineConfig {
        block_size: BLOCK,
        capacity_blocks: 24,
        max_num_batched_tokens: 16,
        ..EngineConfig::default()
    };
    let mut engine = RankEngine::new(KEY, config).unwrap();
    let mut now = Duration::ZERO;
    let mut run = Run {
        events: Vec::new(),
        snapshots: vec![(0, Vec::new(), None)],
        prompts: Vec::new(),
    };
    for (i, &(prefix, len)) in prompts.iter().enumerate() {
        // Prompts share one of four prefixes of two blocks.
        let mut tokens: Vec<u32> = (0..2 * BLOCK as u32)
            .map(|t| prefix as u32 % 4 * 100 + t)
            .collect();
        tokens
            .extend((0..(len as u32 % 5 + 1) * BLOCK as u32).map(|t| 10_000 + i as u32 * 100 + t));
        run.prompts.push(tokens.clone());
        engine
            .submit(
                Request {
                    request_id: i.to_string(),
                    tokens,
                    max_tokens: 1,
                },
                now,
            )
            .unwrap();
        // Interleave: a step or two per submitted request.
        for _ in 0..2 {
            if let Some(out) = engine.step(now) {
                now += out.duration;
                run.events.extend(out.events);
                let (dump, last) = engine.state_events(3);
                run.snapshots.push((run.events.len(), dump, last));
            }
        }
    }
    while let Some(out) = engine.step(now) {
        now += out.duration;
        run.events.extend(out.events);
        let (dump, last) = engine.state_events(3);
        run.snapshots.push((run.events.len(), dump, last));
    }
    run
}

/// The replica starts fetching the rank: on join (it is new) or again.
fn start_fetch(sync: &mut WorkerStateSync) {
    if sync.is_tracked(KEY) {
        sync.refetch(KEY);
    } else {
        sync.add(KEY, std::time::Instant::now());
    }
}

fn load(
    index: &mut Index,
    sync: &mut WorkerStateSync,
    snapshot: &(usize, Vec<KvEvent>, Option<EventId>),
) {
    let (_, events, last) = snapshot;
    if let Some(after) = sync.on_snapshot(KEY, *last) {
        index
            .load_rank(&RankDump {
                key: KEY,
                last_event_id: *last,
                events: events.clone(),
            })
            .unwrap();
        for ev in &after.apply {
            index.apply(ev).unwrap();
        }
        if after.refetch {
            start_fetch(sync);
        }
    }
}

/// Which prefixes of the prompts the index (or engine dump) holds, block by block.
fn held_prefixes(index: &Index, prompts: &[Vec<u32>]) -> BTreeSet<(usize, u32)> {
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let local = local_block_hashes(p, BLOCK, None).unwrap();
            (i, index.find_matches(&local).get(KEY))
        })
        .collect()
}

fn truth(dump: &[KvEvent], prompts: &[Vec<u32>]) -> BTreeSet<(usize, u32)> {
    let mut index = Index::new();
    for ev in dump {
        index.apply_unsequenced(KEY, &ev.data).unwrap();
    }
    held_prefixes(&index, prompts)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn snapshot_plus_buffered_events_rebuild_the_rank(
        prompts in prop::collection::vec((any::<u8>(), any::<u8>()), 1..16),
        fetch_at in any::<prop::sample::Index>(),
        taken_after in any::<prop::sample::Index>(),
        answered_after in any::<prop::sample::Index>(),
        lost in prop::collection::vec(any::<prop::sample::Index>(), 0..3),
    ) {
        let run = run_engine(&prompts);
        let n = run.events.len();
        prop_assume!(n > 0);
        // The fetch is requested when `f` events have been delivered; the worker takes the
        // snapshot later (after at least the `f` delivered events were published) and the
        // answer arrives after `d >= f` deliveries, possibly after newer events.
        let candidates: Vec<usize> = (0..run.snapshots.len()).collect();
        let f = fetch_at.index(n + 1);
        let usable: Vec<usize> = candidates.into_iter().filter(|&i| run.snapshots[i].0 >= f).collect();
        prop_assume!(!usable.is_empty());
        let snap = usable[taken_after.index(usable.len())];
        let d = f + answered_after.index(n - f + 1);
        // A loss is only detectable through a later event, so the last one always arrives.
        let lost: BTreeSet<usize> = if n > 1 {
            lost.iter().map(|l| l.index(n - 1)).collect()
        } else {
            BTreeSet::new()
        };

        let mut index = Index::new();
        let mut sync = WorkerStateSync::default();
        for (j, ev) in run.events.iter().enumerate() {
            if j == f {
                start_fetch(&mut sync);
            }
            if j == d {
                load(&mut index, &mut sync, &run.snapshots[snap]);
            }
            if lost.contains(&j) {
                continue;
            }
            match sync.on_event(ev) {
                EventOutcome::Apply => { index.apply(ev).unwrap(); }
                EventOutcome::Gap { .. } => {} // the rank now fetches; answered at the end
                _ => {}
            }
        }
        if f == n {
            start_fetch(&mut sync);
        }
        if d == n {
            load(&mut index, &mut sync, &run.snapshots[snap]);
        }
        // Whatever is still fetching gets the final state.
        let last = run.snapshots.last().unwrap();
        if !sync.is_synced(KEY) {
            load(&mut index, &mut sync, last);
        }
        prop_assert!(sync.is_synced(KEY));
        prop_assert_eq!(held_prefixes(&index, &run.prompts), truth(&last.1, &run.prompts));
    }
}

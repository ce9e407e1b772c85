//! Model-based property test of a rank's KV cache and its KV events.
//!
//! Random request sequences (shared prefixes, random suffixes, aborts, clears) run through a
//! small [`RankEngine`], with and without host and disk tiers. After every operation,
//! replaying the emitted KV events into a simple model ((tier, engine hash) → (parent, local
//! hash), with `Removed` and `Cleared` applied) must give exactly the blocks each tier holds;
//! no tier ever holds more than its capacity, even between two events; a block sits in one
//! tier at a time; referenced blocks are never evicted; every parent named is held in some
//! tier; event ids run 0, 1, 2, … without gaps; and the state dump, replayed into an empty
//! model, gives the same set.

use kvrouter_mocker::{EngineConfig, OutputKind, RankEngine, Request, StepOutcome};
use kvrouter_protocol::{EngineBlockHash, KvEvent, KvEventData, LocalBlockHash, Tier, WorkerKey};
use proptest::prelude::*;
use std::collections::{HashMap, HashSet};
use std::time::Duration;

const KEY: WorkerKey = WorkerKey::new(11, 2);
const BLOCK: usize = 4;

type CacheModel = HashMap<(Tier, EngineBlockHash), (Option<EngineBlockHash>, LocalBlockHash)>;

fn held_in_some_tier(model: &CacheModel, engine: EngineBlockHash) -> bool {
    Tier::ALL.iter().any(|&t| model.contains_key(&(t, engine)))
}

fn in_tier(model: &CacheModel, tier: Tier) -> usize {
    model.keys().filter(|(t, _)| *t == tier).count()
}

#[derive(Clone, Debug)]
enum CacheOp {
    Submit {
        prefix: usize,
        prefix_tokens: usize,
        suffix: Vec<u32>,
        max_tokens: u32,
    },
    Step,
    Steps(usize),
    Abort(usize),
    Clear,
}

fn cache_op() -> impl Strategy<Value = CacheOp> {
    prop_oneof![
        4 => (0..3usize, 0..28usize, prop::collection::vec(0..50u32, 0..14), 0..6u32).prop_map(
            |(prefix, prefix_tokens, suffix, max_tokens)| CacheOp::Submit {
                prefix,
                prefix_tokens,
                suffix,
                max_tokens,
            }
        ),
        4 => Just(CacheOp::Step),
        1 => (2..12usize).prop_map(CacheOp::Steps),
        1 => (0..64usize).prop_map(CacheOp::Abort),
        1 => Just(CacheOp::Clear),
    ]
}

fn engine_config() -> impl Strategy<Value = EngineConfig> {
    (
        6..40usize,
        prop::sample::select(vec![1usize, 3, 8, 16, 64]),
        1..6usize,
        any::<bool>(),
        prop_oneof![Just(0usize), 1..12usize],
        prop_oneof![Just(0usize), 1..12usize],
    )
        .prop_map(
            |(capacity, budget, seqs, chunked, host, disk)| EngineConfig {
                block_size: BLOCK,
                capacity_blocks: capacity,
                max_num_batched_tokens: budget,
                max_num_seqs: seqs,
                enable_chunked_prefill: chunked,
                host_capacity_blocks: host,
                disk_capacity_blocks: disk,
                ..Default::default()
            },
        )
}

/// Applies live events to the model, checking ids, chaining, capacities and what may be
/// removed.
fn check_and_apply(
    model: &mut CacheModel,
    next_id: &mut u64,
    events: &[KvEvent],
    referenced_before: &HashSet<EngineBlockHash>,
    cfg: &EngineConfig,
) -> Result<(), TestCaseError> {
    for e in events {
        prop_assert_eq!(e.key, KEY);
        prop_assert_eq!(e.event_id, *next_id, "event ids must have no gap");
        *next_id += 1;
        let tier = e.tier;
        match &e.data {
            KvEventData::Stored { parent, blocks } => {
                prop_assert!(!blocks.is_empty());
                if let Some(p) = parent {
                    prop_assert!(
                        held_in_some_tier(model, *p),
                        "parent {p:?} not stored in any tier"
                    );
                }
                let mut parent = *parent;
                for b in blocks {
                    prop_assert!(
                        model
                            .insert((tier, b.engine_hash), (parent, b.local_hash))
                            .is_none(),
                        "block stored twice in {tier:?}"
                    );
                    parent = Some(b.engine_hash);
                }
                let capacity = match tier {
                    Tier::Device => cfg.capacity_blocks,
                    Tier::Host => cfg.host_capacity_blocks,
                    Tier::Disk => cfg.disk_capacity_blocks,
                    Tier::Shared => 0,
                };
                prop_assert!(in_tier(model, tier) <= capacity, "{tier:?} over capacity");
            }
            KvEventData::Removed { engine_hashes } => {
                prop_assert!(!engine_hashes.is_empty());
                for h in engine_hashes {
                    prop_assert!(
                        tier != Tier::Device || !referenced_before.contains(h),
                        "referenced block {h:?} evicted"
                    );
                    prop_assert!(
                        model.remove(&(tier, *h)).is_some(),
                        "removed unknown block {h:?} from {tier:?}"
                    );
                }
            }
            KvEventData::Cleared => model.clear(),
        }
    }
    Ok(())
}

fn cache_set(e: &RankEngine) -> CacheModel {
    let c = e.cache();
    let device = c.cached().map(|b| (Tier::Device, b));
    let lower = [Tier::Host, Tier::Disk]
        .into_iter()
        .flat_map(|t| c.lower_cached(t).map(move |b| (t, b)));
    device
        .chain(lower)
        .map(|(t, b)| ((t, b.engine_hash), (b.parent, b.local_hash)))
        .collect()
}

fn check_state_dump(e: &RankEngine, max: usize, next_id: u64) -> Result<(), TestCaseError> {
    let (events, last) = e.state_events(max);
    prop_assert_eq!(last, next_id.checked_sub(1));
    let mut model = CacheModel::new();
    for ev in &events {
        prop_assert_eq!(ev.key, KEY);
        prop_assert_eq!(ev.event_id, last.unwrap_or(0), "a dump carries the last id");
        let KvEventData::Stored { parent, blocks } = &ev.data else {
            return Err(TestCaseError::fail("dump holds only Stored events"));
        };
        prop_assert!(!blocks.is_empty() && blocks.len() <= max);
        let mut parent = *parent;
        for b in blocks {
            prop_assert!(model
                .insert((ev.tier, b.engine_hash), (parent, b.local_hash))
                .is_none());
            parent = Some(b.engine_hash);
        }
    }
    // Parents before children: every parent named is either earlier in the dump or not
    // cached at all.
    let cached = cache_set(e);
    let mut seen = HashSet::new();
    for ev in &events {
        if let KvEventData::Stored { parent, blocks } = &ev.data {
            if let Some(p) = parent {
                prop_assert!(seen.contains(p) || !held_in_some_tier(&cached, *p));
            }
            seen.extend(blocks.iter().map(|b| b.engine_hash));
        }
    }
    prop_assert_eq!(model, cached);
    Ok(())
}

#[derive(Default)]
struct Progress {
    prefilled: bool,
    tokens: u32,
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn events_replay_to_the_cache(
        cfg in engine_config(),
        ops in prop::collection::vec(cache_op(), 1..80),
        dump_chunk in 1..6usize,
    ) {
        let capacity = cfg.capacity_blocks;
        let mut e = RankEngine::new(KEY, cfg.clone()).unwrap();
        let prefixes: Vec<Vec<u32>> =
            (0..3u32).map(|p| (0..28).map(|t| 1000 * (p + 1) + t).collect()).collect();
        let mut model = CacheModel::new();
        let mut next_id = 0u64;
        let mut now = Duration::ZERO;
        let mut submitted: Vec<(String, u32)> = Vec::new();
        let mut progress: HashMap<String, Progress> = HashMap::new();

        // Several steps in a row run as single steps, so that each step's events are checked
        // against the blocks referenced just before it.
        let ops = ops.into_iter().flat_map(|op| match op {
            CacheOp::Steps(k) => vec![CacheOp::Step; k],
            op => vec![op],
        });
        for (n, op) in ops.enumerate() {
            let referenced: HashSet<EngineBlockHash> = e
                .cache()
                .cached()
                .filter(|b| b.ref_count > 0)
                .map(|b| b.engine_hash)
                .collect();
            let mut outcome: Option<StepOutcome> = None;
            let mut events: Vec<KvEvent> = Vec::new();
            match op {
                CacheOp::Submit { prefix, prefix_tokens, suffix, max_tokens } => {
                    let mut tokens = prefixes[prefix][..prefix_tokens].to_vec();
                    tokens.extend(suffix);
                    let id = format!("r{n}");
                    let before = e.load();
                    let r = e.submit(
                        Request { request_id: id.clone(), tokens, max_tokens },
                        now,
                    );
                    if r.is_ok() {
                        submitted.push((id.clone(), max_tokens));
                        progress.insert(id, Progress::default());
                    } else {
                        prop_assert_eq!(e.load(), before, "a refused request changes nothing");
                    }
                }
                CacheOp::Step => {
                    let idle = e.is_idle();
                    let out = e.step(now);
                    prop_assert_eq!(out.is_none(), idle, "a busy rank always progresses");
                    if let Some(out) = &out {
                        now += out.duration;
                        events = out.events.clone();
                    }
                    outcome = out;
                }
                CacheOp::Steps(_) => unreachable!("expanded into single steps"),
                CacheOp::Abort(i) => {
                    if let Some((id, _)) = submitted.get(i % submitted.len().max(1)) {
                        let live = progress.contains_key(id);
                        prop_assert_eq!(e.abort(id), live);
                        progress.remove(id);
                    }
                }
                CacheOp::Clear => events.push(e.clear()),
            }
            if let Some(out) = &outcome {
                prop_assert!(out.duration > Duration::ZERO);
                for o in &out.outputs {
                    let p = progress.get_mut(&o.request_id);
                    prop_assert!(p.is_some(), "output for unknown request");
                    let p = p.unwrap();
                    let max = submitted.iter().find(|(id, _)| *id == o.request_id).unwrap().1;
                    match o.kind {
                        OutputKind::PrefillDone { cached_blocks, prompt_blocks, .. } => {
                            prop_assert!(!p.prefilled);
                            prop_assert!(cached_blocks <= prompt_blocks);
                            p.prefilled = true;
                            p.tokens = max.min(1);
                        }
                        OutputKind::Token { index, .. } => {
                            prop_assert!(p.prefilled);
                            prop_assert_eq!(index, p.tokens);
                            p.tokens += 1;
                        }
                        OutputKind::Finished { output_tokens, .. } => {
                            prop_assert!(p.prefilled);
                            prop_assert_eq!(output_tokens, max);
                            prop_assert_eq!(p.tokens, max);
                            progress.remove(&o.request_id);
                        }
                    }
                }
            }

            check_and_apply(&mut model, &mut next_id, &events, &referenced, &cfg)?;
            prop_assert_eq!(&model, &cache_set(&e), "events replay to the cache's blocks");
            let mut once = HashSet::new();
            prop_assert!(model.keys().all(|&(_, h)| once.insert(h)), "a block in two tiers");
            prop_assert_eq!(e.last_event_id(), next_id.checked_sub(1));
            prop_assert!(e.cache().used_blocks() <= capacity);
            prop_assert!(e.load().active_blocks <= capacity);
            if let Err(msg) = e.check_invariants() {
                return Err(TestCaseError::fail(msg));
            }
            check_state_dump(&e, dump_chunk, next_id)?;
        }

        // Everything submitted and not aborted eventually finishes, and then nothing is
        // referenced any more.
        let mut guard = 0;
        while let Some(out) = e.step(now) {
            now += out.duration;
            let referenced = HashSet::new();
            check_and_apply(&mut model, &mut next_id, &out.events, &referenced, &cfg)?;
            for o in &out.outputs {
                if matches!(o.kind, OutputKind::Finished { .. }) {
                    progress.remove(&o.request_id);
                }
            }
            guard += 1;
            prop_assert!(guard < 10_000, "rank does not drain");
        }
        prop_assert!(progress.is_empty(), "unfinished requests: {:?}", progress.keys().collect::<Vec<_>>());
        prop_assert_eq!(&model, &cache_set(&e));
        prop_assert_eq!(e.load().active_blocks, 0);
        prop_assert_eq!(e.load().running_requests + e.load().waiting_requests, 0);
    }
}

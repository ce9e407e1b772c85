//! Random operation sequences against a brute-force reference model.
//!
//! After every step the scheduler's per-key load (active blocks deduplicated by sequence
//! hash, prefill tokens, request counts) must equal the model's; every route answer must
//! match the model's filter / busy verdict, and at temperature 0 the chosen key must be a
//! non-busy allowed candidate whose cost equals the model's minimum (a request's own
//! temperature above 0 may pick any non-busy allowed candidate, priced the same way). Overlaps come by tier
//! (device overlaps, keys a lower tier extends, a shared-storage prefix) with per-request
//! weight overrides, and the model credits each tier at its weight. Queued requests are
//! replayed through `drain_ready` and checked the same way, in the queue policy's order
//! (fcfs or wspt, with per-request priority jumps). Requests may expect output and report
//! output blocks (`add_output_block`, with decay), which count in the decode load.

use kvrouter_protocol::{RouteOverrides, SequenceHash, TierBlocks, WorkerId, WorkerKey};
use kvrouter_scheduler::{
    QueuePolicy, Queued, ReportedLoad, RouteQuery, RoutingPolicy, ScheduleError, Scheduler,
    SchedulerConfig, Selection,
};
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

const BS: u32 = 4;
const TIMEOUT: Duration = Duration::from_secs(20);
/// Shorter than TIMEOUT, so the model tells the queue's timeout from the sweep's.
const QUEUE_TIMEOUT: Duration = Duration::from_secs(7);
/// The scheduler's tier weights under test (requests may override them).
const HOST_W: f64 = 0.75;
const DISK_W: f64 = 0.25;
const SHARED_W: f64 = 0.5;

/// What the index says a request's prompt holds where, and the request's cost overrides.
#[derive(Clone, Debug, Default)]
struct Cached {
    /// Device overlaps (a key may appear twice: the larger counts).
    overlaps: Vec<(WorkerKey, u32)>,
    /// Keys whose prefix a lower tier extends, by tier.
    lower: Vec<(WorkerKey, TierBlocks)>,
    /// The shared-storage prefix of a key holding nothing else.
    shared: u32,
    overrides: RouteOverrides,
}

#[derive(Clone, Debug)]
enum Filter {
    None,
    Allowed(Vec<WorkerId>),
    Pinned(WorkerKey),
    PinnedWorker(WorkerId),
    PinnedBoth(WorkerKey, WorkerId),
    AllowedKeys(Vec<WorkerKey>),
    Excluded(Vec<WorkerId>),
}

// Test input, generated and dropped: the size difference costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
enum SchedulerOp {
    AddKey(WorkerKey, u64),
    RemoveKey(WorkerKey),
    RemoveWorker(WorkerId),
    Report(WorkerKey, u64),
    Route {
        prompt_tokens: usize,
        hashes: Vec<u64>,
        cached: Cached,
        filter: Filter,
        update: bool,
        reuse_id: Option<usize>,
        queue_if_busy: bool,
        priority_jump: f64,
        expected_output: Option<u32>,
    },
    MarkPrefill(usize),
    /// `add_output_block` with this decay fraction.
    AddOutput(usize, Option<f64>),
    Free(usize),
    Sweep,
    Drain,
}

fn worker_key() -> impl Strategy<Value = WorkerKey> {
    (1u64..=4, 0u32..3).prop_map(|(w, r)| WorkerKey::new(w, r))
}

fn filter() -> impl Strategy<Value = Filter> {
    prop_oneof![
        4 => Just(Filter::None),
        1 => prop::collection::vec(0u64..=5, 0..4).prop_map(Filter::Allowed),
        1 => worker_key().prop_map(Filter::Pinned),
        1 => (0u64..=5).prop_map(Filter::PinnedWorker),
        1 => (worker_key(), 1u64..=4).prop_map(|(k, w)| Filter::PinnedBoth(k, w)),
        1 => prop::collection::vec(worker_key(), 0..4).prop_map(Filter::AllowedKeys),
        1 => prop::collection::vec(0u64..=5, 0..4).prop_map(Filter::Excluded),
    ]
}

/// A listed key's tiers: never all zero, as the index lists only keys a lower tier extends
/// (an all-zero entry would read as "holds nothing", where the shared prefix applies).
fn tier_blocks() -> impl Strategy<Value = TierBlocks> {
    (0u32..6, 0u32..6, 0u32..6, 0u32..4)
        .prop_map(|(device, host, disk, shared)| TierBlocks {
            device,
            host,
            disk,
            shared,
        })
        .prop_filter("the index never lists a key holding nothing", |t| {
            *t != TierBlocks::default()
        })
}

fn weight() -> impl Strategy<Value = Option<f64>> {
    prop::option::weighted(0.3, prop::sample::select(vec![0.0, 0.25, 1.0, 2.0]))
}

fn cached() -> impl Strategy<Value = Cached> {
    (
        prop::collection::vec((worker_key(), 0u32..12), 0..5),
        prop::collection::vec((worker_key(), tier_blocks()), 0..3),
        prop_oneof![3 => Just(0u32), 1 => 1u32..6],
        (weight(), weight(), weight(), weight()),
        prop::sample::select(vec![None, None, None, Some(0.0), Some(1.0)]),
    )
        .prop_map(
            |(overlaps, lower, shared, (credit, host, disk, sh), temperature)| Cached {
                overlaps,
                lower,
                shared,
                overrides: RouteOverrides {
                    overlap_credit: credit,
                    host_cache_hit_weight: host,
                    disk_cache_hit_weight: disk,
                    shared_cache_hit_weight: sh,
                    temperature,
                },
            },
        )
}

fn scheduler_op() -> impl Strategy<Value = SchedulerOp> {
    let route = (
        0usize..40,
        prop::collection::vec(0u64..16, 10),
        cached(),
        filter(),
        prop::bool::weighted(0.85),
        prop::option::weighted(0.1, 0usize..100),
        any::<bool>(),
        // Differences between these (4.7 clamped to MAX_JUMP) are never a multiple of the
        // 1.5 s step: no fcfs ties.
        prop::sample::select(vec![0.0, 0.0, 0.4, 2.0, 4.7]),
        prop::option::weighted(0.3, 0u32..12),
    )
        .prop_map(
            |(
                prompt_tokens,
                pool,
                cached,
                filter,
                update,
                reuse_id,
                queue_if_busy,
                priority_jump,
                expected_output,
            )| {
                let full = prompt_tokens / BS as usize;
                SchedulerOp::Route {
                    prompt_tokens,
                    hashes: pool[..full].to_vec(),
                    cached,
                    filter,
                    update,
                    reuse_id,
                    queue_if_busy,
                    priority_jump,
                    expected_output,
                }
            },
        );
    prop_oneof![
        3 => (worker_key(), prop_oneof![Just(0u64), 4u64..40]).prop_map(|(k, c)| SchedulerOp::AddKey(k, c)),
        1 => worker_key().prop_map(SchedulerOp::RemoveKey),
        1 => (1u64..=4).prop_map(SchedulerOp::RemoveWorker),
        1 => (worker_key(), 0u64..40).prop_map(|(k, a)| SchedulerOp::Report(k, a)),
        8 => route,
        2 => (0usize..100).prop_map(SchedulerOp::MarkPrefill),
        2 => (
            0usize..100,
            prop::sample::select(vec![None, Some(0.0), Some(0.5), Some(1.0)])
        )
            .prop_map(|(i, d)| SchedulerOp::AddOutput(i, d)),
        3 => (0usize..100).prop_map(SchedulerOp::Free),
        1 => Just(SchedulerOp::Sweep),
        2 => Just(SchedulerOp::Drain),
    ]
}

#[derive(Clone, Debug)]
struct Cfg {
    overlap_credit: f64,
    prefill_load_scale: f64,
    /// Credit per predicted block (leading blocks active on the key, past its cached tiers).
    active_prefix_credit: f64,
    /// In-flight prefill tokens past this count no more (0: no cap).
    prefill_queue_cap: u64,
    busy_frac: Option<f64>,
    busy_prefill: Option<u64>,
    max_queued: usize,
    /// Queue policy WSPT (else FCFS).
    wspt: bool,
    seed: u64,
}

fn cfg() -> impl Strategy<Value = Cfg> {
    (
        prop::sample::select(vec![0.0, 0.5, 1.0, 2.0]),
        (
            prop::sample::select(vec![0.0, 0.5, 1.0, 3.0]),
            prop::sample::select(vec![0.0, 0.5, 1.0]),
            prop::sample::select(vec![0u64, 0, 8, 24]),
        ),
        prop::option::of(prop::sample::select(vec![0.3, 0.5, 1.0])),
        prop::option::of(prop::sample::select(vec![6u64, 20])),
        0usize..4,
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(
            |(
                overlap_credit,
                (prefill_load_scale, active_prefix_credit, prefill_queue_cap),
                busy_frac,
                busy_prefill,
                max_queued,
                wspt,
                seed,
            )| {
                Cfg {
                    overlap_credit,
                    prefill_load_scale,
                    active_prefix_credit,
                    prefill_queue_cap,
                    busy_frac,
                    busy_prefill,
                    max_queued,
                    wspt,
                    seed,
                }
            },
        )
}

// ---- the reference model ---------------------------------------------------------------

#[derive(Clone, Debug)]
struct RefKey {
    capacity: u64,
    reported: Option<u64>,
}

#[derive(Clone, Debug)]
struct RefReq {
    key: WorkerKey,
    hashes: Vec<u64>,
    prefill: u64,
    /// Output blocks expected at routing, generated since, counted now.
    expected: u32,
    generated: u32,
    output: u32,
    added: Instant,
}

#[derive(Clone, Debug)]
struct RefQueued {
    token: u64,
    id: String,
    prompt_tokens: usize,
    hashes: Vec<u64>,
    cached: Cached,
    filter: Filter,
    update: bool,
    expected_output: Option<u32>,
    at: Instant,
    /// Retry order: WSPT's uncached prompt tokens on the best-cached key over 1 + the
    /// priority jump, else seconds since the run began less the jump (FCFS).
    order: f64,
}

struct SchedulerModel {
    cfg: Cfg,
    keys: BTreeMap<WorkerKey, RefKey>,
    reqs: BTreeMap<String, RefReq>,
    queue: Vec<RefQueued>,
}

impl SchedulerModel {
    fn workers(&self) -> BTreeSet<WorkerId> {
        self.keys.keys().map(|k| k.worker_id).collect()
    }

    fn active_set(&self, key: WorkerKey) -> BTreeSet<u64> {
        self.reqs
            .values()
            .filter(|r| r.key == key)
            .flat_map(|r| r.hashes.iter().copied())
            .collect()
    }

    /// Output blocks counted on `key`.
    fn output_blocks(&self, key: WorkerKey) -> u64 {
        self.reqs
            .values()
            .filter(|r| r.key == key)
            .map(|r| u64::from(r.output))
            .sum()
    }

    /// Decode load: distinct prompt blocks plus output blocks.
    fn active_blocks(&self, key: WorkerKey) -> u64 {
        self.active_set(key).len() as u64 + self.output_blocks(key)
    }

    fn prefill_tokens(&self, key: WorkerKey) -> u64 {
        self.reqs
            .values()
            .filter(|r| r.key == key)
            .map(|r| r.prefill)
            .sum()
    }

    fn busy(&self, key: WorkerKey) -> bool {
        let k = &self.keys[&key];
        let active = self.active_blocks(key);
        if let Some(frac) = self.cfg.busy_frac {
            let a = active.max(k.reported.unwrap_or(0));
            if k.capacity > 0 && a as f64 >= frac * k.capacity as f64 {
                return true;
            }
        }
        matches!(self.cfg.busy_prefill, Some(t) if self.prefill_tokens(key) >= t)
    }

    /// Candidates after filters (before busy), or the filter error.
    fn candidates(&self, filter: &Filter) -> Result<Vec<WorkerKey>, ScheduleError> {
        if self.keys.is_empty() {
            return Err(ScheduleError::NoWorkers);
        }
        let workers = self.workers();
        let pinned_key = |k: WorkerKey| {
            if !workers.contains(&k.worker_id) {
                Err(ScheduleError::UnknownWorker(k.worker_id))
            } else if !self.keys.contains_key(&k) {
                Err(ScheduleError::InvalidRank {
                    worker_id: k.worker_id,
                    dp_rank: k.dp_rank,
                })
            } else {
                Ok(vec![k])
            }
        };
        match filter {
            Filter::None => Ok(self.keys.keys().copied().collect()),
            Filter::Pinned(k) => pinned_key(*k),
            Filter::PinnedBoth(k, w) => {
                let c = pinned_key(*k)?;
                if *w != k.worker_id {
                    Err(ScheduleError::NoAllowedWorkers)
                } else {
                    Ok(c)
                }
            }
            Filter::PinnedWorker(w) => {
                if !workers.contains(w) {
                    return Err(ScheduleError::UnknownWorker(*w));
                }
                Ok(self
                    .keys
                    .keys()
                    .filter(|k| k.worker_id == *w)
                    .copied()
                    .collect())
            }
            Filter::AllowedKeys(list) => {
                let c: Vec<_> = self
                    .keys
                    .keys()
                    .filter(|k| list.contains(k))
                    .copied()
                    .collect();
                if c.is_empty() {
                    Err(ScheduleError::NoAllowedWorkers)
                } else {
                    Ok(c)
                }
            }
            Filter::Excluded(list) => {
                let c: Vec<_> = self
                    .keys
                    .keys()
                    .filter(|k| !list.contains(&k.worker_id))
                    .copied()
                    .collect();
                if c.is_empty() {
                    Err(ScheduleError::NoAllowedWorkers)
                } else {
                    Ok(c)
                }
            }
            Filter::Allowed(list) => {
                let c: Vec<_> = self
                    .keys
                    .keys()
                    .filter(|k| list.contains(&k.worker_id))
                    .copied()
                    .collect();
                if c.is_empty() {
                    Err(ScheduleError::NoAllowedWorkers)
                } else {
                    Ok(c)
                }
            }
        }
    }

    /// What `key` holds of the prompt, by tier: a key a lower tier extends has its listed
    /// tiers (the last listing wins); any other its largest device overlap, and the shared
    /// prefix when it holds nothing on the device.
    fn tiers(cached: &Cached, key: WorkerKey) -> TierBlocks {
        if let Some((_, t)) = cached.lower.iter().rev().find(|(k, _)| *k == key) {
            return *t;
        }
        let device = cached
            .overlaps
            .iter()
            .filter(|(k, _)| *k == key)
            .map(|(_, o)| *o)
            .max()
            .unwrap_or(0);
        TierBlocks {
            shared: if device == 0 { cached.shared } else { 0 },
            ..TierBlocks::on_device(device)
        }
    }

    /// (prefill_blocks, decode_blocks, cost) of sending the request to `key`.
    fn cost(
        &self,
        key: WorkerKey,
        prompt_tokens: usize,
        hashes: &[u64],
        cached: &Cached,
    ) -> (f64, u64, f64) {
        let request_blocks = (prompt_tokens as u64).div_ceil(u64::from(BS)) as f64;
        let t = Self::tiers(cached, key);
        let o = &cached.overrides;
        // Predicted blocks: the request's leading blocks all active on the key, past the
        // blocks its tiers hold.
        let active = self.active_set(key);
        let leading = hashes.iter().take_while(|h| active.contains(h)).count() as u32;
        let predicted = leading.saturating_sub(t.device + t.host + t.disk + t.shared);
        let credit = o.overlap_credit.unwrap_or(self.cfg.overlap_credit) * f64::from(t.device)
            + o.host_cache_hit_weight.unwrap_or(HOST_W) * f64::from(t.host)
            + o.disk_cache_hit_weight.unwrap_or(DISK_W) * f64::from(t.disk)
            + o.shared_cache_hit_weight.unwrap_or(SHARED_W) * f64::from(t.shared)
            + self.cfg.active_prefix_credit * f64::from(predicted);
        let queued = match self.cfg.prefill_queue_cap {
            0 => self.prefill_tokens(key),
            cap => self.prefill_tokens(key).min(cap),
        };
        let prefill = (request_blocks - credit).max(0.0) + queued as f64 / f64::from(BS);
        let mut set = self.active_set(key);
        set.extend(hashes.iter().copied());
        let decode = set.len() as u64 + self.output_blocks(key);
        (
            prefill,
            decode,
            self.cfg.prefill_load_scale * prefill + decode as f64,
        )
    }

    /// The verdict for a request: Err(expected error) or Ok(non-busy candidates).
    fn verdict(&self, filter: &Filter) -> Result<Vec<WorkerKey>, ScheduleError> {
        let c = self.candidates(filter)?;
        let free: Vec<_> = c.into_iter().filter(|&k| !self.busy(k)).collect();
        if free.is_empty() {
            Err(ScheduleError::AllBusy)
        } else {
            Ok(free)
        }
    }

    /// Checks a successful selection against the model; panics with context on mismatch.
    fn check_selection(
        &self,
        sel: &Selection,
        free: &[WorkerKey],
        prompt_tokens: usize,
        hashes: &[u64],
        cached: &Cached,
    ) {
        assert!(
            free.contains(&sel.key),
            "chose {} outside {free:?}",
            sel.key
        );
        let (p, d, c) = self.cost(sel.key, prompt_tokens, hashes, cached);
        assert!(
            (sel.prefill_blocks - p).abs() < 1e-9,
            "prefill {sel:?} vs {p}"
        );
        assert_eq!(sel.decode_blocks, d, "{sel:?}");
        assert!((sel.cost - c).abs() < 1e-9, "cost {sel:?} vs {c}");
        let tiers = Self::tiers(cached, sel.key);
        assert_eq!(sel.overlap_blocks, tiers.device);
        assert_eq!(sel.tier_overlap_blocks, tiers, "{sel:?}");
        // A request's own temperature above 0 samples among the free keys (any of them,
        // priced as above); at 0 (the scheduler's, or its own) the cheapest is chosen.
        if cached.overrides.temperature.unwrap_or(0.0) > 0.0 {
            return;
        }
        let min = free
            .iter()
            .map(|&k| self.cost(k, prompt_tokens, hashes, cached).2)
            .fold(f64::INFINITY, f64::min);
        assert!(
            (sel.cost - min).abs() < 1e-9,
            "cost {} but min {min}",
            sel.cost
        );
    }

    #[allow(clippy::too_many_arguments)]
    fn add(
        &mut self,
        id: String,
        key: WorkerKey,
        prompt_tokens: usize,
        hashes: &[u64],
        overlap: u32,
        expected_output: Option<u32>,
        now: Instant,
    ) {
        let prefill = (prompt_tokens as u64).saturating_sub(u64::from(overlap) * u64::from(BS));
        let expected = expected_output.unwrap_or(0).div_ceil(BS);
        self.reqs.insert(
            id,
            RefReq {
                key,
                hashes: hashes.to_vec(),
                prefill,
                expected,
                generated: 0,
                output: expected,
                added: now,
            },
        );
    }

    fn drop_key(&mut self, key: WorkerKey) -> Vec<String> {
        self.keys.remove(&key);
        let ids: Vec<String> = self
            .reqs
            .iter()
            .filter(|(_, r)| r.key == key)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &ids {
            self.reqs.remove(id);
        }
        ids
    }
}

fn to_hashes(v: &[u64]) -> Vec<SequenceHash> {
    v.iter().map(|&h| SequenceHash(h)).collect()
}

fn query<'a>(
    prompt_tokens: usize,
    hashes: &'a [SequenceHash],
    filter: &'a Filter,
    cached: &'a Cached,
) -> RouteQuery<'a> {
    let mut q = RouteQuery::new(prompt_tokens, hashes);
    q.lower_tiers = &cached.lower;
    q.shared_blocks = cached.shared;
    q.overrides = cached.overrides;
    match filter {
        Filter::None => {}
        Filter::Allowed(list) => q.filters.allowed_workers = Some(list),
        Filter::AllowedKeys(list) => q.filters.allowed_keys = Some(list),
        Filter::Excluded(list) => q.filters.excluded_workers = list,
        Filter::Pinned(k) => q.filters.pinned = Some(*k),
        Filter::PinnedWorker(w) => q.filters.pinned_worker = Some(*w),
        Filter::PinnedBoth(k, w) => {
            q.filters.pinned = Some(*k);
            q.filters.pinned_worker = Some(*w);
        }
    }
    q
}

fn check_state(s: &Scheduler<u64>, m: &SchedulerModel) {
    let keys: BTreeSet<WorkerKey> = s.worker_keys().collect();
    assert_eq!(keys, m.keys.keys().copied().collect::<BTreeSet<_>>());
    for (key, load) in s.loads() {
        let rk = &m.keys[&key];
        assert_eq!(load.active_blocks, m.active_blocks(key), "blocks of {key}");
        assert_eq!(
            load.prefill_tokens,
            m.prefill_tokens(key),
            "prefill of {key}"
        );
        let n = m.reqs.values().filter(|r| r.key == key).count() as u64;
        assert_eq!(load.active_requests, n, "requests of {key}");
        assert_eq!(load.capacity_blocks, rk.capacity);
        assert_eq!(load.reported.map(|r| r.active_blocks), rk.reported);
        assert_eq!(s.is_busy(key), Some(m.busy(key)), "busy of {key}");
    }
    assert_eq!(s.active_requests(), m.reqs.len());
    assert_eq!(s.queue_len(), m.queue.len());
}

/// The scheduler's `max_priority_jump`: the 4.7 s jumps are clamped to it.
const MAX_JUMP: f64 = 4.2;

fn run_against_model(cfg: Cfg, ops: Vec<SchedulerOp>) {
    let config = SchedulerConfig {
        host_cache_hit_weight: HOST_W,
        disk_cache_hit_weight: DISK_W,
        shared_cache_hit_weight: SHARED_W,
        block_size: BS,
        overlap_credit: cfg.overlap_credit,
        prefill_load_scale: cfg.prefill_load_scale,
        active_prefix_credit: cfg.active_prefix_credit,
        prefill_queue_cap_tokens: cfg.prefill_queue_cap,
        temperature: 0.0,
        busy_active_blocks_frac: cfg.busy_frac,
        busy_prefill_tokens: cfg.busy_prefill,
        busy_waiting_requests: None,
        max_queued_requests: cfg.max_queued,
        request_timeout: TIMEOUT,
        queue_timeout: QUEUE_TIMEOUT,
        seed: cfg.seed,
        policy: RoutingPolicy::Kv,
        queue_policy: if cfg.wspt {
            QueuePolicy::Wspt
        } else {
            QueuePolicy::Fcfs
        },
        max_priority_jump: MAX_JUMP,
    };
    let mut s: Scheduler<u64> = Scheduler::new(config).unwrap();
    let mut m = SchedulerModel {
        cfg,
        keys: BTreeMap::new(),
        reqs: BTreeMap::new(),
        queue: Vec::new(),
    };
    let mut now = Instant::now();
    let start = now;
    let mut next_id = 0u64;
    let mut ids: Vec<String> = Vec::new(); // every id ever used
    for (step, op) in ops.into_iter().enumerate() {
        now += Duration::from_millis(1500);
        let pick = |i: usize, ids: &[String]| -> String {
            if ids.is_empty() || i >= ids.len() * 2 {
                "unknown".to_string()
            } else {
                ids[i % ids.len()].clone()
            }
        };
        match op {
            SchedulerOp::AddKey(key, cap) => {
                let new = s.add_worker_key(key, cap);
                assert_eq!(new, !m.keys.contains_key(&key));
                let reported = m.keys.get(&key).and_then(|k| k.reported);
                m.keys.insert(
                    key,
                    RefKey {
                        capacity: cap,
                        reported,
                    },
                );
            }
            SchedulerOp::RemoveKey(key) => {
                let got = s.remove_worker_key(key);
                let want = if m.keys.contains_key(&key) {
                    m.drop_key(key)
                } else {
                    vec![]
                };
                assert_eq!(got, want);
            }
            SchedulerOp::RemoveWorker(w) => {
                let mut got = s.remove_worker(w);
                got.sort();
                let keys: Vec<_> = m
                    .keys
                    .keys()
                    .filter(|k| k.worker_id == w)
                    .copied()
                    .collect();
                let mut want: Vec<String> = keys.into_iter().flat_map(|k| m.drop_key(k)).collect();
                want.sort();
                assert_eq!(got, want);
            }
            SchedulerOp::Report(key, active) => {
                let known = s.set_reported_load(
                    key,
                    ReportedLoad {
                        active_blocks: active,
                        waiting_requests: 1,
                    },
                );
                assert_eq!(known, m.keys.contains_key(&key));
                if let Some(k) = m.keys.get_mut(&key) {
                    k.reported = Some(active);
                }
            }
            SchedulerOp::Route {
                prompt_tokens,
                hashes,
                cached,
                filter,
                update,
                reuse_id,
                queue_if_busy,
                priority_jump,
                expected_output,
            } => {
                let id = match reuse_id {
                    Some(i) if !ids.is_empty() => ids[i % ids.len()].clone(),
                    _ => {
                        next_id += 1;
                        format!("r{next_id}")
                    }
                };
                ids.push(id.clone());
                let sh = to_hashes(&hashes);
                let mut q = query(prompt_tokens, &sh, &filter, &cached);
                q.priority_jump = priority_jump;
                q.expected_output_tokens = expected_output;
                let got = s.route(&q, &cached.overlaps, id.clone(), update, now);
                if update && m.reqs.contains_key(&id) {
                    assert_eq!(got, Err(ScheduleError::DuplicateRequest(id)));
                    continue;
                }
                match (m.verdict(&filter), got) {
                    (Ok(free), Ok(sel)) => {
                        m.check_selection(&sel, &free, prompt_tokens, &hashes, &cached);
                        if update {
                            m.add(
                                id,
                                sel.key,
                                prompt_tokens,
                                &hashes,
                                sel.overlap_blocks,
                                expected_output,
                                now,
                            );
                        }
                    }
                    (Err(want), Err(got)) => {
                        assert_eq!(got, want, "step {step}");
                        if got == ScheduleError::AllBusy && queue_if_busy {
                            next_id += 1;
                            let token = next_id;
                            let r =
                                Queued::new(&q, &cached.overlaps, id.clone(), update, now, token);
                            match s.enqueue(r) {
                                Ok(()) => {
                                    assert!(m.queue.len() < m.cfg.max_queued);
                                    // The scheduler clamps jumps to its maximum.
                                    let priority_jump = priority_jump.min(MAX_JUMP);
                                    let order = if m.cfg.wspt {
                                        let best = cached.overlaps.iter().map(|o| o.1).max();
                                        let cached_tokens =
                                            best.unwrap_or(0) as usize * BS as usize;
                                        prompt_tokens.saturating_sub(cached_tokens) as f64
                                            / (1.0 + priority_jump)
                                    } else {
                                        (now - start).as_secs_f64() - priority_jump
                                    };
                                    // After every request of lower or equal order.
                                    let at =
                                        m.queue.iter().take_while(|r| r.order <= order).count();
                                    m.queue.insert(
                                        at,
                                        RefQueued {
                                            token,
                                            id,
                                            prompt_tokens,
                                            hashes,
                                            cached,
                                            filter,
                                            update,
                                            expected_output,
                                            at: now,
                                            order,
                                        },
                                    );
                                }
                                Err(over) => {
                                    assert_eq!(m.queue.len(), m.cfg.max_queued);
                                    assert_eq!(
                                        over.error(),
                                        ScheduleError::Overloaded {
                                            queued: m.queue.len(),
                                            max: m.cfg.max_queued
                                        }
                                    );
                                    assert_eq!(over.into_token(), token);
                                }
                            }
                        }
                    }
                    (want, got) => panic!("step {step}: model {want:?}, scheduler {got:?}"),
                }
            }
            SchedulerOp::MarkPrefill(i) => {
                let id = pick(i, &ids);
                let got = s.mark_prefill(&id);
                let want = match m.reqs.get_mut(&id) {
                    Some(r) => {
                        r.prefill = 0;
                        true
                    }
                    None => false,
                };
                assert_eq!(got, want);
            }
            SchedulerOp::AddOutput(i, decay) => {
                let id = pick(i, &ids);
                let got = s.add_output_block(&id, decay);
                let want = m.reqs.get_mut(&id).map(|r| {
                    r.generated += 1;
                    let full = r.generated.max(r.expected);
                    r.output = match decay {
                        Some(f) => (f64::from(full) * f).ceil() as u32,
                        None => full,
                    };
                    r.output
                });
                assert_eq!(got, want);
                if let Some(n) = want {
                    assert_eq!(s.output_blocks(&id), Some(n));
                }
            }
            SchedulerOp::Free(i) => {
                let id = pick(i, &ids);
                assert_eq!(s.free(&id), m.reqs.remove(&id).is_some());
            }
            SchedulerOp::Sweep => {
                let mut got = s.sweep(now);
                got.sort();
                let want: Vec<String> = m
                    .reqs
                    .iter()
                    .filter(|(_, r)| now.duration_since(r.added) >= TIMEOUT)
                    .map(|(id, _)| id.clone())
                    .collect();
                for id in &want {
                    m.reqs.remove(id);
                }
                assert_eq!(got, want);
            }
            SchedulerOp::Drain => {
                let out = s.drain_ready(now);
                let mut out = out.into_iter();
                let queue = std::mem::take(&mut m.queue);
                for r in queue {
                    if now.duration_since(r.at) >= QUEUE_TIMEOUT {
                        let (token, res) = out.next().expect("timed-out request reported");
                        assert_eq!((token, res), (r.token, Err(ScheduleError::QueueTimeout)));
                        continue;
                    }
                    if r.update && m.reqs.contains_key(&r.id) {
                        let (token, res) = out.next().expect("duplicate reported");
                        assert_eq!(
                            (token, res),
                            (r.token, Err(ScheduleError::DuplicateRequest(r.id)))
                        );
                        continue;
                    }
                    match m.verdict(&r.filter) {
                        Err(ScheduleError::AllBusy) => m.queue.push(r),
                        Err(e) => {
                            let (token, res) = out.next().expect("failure reported");
                            assert_eq!((token, res), (r.token, Err(e)));
                        }
                        Ok(free) => {
                            let (token, res) = out.next().expect("placement reported");
                            assert_eq!(token, r.token);
                            let sel = res.expect("placed");
                            m.check_selection(&sel, &free, r.prompt_tokens, &r.hashes, &r.cached);
                            if r.update {
                                m.add(
                                    r.id,
                                    sel.key,
                                    r.prompt_tokens,
                                    &r.hashes,
                                    sel.overlap_blocks,
                                    r.expected_output,
                                    now,
                                );
                            }
                        }
                    }
                }
                assert!(out.next().is_none(), "unexpected extra drain output");
            }
        }
        check_state(&s, &m);
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 512,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn matches_reference_model(cfg in cfg(), ops in prop::collection::vec(scheduler_op(), 1..120)) {
        run_against_model(cfg, ops);
    }
}

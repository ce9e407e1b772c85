//! The scheduler: filters, busy thresholds, cost-based choice, active sequences, queue.

use crate::active::{ActiveSequences, KeyLoad, ReportedLoad, RequestId, Slot};
use crate::config::{QueuePolicy, RoutingPolicy, SchedulerConfig};
use crate::cost::{self, CostParams, KeyCost};
use crate::echo::{EchoLoad, PeerEcho};
use crate::error::ScheduleError;
use crate::queue::{Overloaded, Queued, RequestQueue};
use crate::route_query::RouteQuery;
use fastrand::Rng;
use kvrouter_protocol::limits::{MAX_EXPECTED_OUTPUT_TOKENS, MAX_FALLBACKS};
use kvrouter_protocol::{Lease, SequenceHash, TierBlocks, WorkerId, WorkerKey};
use std::time::{Duration, Instant};

/// The chosen worker key and why.
#[derive(Clone, Debug, PartialEq)]
pub struct Selection {
    pub key: WorkerKey,
    /// Leading blocks of the request cached on the key's device.
    pub overlap_blocks: u32,
    /// The key's cached prefix by tier (`device` = `overlap_blocks`).
    pub tier_overlap_blocks: TierBlocks,
    pub cost: f64,
    /// The cheapest cost among the other eligible keys (any worker's, another rank of the
    /// chosen worker too): how close the choice was. `None` when there was no other.
    pub runner_up_cost: Option<f64>,
    pub prefill_blocks: f64,
    pub decode_blocks: u64,
    /// The next-best keys by cost, best first, with their device overlap: other workers
    /// than the chosen key's, the cheapest rank of each, as many as the query asked for (at
    /// most [`MAX_FALLBACKS`]). Not booked.
    pub fallbacks: Vec<(WorkerKey, u32)>,
    /// How long the request waited in the queue before it was placed (zero if it was
    /// placed on arrival).
    pub queued: Duration,
}

/// What a key's load would be if the request went there.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct PotentialLoad {
    pub key: WorkerKey,
    pub overlap_blocks: u32,
    pub potential_prefill_blocks: f64,
    pub potential_decode_blocks: u64,
}

/// One model's scheduling core. `P` is an opaque token carried by queued requests (the
/// owning actor's reply port); use the default `()` when the queue is not needed.
///
/// Overlaps are passed as a sparse list `&[(WorkerKey, u32)]` (what the indexer returns:
/// only keys with overlap > 0); a key missing from it has overlap 0, a key listed twice
/// counts with its largest overlap, keys the scheduler does not know are ignored.
#[derive(Debug)]
pub struct Scheduler<P = ()> {
    config: SchedulerConfig,
    params: CostParams,
    rng: Rng,
    active: ActiveSequences,
    queue: RequestQueue<P>,
    // Scratch reused by every call (sized by slot; all zero between calls).
    overlap_by_slot: Vec<TierBlocks>,
    /// The shared-storage overlap of a key with none listed, for the call in progress.
    shared_default: u32,
    hits_by_slot: Vec<u32>,
    touched: Vec<Slot>,
    /// Leading request blocks active on each slot (predicted blocks; zero between calls)
    /// and the slots with any.
    prefix_by_slot: Vec<u32>,
    prefix_touched: Vec<Slot>,
    hashes: Vec<SequenceHash>,
    candidates: Vec<Slot>,
    scored: Vec<(Slot, TierBlocks, KeyCost)>,
    weights: Vec<f64>,
    /// Round-robin position.
    turn: usize,
    /// Where fcfs queue order counts time from.
    epoch: Instant,
    echo: PeerEcho,
    /// Load charged for peers' simultaneous picks (by slot; zero between calls) and the
    /// slots charged.
    peer_picks: Vec<EchoLoad>,
    charged: Vec<Slot>,
}

impl<P> Scheduler<P> {
    /// A scheduler with no worker keys. Fails on an invalid config.
    pub fn new(config: SchedulerConfig) -> Result<Self, ScheduleError> {
        config.validate()?;
        Ok(Self {
            params: CostParams {
                block_size: config.block_size,
                overlap_credit: config.overlap_credit,
                prefill_load_scale: config.prefill_load_scale,
                host_cache_hit_weight: config.host_cache_hit_weight,
                disk_cache_hit_weight: config.disk_cache_hit_weight,
                shared_cache_hit_weight: config.shared_cache_hit_weight,
                active_prefix_credit: config.active_prefix_credit,
                prefill_queue_cap_tokens: config.prefill_queue_cap_tokens,
            },
            rng: Rng::with_seed(config.seed),
            queue: RequestQueue::new(config.max_queued_requests),
            config,
            active: ActiveSequences::default(),
            overlap_by_slot: Vec::new(),
            shared_default: 0,
            hits_by_slot: Vec::new(),
            touched: Vec::new(),
            prefix_by_slot: Vec::new(),
            prefix_touched: Vec::new(),
            hashes: Vec::new(),
            candidates: Vec::new(),
            scored: Vec::new(),
            weights: Vec::new(),
            turn: 0,
            epoch: Instant::now(),
            echo: PeerEcho::default(),
            peer_picks: Vec::new(),
            charged: Vec::new(),
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Sets the model's block size once it is known (e.g. from the first worker's
    /// registration); 0 is ignored. Prefill load is kept in tokens, so nothing recorded
    /// needs converting.
    pub fn set_block_size(&mut self, block_size: u32) {
        if block_size > 0 {
            self.config.block_size = block_size;
            self.params.block_size = block_size;
        }
    }

    // ---- worker keys -------------------------------------------------------------

    /// Adds a worker key, or updates its capacity if known. True if the key is new.
    pub fn add_worker_key(&mut self, key: WorkerKey, capacity_blocks: u64) -> bool {
        self.active.add_key(key, capacity_blocks)
    }

    /// Removes a worker key; returns the active sequences dropped with it (sorted).
    pub fn remove_worker_key(&mut self, key: WorkerKey) -> Vec<RequestId> {
        if let Some(slot) = self.active.slot_of(key) {
            self.echo.clear_slot(slot);
        }
        let dropped = self.active.remove_key(key).unwrap_or_default();
        if !dropped.is_empty() {
            tracing::debug!(%key, dropped = dropped.len(), "worker key removed with active sequences");
        }
        dropped
    }

    /// Removes every key of a worker; returns the dropped active sequences (sorted).
    pub fn remove_worker(&mut self, worker_id: WorkerId) -> Vec<RequestId> {
        let slots: Vec<Slot> = (self.active.slots())
            .filter(|&s| self.active.state(s).key.worker_id == worker_id)
            .collect();
        for slot in slots {
            self.echo.clear_slot(slot);
        }
        self.active.remove_worker(worker_id)
    }

    /// Known worker keys (in slot order; stable while the set of keys is unchanged).
    pub fn worker_keys(&self) -> impl Iterator<Item = WorkerKey> + '_ {
        self.active.states().map(|s| s.key)
    }

    pub fn has_key(&self, key: WorkerKey) -> bool {
        self.active.slot_of(key).is_some()
    }

    pub fn has_worker(&self, worker_id: WorkerId) -> bool {
        self.active.has_worker(worker_id)
    }

    /// Records a worker rank's own load report. False if the key is unknown.
    pub fn set_reported_load(&mut self, key: WorkerKey, load: ReportedLoad) -> bool {
        match self.active.slot_of(key) {
            Some(slot) => {
                self.active.state_mut(slot).load.reported = Some(load);
                true
            }
            None => false,
        }
    }

    // ---- loads ---------------------------------------------------------------------

    /// Every key's load (for metrics).
    pub fn loads(&self) -> impl Iterator<Item = (WorkerKey, KeyLoad)> + '_ {
        self.active.states().map(|s| (s.key, s.load))
    }

    pub fn load(&self, key: WorkerKey) -> Option<KeyLoad> {
        self.active.slot_of(key).map(|s| self.active.state(s).load)
    }

    /// Whether a key is over a busy threshold (None if unknown).
    pub fn is_busy(&self, key: WorkerKey) -> Option<bool> {
        self.active
            .slot_of(key)
            .map(|s| is_busy(&self.config, &self.active.state(s).load))
    }

    /// Number of active sequences.
    pub fn active_requests(&self) -> usize {
        self.active.request_count()
    }

    pub fn contains_request(&self, request_id: &str) -> bool {
        self.active.contains(request_id)
    }

    /// For every key (filters ignored, slot order): its load if the request went there.
    pub fn potential_loads(
        &mut self,
        req: &RouteQuery<'_>,
        overlaps: &[(WorkerKey, u32)],
    ) -> Vec<PotentialLoad> {
        let distinct = self.prepare_scratch(req, overlaps);
        let request_blocks = cost::request_blocks(req.prompt_tokens, self.config.block_size);
        let out = self
            .active
            .slots()
            .map(|slot| {
                let (cached, c) = self.cost_of(&self.params, slot, request_blocks, distinct, false);
                PotentialLoad {
                    key: self.active.state(slot).key,
                    overlap_blocks: cached.device,
                    potential_prefill_blocks: c.prefill_blocks,
                    potential_decode_blocks: c.decode_blocks,
                }
            })
            .collect();
        self.reset_scratch(req, overlaps);
        out
    }

    // ---- choice --------------------------------------------------------------------

    /// Picks a worker key for the request without recording it.
    pub fn select(
        &mut self,
        req: &RouteQuery<'_>,
        overlaps: &[(WorkerKey, u32)],
    ) -> Result<Selection, ScheduleError> {
        self.select_slot(req, overlaps).map(|(s, _)| s)
    }

    /// `select`, then (if `update_states`) records the request as an active sequence on
    /// the chosen key, with `prompt_tokens - overlap × block_size` prefill tokens.
    pub fn route(
        &mut self,
        req: &RouteQuery<'_>,
        overlaps: &[(WorkerKey, u32)],
        request_id: RequestId,
        update_states: bool,
        now: Instant,
    ) -> Result<Selection, ScheduleError> {
        if update_states && self.active.contains(&request_id) {
            return Err(ScheduleError::DuplicateRequest(request_id));
        }
        self.echo.expire(now);
        let (sel, slot) = self.select_slot(req, overlaps)?;
        if update_states {
            self.record(request_id, slot, &sel, req, now)?;
        }
        Ok(sel)
    }

    /// Blocks the request's expected output fills (rounded up), at most
    /// [`MAX_EXPECTED_OUTPUT_TOKENS`] worth and at most the chosen key's registered capacity
    /// (when known): no one request's output outgrows the rank's KV cache.
    fn expected_output_blocks(&self, req: &RouteQuery<'_>, slot: Slot) -> u32 {
        let tokens = req
            .expected_output_tokens
            .unwrap_or(0)
            .min(MAX_EXPECTED_OUTPUT_TOKENS);
        let blocks = tokens.div_ceil(self.config.block_size.max(1));
        match self.active.state(slot).load.capacity_blocks {
            0 => blocks,
            cap => blocks.min(u32::try_from(cap).unwrap_or(u32::MAX)),
        }
    }

    /// Records a routed request as an active sequence on its chosen slot.
    fn record(
        &mut self,
        request_id: RequestId,
        slot: Slot,
        sel: &Selection,
        req: &RouteQuery<'_>,
        now: Instant,
    ) -> Result<(), ScheduleError> {
        let prefill = cost::uncached_prefill_tokens(
            req.prompt_tokens,
            sel.overlap_blocks,
            self.config.block_size,
        );
        let output = self.expected_output_blocks(req, slot);
        let blocks_before = self.active.state(slot).load.active_blocks;
        self.active.add_leased(
            request_id,
            slot,
            req.sequence_hashes,
            (prefill, output, req.lease),
            now,
        )?;
        let new_blocks = self.active.state(slot).load.active_blocks - blocks_before;
        self.echo.record(slot, new_blocks, prefill, now);
        Ok(())
    }

    /// Peer echo (replica sync): for `window` after each request this replica routes, its
    /// load counts once more per live peer in the cost, standing for the like decisions
    /// peers routing the same burst make before theirs reach us (see `echo.rs`). No peers
    /// or a zero window turns it off. `ahead`: the live peers before this replica in the
    /// replicas' common order (see `charge_peers_first`).
    pub fn set_peer_echo(&mut self, peers: u32, ahead: u32, window: Duration) {
        self.echo.set(peers, ahead, window);
    }

    /// Records an active sequence on a key directly (e.g. a peer replica's decision).
    pub fn add_request(
        &mut self,
        request_id: RequestId,
        key: WorkerKey,
        sequence_hashes: &[SequenceHash],
        prefill_tokens: u64,
        now: Instant,
    ) -> Result<(), ScheduleError> {
        let slot = self.active.pinned_slot(key)?;
        self.active
            .add(request_id, slot, sequence_hashes, prefill_tokens, 0, now)
    }

    /// Output blocks the request counts in its key's decode load. None if unknown.
    pub fn output_blocks(&self, request_id: &str) -> Option<u32> {
        self.active.output_blocks(request_id)
    }

    /// Sets the output blocks a request counts (a peer's word on its own request). False if
    /// unknown.
    pub fn set_output_blocks(&mut self, request_id: &str, blocks: u32) -> bool {
        self.active.set_output_blocks(request_id, blocks)
    }

    /// The request generated one more block of output (`add_output_block`): its output
    /// counts the larger of the blocks generated and those its route expected, times
    /// `decay_fraction` (the share of its decode still ahead, rounded up; `None`: all).
    /// Returns the blocks it now counts (for peers); None if unknown.
    pub fn add_output_block(
        &mut self,
        request_id: &str,
        decay_fraction: Option<f64>,
    ) -> Option<u32> {
        self.active.add_output_block(request_id, decay_fraction)
    }

    /// Every active sequence (for a peer replica catching up): id, key, its distinct block
    /// hashes, and the prefill tokens still counted (0 once marked).
    pub fn active_sequences(
        &self,
    ) -> impl Iterator<Item = (&RequestId, WorkerKey, &[SequenceHash], u64)> + '_ {
        self.active
            .requests()
            .map(|(id, slot, hashes, prefill)| (id, self.active.state(slot).key, hashes, prefill))
    }

    /// One active sequence by id: its key, distinct block hashes and prefill tokens still
    /// counted.
    pub fn active_sequence(&self, request_id: &str) -> Option<(WorkerKey, &[SequenceHash], u64)> {
        self.active
            .request(request_id)
            .map(|(slot, hashes, prefill)| (self.active.state(slot).key, hashes, prefill))
    }

    /// Whether `presented` may mark, extend or free the request: the lease its route was
    /// booked under, or any lease for one booked without (a peer's, a previous-version
    /// caller's). `None` if the request is unknown.
    pub fn lease_admits(&self, request_id: &str, presented: Lease) -> Option<bool> {
        self.active.lease_admits(request_id, presented)
    }

    /// The request finished prefill. False if unknown.
    pub fn mark_prefill(&mut self, request_id: &str) -> bool {
        self.active.mark_prefill(request_id)
    }

    /// The request finished. False if unknown.
    pub fn free(&mut self, request_id: &str) -> bool {
        self.active.free(request_id)
    }

    /// Frees active sequences added `request_timeout` or longer before `now` (oldest
    /// first). Does not touch the queue: `drain_ready` times queued requests out.
    pub fn sweep(&mut self, now: Instant) -> Vec<RequestId> {
        let freed = self.active.sweep(now, self.config.request_timeout);
        if !freed.is_empty() {
            tracing::debug!(freed = freed.len(), "swept timed-out active sequences");
        }
        freed
    }

    // ---- queue ---------------------------------------------------------------------

    /// Queues a request that found every candidate busy; gives it back when the queue
    /// is full.
    /// Queues a request that found every candidate busy, in the order of the queue policy.
    pub fn enqueue(&mut self, mut pending: Queued<P>) -> Result<(), Overloaded<P>> {
        // A priority jump of `j` seconds: under fcfs the request counts as arrived `j`
        // earlier; under wspt its weight is `1 + j` (its uncached tokens divided by it).
        let jump = clamp_priority_jump(pending.priority_jump, self.config.max_priority_jump);
        pending.order = match self.config.queue_policy {
            QueuePolicy::Fcfs => {
                let waited = pending.enqueued_at.saturating_duration_since(self.epoch);
                waited.as_secs_f64() - jump
            }
            QueuePolicy::Wspt => {
                let best = pending.overlaps.iter().map(|&(_, o)| o).max().unwrap_or(0);
                let cached = best as usize * self.config.block_size as usize;
                pending.prompt_tokens.saturating_sub(cached) as f64 / (1.0 + jump)
            }
        };
        self.queue.push(pending)
    }

    pub fn queue_len(&self) -> usize {
        self.queue.len()
    }

    /// Empties the queue (e.g. on shutdown), FIFO order.
    pub fn take_queued(&mut self) -> Vec<Queued<P>> {
        self.queue.drain().collect()
    }

    /// Retries queued requests in queue order (call after any state change). Returns, in
    /// queue order, those placed now, those that now fail for a reason other than
    /// busy (e.g. their pinned worker left), and those queued `queue_timeout` or longer
    /// (`QueueTimeout`); the still-busy ones stay queued in order.
    pub fn drain_ready(&mut self, now: Instant) -> Vec<(P, Result<Selection, ScheduleError>)> {
        self.echo.expire(now);
        let mut out = Vec::new();
        // Busy depends only on key load and placing a request only adds load: once an
        // unfiltered request found every key busy, later unfiltered ones will too.
        let mut all_busy = false;
        for _ in 0..self.queue.len() {
            let Some(r) = self.queue.pop_front() else {
                break;
            };
            if now.saturating_duration_since(r.enqueued_at) >= self.config.queue_timeout {
                out.push((r.token, Err(ScheduleError::QueueTimeout)));
                continue;
            }
            let query = r.query();
            let unfiltered = !query.is_filtered();
            if unfiltered && all_busy {
                self.queue.requeue(r);
                continue;
            }
            if r.update_states && self.active.contains(&r.request_id) {
                out.push((r.token, Err(ScheduleError::DuplicateRequest(r.request_id))));
                continue;
            }
            match self.select_slot(&query, &r.overlaps) {
                Err(ScheduleError::AllBusy) => {
                    all_busy |= unfiltered;
                    self.queue.requeue(r);
                }
                Err(e) => out.push((r.token, Err(e))),
                Ok((mut sel, slot)) => {
                    sel.queued = now.saturating_duration_since(r.enqueued_at);
                    let result = if r.update_states {
                        let id = r.request_id.clone();
                        self.record(id, slot, &sel, &query, now).map(|()| sel)
                    } else {
                        Ok(sel)
                    };
                    out.push((r.token, result));
                }
            }
        }
        out
    }

    // ---- internals -------------------------------------------------------------------

    /// Fills `self.candidates` with the slots the filters allow (before busy).
    fn filter_candidates(&mut self, req: &RouteQuery<'_>) -> Result<(), ScheduleError> {
        req.filters.candidates(&self.active, &mut self.candidates)
    }

    /// Loads overlaps and "blocks already active" counts into the per-slot scratch;
    /// returns the number of distinct request blocks. Undo with `reset_scratch`.
    fn prepare_scratch(&mut self, req: &RouteQuery<'_>, overlaps: &[(WorkerKey, u32)]) -> u64 {
        let bound = self.active.slot_bound();
        if self.overlap_by_slot.len() < bound {
            self.overlap_by_slot.resize(bound, TierBlocks::default());
            self.hits_by_slot.resize(bound, 0);
            self.prefix_by_slot.resize(bound, 0);
            self.peer_picks.resize(bound, EchoLoad::default());
        }
        for &(key, overlap) in overlaps {
            if let Some(slot) = self.active.slot_of(key) {
                let o = &mut self.overlap_by_slot[slot as usize];
                o.device = o.device.max(overlap);
            }
        }
        for &(key, tiers) in req.lower_tiers {
            if let Some(slot) = self.active.slot_of(key) {
                self.overlap_by_slot[slot as usize] = tiers;
            }
        }
        self.shared_default = req.shared_blocks;
        self.hashes.clear();
        self.hashes.extend_from_slice(req.sequence_hashes);
        self.hashes.sort_unstable();
        self.hashes.dedup();
        if self.active.request_count() > 0 {
            let (hits, touched) = (&mut self.hits_by_slot, &mut self.touched);
            for &h in &self.hashes {
                self.active.for_each_holder(h, |slot| {
                    let n = &mut hits[slot as usize];
                    if *n == 0 {
                        touched.push(slot);
                    }
                    *n += 1;
                });
            }
            if self.params.active_prefix_credit > 0.0 {
                self.active_prefixes(req.sequence_hashes);
            }
        }
        self.hashes.len() as u64
    }

    /// Predicted blocks: for every slot, how many of the request's leading blocks belong
    /// to requests active there (a slot's run ends at the first block it lacks).
    fn active_prefixes(&mut self, hashes: &[SequenceHash]) {
        let (prefix, touched) = (&mut self.prefix_by_slot, &mut self.prefix_touched);
        for (i, &h) in hashes.iter().enumerate() {
            let i = i as u32;
            let mut extended = false;
            self.active.for_each_holder(h, |slot| {
                let n = &mut prefix[slot as usize];
                if *n == i {
                    if i == 0 {
                        touched.push(slot);
                    }
                    *n += 1;
                    extended = true;
                }
            });
            if !extended {
                break;
            }
        }
    }

    fn reset_scratch(&mut self, req: &RouteQuery<'_>, overlaps: &[(WorkerKey, u32)]) {
        let keys = overlaps.iter().map(|(k, _)| *k);
        for key in keys.chain(req.lower_tiers.iter().map(|(k, _)| *k)) {
            if let Some(slot) = self.active.slot_of(key) {
                self.overlap_by_slot[slot as usize] = TierBlocks::default();
            }
        }
        for slot in self.touched.drain(..) {
            self.hits_by_slot[slot as usize] = 0;
        }
        for slot in self.prefix_touched.drain(..) {
            self.prefix_by_slot[slot as usize] = 0;
        }
        for slot in self.charged.drain(..) {
            self.peer_picks[slot as usize] = EchoLoad::default();
        }
    }

    /// Replica sync, during a burst: peers decide at this same moment on the same view, and
    /// whatever they pick before our decision reaches them we cannot see. The replicas
    /// agree on an order (by id), and this one charges, per peer ahead of it, a request the
    /// size of this one on the key a request with no cached blocks would take: the likeliest
    /// place for a request we do not know. So the replicas of a burst fan out instead of
    /// all taking the same best key; a request whose blocks are cached stays with them
    /// unless such a pick there outweighs what the cache saves. An isolated request is
    /// routed on the view alone. Needs the scratch
    /// prepared (undone by `reset_scratch`).
    fn charge_peers_first(&mut self, prompt_tokens: usize, request_blocks: u64, distinct: u64) {
        let ahead = self.echo.peers_first();
        if ahead == 0 {
            return;
        }
        for _ in 0..ahead {
            let mut best: Option<(Slot, f64)> = None;
            for &slot in &self.candidates {
                let load = &self.active.state(slot).load;
                let (e, p) = (self.echo.load(slot), self.peer_picks[slot as usize]);
                let c = cost::key_cost(
                    &self.params,
                    request_blocks,
                    TierBlocks::default(),
                    0,
                    load.prefill_tokens + e.prefill_tokens + p.prefill_tokens,
                    load.active_blocks + e.blocks + p.blocks,
                    distinct,
                );
                if best.is_none_or(|(_, b)| c.cost < b) {
                    best = Some((slot, c.cost));
                }
            }
            let Some((slot, _)) = best else { return };
            let p = &mut self.peer_picks[slot as usize];
            if *p == EchoLoad::default() {
                self.charged.push(slot);
            }
            p.blocks += distinct;
            p.prefill_tokens += prompt_tokens as u64;
        }
    }

    /// Cost of `slot` with the scratch prepared; `with_echo` adds the peer-echo guess.
    fn cost_of(
        &self,
        params: &CostParams,
        slot: Slot,
        request_blocks: u64,
        distinct: u64,
        with_echo: bool,
    ) -> (TierBlocks, KeyCost) {
        let load = &self.active.state(slot).load;
        let echo = if with_echo {
            let (e, p) = (self.echo.load(slot), self.peer_picks[slot as usize]);
            EchoLoad {
                blocks: e.blocks + p.blocks,
                prefill_tokens: e.prefill_tokens + p.prefill_tokens,
            }
        } else {
            Default::default()
        };
        let mut cached = self.overlap_by_slot[slot as usize];
        if cached == TierBlocks::default() {
            cached.shared = self.shared_default; // a key holding nothing else
        }
        let new_blocks = distinct - u64::from(self.hits_by_slot[slot as usize]);
        let c = cost::key_cost(
            params,
            request_blocks,
            cached,
            self.prefix_by_slot[slot as usize],
            load.prefill_tokens + echo.prefill_tokens,
            load.active_blocks + echo.blocks,
            new_blocks,
        );
        (cached, c)
    }

    /// Up to `wanted` (at most [`MAX_FALLBACKS`]) of the scored candidates, cheapest first,
    /// one key per worker and none of `chosen`'s: where a caller may go if its choice fails.
    /// Reorders `scored`.
    fn fallbacks(
        &self,
        scored: &mut [(Slot, TierBlocks, KeyCost)],
        chosen: WorkerId,
        wanted: u8,
    ) -> Vec<(WorkerKey, u32)> {
        let wanted = usize::from(wanted.min(MAX_FALLBACKS));
        if wanted == 0 {
            return Vec::new();
        }
        scored.sort_unstable_by(|a, b| a.2.cost.total_cmp(&b.2.cost));
        let mut out: Vec<(WorkerKey, u32)> = Vec::with_capacity(wanted);
        for (slot, cached, _) in scored.iter() {
            let key = self.active.state(*slot).key;
            if key.worker_id != chosen && out.iter().all(|(k, _)| k.worker_id != key.worker_id) {
                out.push((key, cached.device));
                if out.len() == wanted {
                    break;
                }
            }
        }
        out
    }

    fn select_slot(
        &mut self,
        req: &RouteQuery<'_>,
        overlaps: &[(WorkerKey, u32)],
    ) -> Result<(Selection, Slot), ScheduleError> {
        self.filter_candidates(req)?;
        let (config, active) = (&self.config, &self.active);
        self.candidates
            .retain(|&s| !is_busy(config, &active.state(s).load));
        if self.candidates.is_empty() {
            return Err(ScheduleError::AllBusy);
        }

        let distinct = self.prepare_scratch(req, overlaps);
        let request_blocks = cost::request_blocks(req.prompt_tokens, self.config.block_size);
        if self.config.policy == RoutingPolicy::Kv {
            self.charge_peers_first(req.prompt_tokens, request_blocks, distinct);
        }
        let o = &req.overrides;
        let params = CostParams {
            overlap_credit: o.overlap_credit.unwrap_or(self.params.overlap_credit),
            host_cache_hit_weight: (o.host_cache_hit_weight)
                .unwrap_or(self.params.host_cache_hit_weight),
            disk_cache_hit_weight: (o.disk_cache_hit_weight)
                .unwrap_or(self.params.disk_cache_hit_weight),
            shared_cache_hit_weight: (o.shared_cache_hit_weight)
                .unwrap_or(self.params.shared_cache_hit_weight),
            ..self.params
        };
        let temperature = req.overrides.temperature.unwrap_or(self.config.temperature);
        let mut scored = std::mem::take(&mut self.scored);
        scored.clear();
        scored.extend(self.candidates.iter().map(|&slot| {
            let (cached, c) = self.cost_of(&params, slot, request_blocks, distinct, true);
            (slot, cached, c)
        }));
        self.reset_scratch(req, overlaps);

        let i = match self.config.policy {
            RoutingPolicy::Kv => cost::choose(
                &mut self.rng,
                temperature,
                scored.len(),
                |i| scored[i].2.cost,
                &mut self.weights,
            )
            .unwrap_or(0),
            RoutingPolicy::RoundRobin => {
                self.turn = self.turn.wrapping_add(1);
                self.turn % scored.len()
            }
            RoutingPolicy::Random => self.rng.usize(..scored.len()),
            RoutingPolicy::LeastLoaded => {
                let bs = f64::from(self.config.block_size);
                let active = &self.active;
                cost::choose(
                    &mut self.rng,
                    0.0,
                    scored.len(),
                    |i| {
                        let load = &active.state(scored[i].0).load;
                        load.active_blocks as f64 + load.prefill_tokens as f64 / bs
                    },
                    &mut self.weights,
                )
                .unwrap_or(0)
            }
        };
        let (slot, cached, c) = scored[i];
        let key = self.active.state(slot).key;
        let runner_up_cost = (scored.iter().enumerate())
            .filter(|&(j, _)| j != i)
            .map(|(_, s)| s.2.cost)
            .min_by(f64::total_cmp);
        let fallbacks = self.fallbacks(&mut scored, key.worker_id, req.fallbacks);
        self.scored = scored;
        let sel = Selection {
            key,
            overlap_blocks: cached.device,
            tier_overlap_blocks: cached,
            cost: c.cost,
            runner_up_cost,
            prefill_blocks: c.prefill_blocks,
            decode_blocks: c.decode_blocks,
            fallbacks,
            queued: Duration::ZERO,
        };
        tracing::trace!(key = %sel.key, cost = sel.cost, overlap = cached.device, lower = cached.lower(), "selected");
        Ok((sel, slot))
    }
}

/// Busy thresholds. The blocks threshold uses the larger of the tracked and the reported
/// active blocks (an engine's own figure is the fresher one when it is higher), and does not
/// apply to a key of unknown (0) capacity. Waiting requests are the engine's own count.
/// A request's priority jump as the queue counts it: at most `max` seconds; a value that is
/// not a finite number ≥ 0 (replicas refuse those before they get here) counts as none.
pub fn clamp_priority_jump(jump: f64, max: f64) -> f64 {
    if jump.is_finite() && jump > 0.0 {
        jump.min(max)
    } else {
        0.0
    }
}

fn is_busy(config: &SchedulerConfig, load: &KeyLoad) -> bool {
    if let Some(frac) = config.busy_active_blocks_frac {
        if load.capacity_blocks > 0 {
            let reported = load.reported.map_or(0, |r| r.active_blocks);
            let active = load.active_blocks.max(reported);
            if active as f64 >= frac * load.capacity_blocks as f64 {
                return true;
            }
        }
    }
    if let (Some(t), Some(r)) = (config.busy_waiting_requests, load.reported) {
        if r.waiting_requests >= t {
            return true;
        }
    }
    config
        .busy_prefill_tokens
        .is_some_and(|t| load.prefill_tokens >= t)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::FilterView;
    use kvrouter_protocol::RouteOverrides;
    use std::collections::BTreeMap;
    use std::time::Duration;

    const BS: u32 = 4;

    fn sched(f: impl FnOnce(&mut SchedulerConfig)) -> Scheduler<u32> {
        let mut c = SchedulerConfig {
            block_size: BS,
            seed: 42,
            ..Default::default()
        };
        f(&mut c);
        Scheduler::new(c).unwrap()
    }

    fn k(w: u64, r: u32) -> WorkerKey {
        WorkerKey::new(w, r)
    }

    fn hs(v: &[u64]) -> Vec<SequenceHash> {
        v.iter().map(|&x| SequenceHash(x)).collect()
    }

    /// A booking holds its route's lease: only that lease may act on it; one booked without
    /// a lease (a peer's, or a previous-version caller's) admits any.
    #[test]
    fn bookings_admit_their_lease_only() {
        let mut s = sched(|_| {});
        let now = Instant::now();
        s.add_worker_key(k(1, 0), 100);
        let h = hs(&[1, 2]);
        let lease = Lease::random();
        let q = RouteQuery {
            lease,
            ..RouteQuery::new(8, &h)
        };
        s.route(&q, &[], "a".into(), true, now).unwrap();
        assert_eq!(s.lease_admits("a", lease), Some(true));
        assert_eq!(s.lease_admits("a", Lease::random()), Some(false));
        assert_eq!(s.lease_admits("a", Lease::NONE), Some(false));
        assert_eq!(s.lease_admits("b", lease), None);
        s.route(&RouteQuery::new(8, &h), &[], "unleased".into(), true, now)
            .unwrap();
        assert_eq!(s.lease_admits("unleased", Lease::random()), Some(true));
        s.add_request("peer:x".into(), k(1, 0), &h, 0, now).unwrap();
        assert_eq!(s.lease_admits("peer:x", Lease::NONE), Some(true));
        assert!(s.free("a"));
        assert_eq!(s.lease_admits("a", lease), None);
    }

    proptest::proptest! {
        /// Fallbacks, against a reference: each candidate worker's cost is the cheapest of
        /// its keys as a pinned selection prices it; the fallbacks are the cheapest workers
        /// but the chosen one's, best first, as many as asked for (at most MAX_FALLBACKS),
        /// each at its cheapest key. The runner-up's cost is the cheapest other key's.
        #[test]
        fn fallbacks_are_the_next_cheapest_workers(
            ranks in proptest::collection::vec(1u32..4, 1..12),
            overlaps in proptest::collection::vec((0u64..12, 0u32..3, 0u32..6), 0..24),
            booked in proptest::collection::vec((0u64..12, 0u32..3, 1u64..40), 0..12),
            wanted in 0u8..12,
        ) {
            let mut s = sched(|c| c.temperature = 0.0);
            let now = Instant::now();
            for (w, &n) in ranks.iter().enumerate() {
                for r in 0..n {
                    s.add_worker_key(k(w as u64, r), 1000);
                }
            }
            let has = |w: u64, r: u32| ranks.get(w as usize).is_some_and(|&n| r < n);
            for (i, &(w, r, tokens)) in booked.iter().enumerate() {
                if has(w, r) {
                    s.add_request(format!("b{i}"), k(w, r), &[], tokens, now).unwrap();
                }
            }
            let mut ov: Vec<(WorkerKey, u32)> = Vec::new();
            for &(w, r, o) in &overlaps {
                if has(w, r) && !ov.iter().any(|(key, _)| *key == k(w, r)) {
                    ov.push((k(w, r), o));
                }
            }
            let h = hs(&[1, 2, 3, 4, 5, 6]);
            let q = RouteQuery { fallbacks: wanted, ..RouteQuery::new(24, &h) };
            let sel = s.select(&q, &ov).unwrap();
            let mut cheapest: BTreeMap<u64, f64> = BTreeMap::new();
            let mut runner_up: Option<f64> = None;
            for key in s.worker_keys().collect::<Vec<_>>() {
                let pinned = RouteQuery {
                    filters: FilterView { pinned: Some(key), ..q.filters },
                    fallbacks: 0,
                    ..q
                };
                let c = s.select(&pinned, &ov).unwrap().cost;
                let e = cheapest.entry(key.worker_id).or_insert(f64::INFINITY);
                *e = e.min(c);
                if key != sel.key {
                    runner_up = Some(runner_up.map_or(c, |r| r.min(c)));
                }
            }
            proptest::prop_assert_eq!(sel.runner_up_cost, runner_up);
            if let Some(r) = runner_up {
                proptest::prop_assert!(r >= sel.cost, "the choice is the cheapest at temperature 0");
            }
            let mut others: Vec<f64> = cheapest
                .iter()
                .filter(|(w, _)| **w != sel.key.worker_id)
                .map(|(_, c)| *c)
                .collect();
            others.sort_by(f64::total_cmp);
            let n = usize::from(wanted.min(MAX_FALLBACKS)).min(others.len());
            proptest::prop_assert_eq!(sel.fallbacks.len(), n);
            let mut seen = std::collections::BTreeSet::new();
            for (i, &(key, overlap)) in sel.fallbacks.iter().enumerate() {
                proptest::prop_assert!(key.worker_id != sel.key.worker_id);
                proptest::prop_assert!(seen.insert(key.worker_id), "one key per worker");
                let pinned = RouteQuery {
                    filters: FilterView { pinned: Some(key), ..q.filters },
                    fallbacks: 0,
                    ..q
                };
                let at = s.select(&pinned, &ov).unwrap();
                proptest::prop_assert_eq!(at.cost, cheapest[&key.worker_id], "its cheapest key");
                proptest::prop_assert_eq!(at.cost, others[i], "best first");
                proptest::prop_assert_eq!(overlap, at.overlap_blocks);
            }
        }
    }

    #[test]
    fn is_send() {
        fn assert_send<T: Send>() {}
        assert_send::<Scheduler<u32>>();
    }

    #[test]
    fn invalid_config_is_rejected() {
        let c = SchedulerConfig {
            block_size: 0,
            ..Default::default()
        };
        assert!(matches!(
            Scheduler::<()>::new(c),
            Err(ScheduleError::InvalidConfig(_))
        ));
    }

    #[test]
    fn filters() {
        let mut s = sched(|_| {});
        let h = hs(&[1]);
        let q = RouteQuery::new(4, &h);
        assert_eq!(s.select(&q, &[]), Err(ScheduleError::NoWorkers));
        s.add_worker_key(k(1, 0), 100);
        s.add_worker_key(k(1, 1), 100);
        s.add_worker_key(k(2, 0), 100);

        let pinned = |key| RouteQuery {
            filters: FilterView {
                pinned: Some(key),
                ..q.filters
            },
            ..q
        };
        assert_eq!(
            s.select(&pinned(k(9, 0)), &[]),
            Err(ScheduleError::UnknownWorker(9))
        );
        assert_eq!(
            s.select(&pinned(k(1, 5)), &[]),
            Err(ScheduleError::InvalidRank {
                worker_id: 1,
                dp_rank: 5
            })
        );
        for _ in 0..20 {
            assert_eq!(s.select(&pinned(k(1, 1)), &[]).unwrap().key, k(1, 1));
        }
        let allowed = [7u64, 8];
        let q_allowed = RouteQuery {
            filters: FilterView {
                allowed_workers: Some(&allowed),
                ..q.filters
            },
            ..q
        };
        assert_eq!(
            s.select(&q_allowed, &[]),
            Err(ScheduleError::NoAllowedWorkers)
        );
        let empty: [u64; 0] = [];
        let q_empty = RouteQuery {
            filters: FilterView {
                allowed_workers: Some(&empty),
                ..q.filters
            },
            ..q
        };
        assert_eq!(
            s.select(&q_empty, &[]),
            Err(ScheduleError::NoAllowedWorkers)
        );
        let allowed = [2u64, 7, 2];
        let q_allowed = RouteQuery {
            filters: FilterView {
                allowed_workers: Some(&allowed),
                ..q.filters
            },
            ..q
        };
        for _ in 0..20 {
            assert_eq!(s.select(&q_allowed, &[]).unwrap().key, k(2, 0));
        }
        // Pinned outside the allowed list.
        let q_conflict = RouteQuery {
            filters: FilterView {
                pinned: Some(k(1, 0)),
                ..q_allowed.filters
            },
            ..q_allowed
        };
        assert_eq!(
            s.select(&q_conflict, &[]),
            Err(ScheduleError::NoAllowedWorkers)
        );

        let q_worker = |w| RouteQuery {
            filters: FilterView {
                pinned_worker: Some(w),
                ..q.filters
            },
            ..q
        };
        assert_eq!(
            s.select(&q_worker(9), &[]),
            Err(ScheduleError::UnknownWorker(9))
        );
        let mut seen = [false; 2];
        for _ in 0..50 {
            let sel = s.select(&q_worker(1), &[]).unwrap();
            assert_eq!(sel.key.worker_id, 1);
            seen[sel.key.dp_rank as usize] = true;
        }
        assert_eq!(seen, [true, true]);
    }

    #[test]
    fn allowed_keys_narrow_the_other_filters_down_to_the_rank() {
        let mut s = sched(|_| {});
        let h = hs(&[1]);
        let q = RouteQuery::new(4, &h);
        // A worker with ranks 2..4 (dp_start_rank 2) and one with a single rank.
        for key in [k(1, 2), k(1, 3), k(2, 0)] {
            s.add_worker_key(key, 100);
        }
        let keys = [k(1, 3), k(9, 0)];
        let q_keys = RouteQuery {
            filters: FilterView {
                allowed_keys: Some(&keys),
                ..q.filters
            },
            ..q
        };
        assert!(q_keys.is_filtered());
        for _ in 0..20 {
            // Rank 3 wins even though rank 2 caches the whole prompt.
            assert_eq!(s.select(&q_keys, &[(k(1, 2), 1)]).unwrap().key, k(1, 3));
        }
        let allowed = [2u64];
        let q_both = RouteQuery {
            filters: FilterView {
                allowed_workers: Some(&allowed),
                ..q_keys.filters
            },
            ..q_keys
        };
        assert_eq!(s.select(&q_both, &[]), Err(ScheduleError::NoAllowedWorkers));
        let none: [WorkerKey; 0] = [];
        let q_none = RouteQuery {
            filters: FilterView {
                allowed_keys: Some(&none),
                ..q.filters
            },
            ..q
        };
        assert_eq!(s.select(&q_none, &[]), Err(ScheduleError::NoAllowedWorkers));
        // A pinned worker narrowed to one of its ranks.
        let q_pin = RouteQuery {
            filters: FilterView {
                pinned_worker: Some(1),
                ..q_keys.filters
            },
            ..q_keys
        };
        for _ in 0..20 {
            assert_eq!(s.select(&q_pin, &[]).unwrap().key, k(1, 3));
        }
    }

    #[test]
    fn excluded_workers_are_never_chosen() {
        let mut s = sched(|_| {});
        let h = hs(&[1]);
        let q = RouteQuery::new(4, &h);
        for key in [k(1, 0), k(1, 1), k(2, 0), k(3, 0)] {
            s.add_worker_key(key, 100);
        }
        let out = [1u64, 3];
        let q_out = RouteQuery {
            filters: FilterView {
                excluded_workers: &out,
                ..q.filters
            },
            ..q
        };
        assert!(q_out.is_filtered());
        // Worker 1 caches the whole prompt on both ranks; it is still never picked.
        for _ in 0..30 {
            let sel = s.select(&q_out, &[(k(1, 0), 1), (k(1, 1), 1)]).unwrap();
            assert_eq!(sel.key, k(2, 0));
        }
        // Exclusion narrows the other filters too.
        let pinned = RouteQuery {
            filters: FilterView {
                pinned: Some(k(1, 1)),
                ..q_out.filters
            },
            ..q_out
        };
        assert_eq!(s.select(&pinned, &[]), Err(ScheduleError::NoAllowedWorkers));
        let all = [1u64, 2, 3];
        let q_all = RouteQuery {
            filters: FilterView {
                excluded_workers: &all,
                ..q.filters
            },
            ..q
        };
        assert_eq!(s.select(&q_all, &[]), Err(ScheduleError::NoAllowedWorkers));
    }

    #[test]
    fn overrides_replace_the_cost_settings_for_one_request() {
        let mut s = sched(|_| {});
        let now = Instant::now();
        s.add_worker_key(k(1, 0), 100);
        s.add_worker_key(k(2, 0), 100);
        // Key 1 decodes 3 blocks; key 2 caches the whole prompt but decodes 4. Credit 1: key 2
        // costs 0 + 7, key 1 3 + 6; credit 0: key 2 costs 3 + 7.
        let busy = hs(&[10, 11, 12, 13]);
        s.add_request("load2".into(), k(2, 0), &busy, 0, now)
            .unwrap();
        let light = hs(&[20, 21, 22]);
        s.add_request("load1".into(), k(1, 0), &light, 0, now)
            .unwrap();
        let h = hs(&[1, 2, 3]);
        let q = RouteQuery::new(12, &h);
        let overlaps = [(k(2, 0), 3)];
        // With the default credit the cached key wins...
        assert_eq!(s.select(&q, &overlaps).unwrap().key, k(2, 0));
        // ...with no credit for cached blocks it does not.
        let no_credit = RouteQuery {
            overrides: RouteOverrides {
                disk_cache_hit_weight: None,
                host_cache_hit_weight: None,
                shared_cache_hit_weight: None,
                overlap_credit: Some(0.0),
                temperature: None,
            },
            ..q
        };
        let sel = s.select(&no_credit, &overlaps).unwrap();
        assert_eq!(sel.key, k(1, 0), "{sel:?}");
        // A high temperature samples both keys where temperature 0 never would.
        let hot = RouteQuery {
            overrides: RouteOverrides {
                disk_cache_hit_weight: None,
                host_cache_hit_weight: None,
                shared_cache_hit_weight: None,
                overlap_credit: None,
                temperature: Some(100.0),
            },
            ..q
        };
        let mut seen = [false; 2];
        for _ in 0..200 {
            let key = s.select(&hot, &overlaps).unwrap().key;
            seen[key.worker_id as usize - 1] = true;
        }
        assert_eq!(seen, [true, true]);
    }

    #[test]
    fn lower_tiers_earn_their_weights() {
        let mut s = sched(|_| {});
        for w in 1..=3 {
            s.add_worker_key(k(w, 0), 100);
        }
        let h = hs(&[1, 2, 3, 4, 5, 6, 7, 8]);
        let q = RouteQuery::new(32, &h); // 8 blocks
                                         // Key 1 holds 4 on the device; key 2 holds 8 in host memory (credit 6); key 3 none.
        let host_8 = TierBlocks {
            host: 8,
            ..TierBlocks::default()
        };
        let lower = [(k(2, 0), host_8)];
        let with_host = RouteQuery {
            lower_tiers: &lower,
            ..q
        };
        let sel = s.select(&with_host, &[(k(1, 0), 4)]).unwrap();
        assert_eq!((sel.key, sel.tier_overlap_blocks), (k(2, 0), host_8));
        assert_eq!(sel.overlap_blocks, 0);
        assert_eq!(sel.prefill_blocks, 2.0);
        // At weight 0.25 the host copy (credit 2) loses to the device prefix (credit 4).
        let cheap_host = RouteQuery {
            overrides: RouteOverrides {
                host_cache_hit_weight: Some(0.25),
                ..RouteOverrides::default()
            },
            ..with_host
        };
        let sel = s.select(&cheap_host, &[(k(1, 0), 4)]).unwrap();
        assert_eq!(
            (sel.key, sel.tier_overlap_blocks),
            (k(1, 0), TierBlocks::on_device(4))
        );
        // Shared storage reaches every key that holds nothing of its own: 8 shared blocks
        // (credit 2) on the idle keys tie, and beat nothing; key 1's device prefix (4) wins.
        let shared = RouteQuery {
            shared_blocks: 8,
            ..q
        };
        let loads = s.potential_loads(&shared, &[(k(1, 0), 4)]);
        let prefill: Vec<f64> = loads.iter().map(|l| l.potential_prefill_blocks).collect();
        assert_eq!(prefill, vec![4.0, 6.0, 6.0]);
        assert_eq!(s.select(&shared, &[(k(1, 0), 4)]).unwrap().key, k(1, 0));
        // The scratch is clean afterwards: the same query without tiers scores as before.
        let loads = s.potential_loads(&q, &[]);
        assert!(loads.iter().all(|l| l.potential_prefill_blocks == 8.0));
    }

    #[test]
    fn predicted_blocks_pull_a_request_to_where_its_prefix_is_active() {
        // A request of 8 full blocks went to key 2 a moment ago: nothing is indexed yet.
        // A second one sharing its first 6 blocks arrives.
        let first = hs(&[1, 2, 3, 4, 5, 6, 7, 8]);
        let second = hs(&[1, 2, 3, 4, 5, 6, 90, 91]);
        let now = Instant::now();
        let route_both = |credit: f64| {
            let mut s = sched(|c| c.active_prefix_credit = credit);
            s.add_worker_key(k(1, 0), 1000);
            s.add_worker_key(k(2, 0), 1000);
            let q = RouteQuery::new(32, &first);
            let a = s.route(&q, &[], "a".into(), true, now).unwrap();
            assert!(s.mark_prefill("a"));
            let q = RouteQuery::new(32, &second);
            let b = s.route(&q, &[], "b".into(), true, now).unwrap();
            (a, b)
        };
        // Without the credit: key 2 holds 8 active blocks (6 shared), key 1 none: 8 + 2
        // against 8 + 8; key 1 wins on load.
        let (a, b) = route_both(0.0);
        assert_ne!(a.key, b.key);
        assert_eq!(b.prefill_blocks, 8.0);
        // With it, the 6 leading blocks active on key 2 count as cached: 2 + 10 against
        // 8 + 8.
        let (a, b) = route_both(1.0);
        assert_eq!(a.key, b.key);
        assert_eq!(b.prefill_blocks, 2.0);
        // The index's word is not changed: the overlap reported is the indexed one.
        assert_eq!(b.overlap_blocks, 0);
        // A run broken at its first block predicts nothing.
        let mut s = sched(|c| c.active_prefix_credit = 1.0);
        s.add_worker_key(k(1, 0), 1000);
        s.route(&RouteQuery::new(32, &first), &[], "a".into(), true, now)
            .unwrap();
        let third = hs(&[99, 2, 3, 4, 5, 6, 7, 8]);
        let c = s.select(&RouteQuery::new(32, &third), &[]).unwrap();
        assert_eq!(c.prefill_blocks, 8.0 + 8.0);
    }

    #[test]
    fn overlap_and_load_drive_the_choice() {
        // The formula's plain weights: prefill and decode blocks alike, no predicted blocks.
        let mut s = sched(|c| {
            c.prefill_load_scale = 1.0;
            c.active_prefix_credit = 0.0;
        });
        let now = Instant::now();
        s.add_worker_key(k(1, 0), 100);
        s.add_worker_key(k(2, 0), 100);
        let h = hs(&[1, 2, 3]);
        let q = RouteQuery::new(14, &h); // 4 request blocks (3 full)
                                         // Key 2 caches 2 blocks.
        let sel = s.route(&q, &[(k(2, 0), 2)], "a".into(), true, now).unwrap();
        assert_eq!(sel.key, k(2, 0));
        assert_eq!(sel.overlap_blocks, 2);
        assert_eq!(sel.prefill_blocks, 2.0);
        assert_eq!(sel.decode_blocks, 3);
        assert_eq!(sel.cost, 5.0);
        let load = s.load(k(2, 0)).unwrap();
        assert_eq!(load.prefill_tokens, 14 - 8);
        assert_eq!(load.active_blocks, 3);
        assert_eq!(load.active_requests, 1);

        // Same prompt, no overlap info: key 2 has the blocks active (no new decode
        // blocks) but 6 prefill tokens in flight (1.5 blocks): 4 + 1.5 + 3 = 8.5 vs
        // key 1: 4 + 3 = 7.
        let p = s.potential_loads(&q, &[]);
        assert_eq!(p.len(), 2);
        assert_eq!(p[0].key, k(1, 0));
        assert_eq!(
            (p[0].potential_prefill_blocks, p[0].potential_decode_blocks),
            (4.0, 3)
        );
        assert_eq!(
            (p[1].potential_prefill_blocks, p[1].potential_decode_blocks),
            (5.5, 3)
        );
        assert_eq!(s.select(&q, &[]).unwrap().key, k(1, 0));

        assert!(s.mark_prefill("a"));
        // Now key 2: 4 + 3 = 7 ties with key 1; both get chosen.
        let mut seen = [false; 2];
        for _ in 0..50 {
            let sel = s.select(&q, &[]).unwrap();
            assert_eq!(sel.cost, 7.0);
            seen[(sel.key.worker_id - 1) as usize] = true;
        }
        assert_eq!(seen, [true, true]);

        assert_eq!(
            s.route(&q, &[], "a".into(), true, now),
            Err(ScheduleError::DuplicateRequest("a".into()))
        );
        // update_states = false records nothing (and allows any id).
        s.route(&q, &[], "a".into(), false, now).unwrap();
        assert_eq!(s.active_requests(), 1);
        assert!(s.free("a"));
        assert!(!s.free("a"));
        assert!(!s.mark_prefill("a"));
        assert!(s
            .loads()
            .all(|(_, l)| l.active_blocks == 0 && l.prefill_tokens == 0));
    }

    #[test]
    fn peer_echo_counts_our_decisions_once_per_peer_for_the_window() {
        let mut s = sched(|_| {});
        let t0 = Instant::now();
        s.add_worker_key(k(1, 0), 100);
        s.add_worker_key(k(2, 0), 100);
        s.set_peer_echo(2, 0, Duration::from_millis(10));
        let (ha, hb) = (hs(&[1, 2, 3]), hs(&[7, 8, 9]));
        let (qa, qb) = (RouteQuery::new(12, &ha), RouteQuery::new(12, &hb));
        // "a" goes to key 2 (2 blocks cached there): 1 prefill block and 3 decode blocks,
        // plus 4 prefill tokens in flight.
        let a = s.route(&qa, &[(k(2, 0), 2)], "a".into(), true, t0).unwrap();
        assert_eq!(a.key, k(2, 0));
        // "b" pinned to key 2: 3 uncached blocks, plus the in-flight prefill (1 block) and
        // decode blocks (3) of "a" counted three times (ours and two peers' echoes).
        let pinned = RouteQuery {
            filters: FilterView {
                pinned: Some(k(2, 0)),
                ..qb.filters
            },
            ..qb
        };
        let b = s.select(&pinned, &[]).unwrap();
        assert_eq!((b.prefill_blocks, b.decode_blocks), (3.0 + 3.0, 9 + 3));
        // Unpinned, "b" avoids key 2 for the window...
        assert_eq!(s.select(&qb, &[]).unwrap().key, k(1, 0));
        // ...potential loads show tracked load only...
        let p = s.potential_loads(&qb, &[]);
        assert_eq!(
            (p[1].potential_prefill_blocks, p[1].potential_decode_blocks),
            (3.0 + 1.0, 3 + 3)
        );
        // ...and once the window is over, only "a" itself counts.
        let b = s
            .route(
                &pinned,
                &[],
                "b".into(),
                true,
                t0 + Duration::from_millis(10),
            )
            .unwrap();
        assert_eq!((b.prefill_blocks, b.decode_blocks), (3.0 + 1.0, 3 + 3));
        // Peers' decisions (add_request) are not echoed; a removed key drops its echo.
        s.set_peer_echo(0, 0, Duration::from_millis(10));
        s.add_request("p".into(), k(1, 0), &hs(&[5]), 4, t0)
            .unwrap();
        assert_eq!(s.echo.load(0), Default::default());
        s.set_peer_echo(2, 0, Duration::from_millis(10));
        s.route(
            &qa,
            &[(k(2, 0), 3)],
            "c".into(),
            true,
            t0 + Duration::from_millis(11),
        )
        .unwrap();
        assert_ne!(s.echo.load(1), Default::default());
        s.remove_worker(2);
        assert_eq!(s.echo.load(1), Default::default());
    }

    #[test]
    fn during_a_burst_peers_ahead_pick_first() {
        let mut s = sched(|_| {});
        let t0 = Instant::now();
        for w in 1..=3 {
            s.add_worker_key(k(w, 0), 1000);
        }
        // Key 1 idle, key 2 lightly loaded, key 3 heavily.
        s.add_request("p2".into(), k(2, 0), &hs(&[100]), 4, t0)
            .unwrap();
        s.add_request("p3".into(), k(3, 0), &hs(&[200, 201, 202]), 40, t0)
            .unwrap();
        // One peer ahead of us.
        s.set_peer_echo(2, 1, Duration::from_millis(10));
        let (hy, hz) = (hs(&[1, 2, 3]), hs(&(10..20).collect::<Vec<_>>()));
        let (y, z) = (RouteQuery::new(12, &hy), RouteQuery::new(40, &hz));
        // An isolated request takes the idle key.
        assert_eq!(s.select(&y, &[]).unwrap().key, k(1, 0));
        // Once we route in a burst, the peer ahead is assumed to take the idle key for a
        // request like ours...
        let pin3 = RouteQuery::new(4, &[]).with_filters(FilterView {
            pinned: Some(k(3, 0)),
            ..FilterView::default()
        });
        s.route(&pin3, &[], "h".into(), true, t0).unwrap();
        let sel = s.select(&y, &[]).unwrap();
        assert_eq!(sel.key, k(2, 0));
        // ...which is not tracked load, nor left behind for the next decision...
        assert_eq!(s.load(k(1, 0)).unwrap().active_blocks, 0);
        assert!(s.peer_picks.iter().all(|p| *p == EchoLoad::default()));
        // ...and a request cached elsewhere still goes where it is cached.
        assert_eq!(s.select(&z, &[(k(2, 0), 10)]).unwrap().key, k(2, 0));
        // When the burst is over, the view alone counts again.
        s.route(
            &pin3,
            &[],
            "h2".into(),
            true,
            t0 + Duration::from_millis(10),
        )
        .unwrap();
        s.free("h2");
        s.route(&y, &[], "y".into(), true, t0 + Duration::from_millis(20))
            .unwrap();
        assert_eq!(s.load(k(1, 0)).unwrap().active_requests, 1);
    }

    #[test]
    fn engine_waiting_requests_make_a_key_busy() {
        let mut s = sched(|c| c.busy_waiting_requests = Some(3));
        s.add_worker_key(k(1, 0), 8);
        let waiting = |n| ReportedLoad {
            active_blocks: 0,
            waiting_requests: n,
        };
        assert_eq!(s.is_busy(k(1, 0)), Some(false));
        s.set_reported_load(k(1, 0), waiting(2));
        assert_eq!(s.is_busy(k(1, 0)), Some(false));
        s.set_reported_load(k(1, 0), waiting(3));
        assert_eq!(s.is_busy(k(1, 0)), Some(true));
    }

    #[test]
    fn busy_thresholds() {
        let mut s = sched(|c| {
            c.busy_active_blocks_frac = Some(0.5);
            c.busy_prefill_tokens = Some(10);
        });
        let now = Instant::now();
        s.add_worker_key(k(1, 0), 8);
        s.add_worker_key(k(2, 0), 8);
        s.add_worker_key(k(3, 0), 0); // unknown capacity: blocks threshold off
        let h = hs(&[1, 2, 3, 4]);
        let q = RouteQuery::new(16, &h);
        s.add_request("a".into(), k(1, 0), &h, 0, now).unwrap();
        assert_eq!(s.is_busy(k(1, 0)), Some(true));
        assert!(s.set_reported_load(
            k(2, 0),
            ReportedLoad {
                active_blocks: 4,
                waiting_requests: 0
            }
        ));
        assert!(!s.set_reported_load(k(9, 0), ReportedLoad::default()));
        assert_eq!(s.is_busy(k(2, 0)), Some(true));
        s.add_request("b".into(), k(3, 0), &hs(&[9; 0]), 10, now)
            .unwrap();
        assert_eq!(s.is_busy(k(3, 0)), Some(true));
        assert_eq!(s.select(&q, &[]), Err(ScheduleError::AllBusy));

        s.set_reported_load(k(2, 0), ReportedLoad::default());
        for _ in 0..20 {
            assert_eq!(s.select(&q, &[(k(1, 0), 4)]).unwrap().key, k(2, 0));
        }
        // A busy pinned key is AllBusy, not rerouted.
        let pinned = RouteQuery {
            filters: FilterView {
                pinned: Some(k(1, 0)),
                ..q.filters
            },
            ..q
        };
        assert_eq!(s.select(&pinned, &[]), Err(ScheduleError::AllBusy));
        assert!(s.mark_prefill("b"));
        assert_eq!(s.is_busy(k(3, 0)), Some(false));
    }

    #[test]
    fn queue_drains_in_order_after_state_changes() {
        let mut s = sched(|c| {
            c.busy_prefill_tokens = Some(4);
            c.max_queued_requests = 3;
            c.queue_timeout = Duration::from_secs(10);
        });
        let t0 = Instant::now();
        let t = |secs| t0 + Duration::from_secs(secs);
        s.add_worker_key(k(1, 0), 100);
        s.add_worker_key(k(2, 0), 100);
        let h = hs(&[1]);
        let q = RouteQuery::new(4, &h);
        let first = s.route(&q, &[], "r1".into(), true, t(0)).unwrap();
        let second = s.route(&q, &[], "r2".into(), true, t(0)).unwrap();
        assert_ne!(first.key, second.key);
        let on_key1 = if first.key == k(1, 0) { "r1" } else { "r2" };
        assert_eq!(s.select(&q, &[]), Err(ScheduleError::AllBusy));
        assert!(s.drain_ready(t(0)).is_empty());

        let pinned_q = RouteQuery {
            filters: FilterView {
                pinned: Some(k(2, 0)),
                ..q.filters
            },
            ..q
        };
        s.enqueue(Queued::new(&q, &[], "q1".into(), true, t(1), 1))
            .unwrap();
        s.enqueue(Queued::new(&pinned_q, &[], "q2".into(), true, t(1), 2))
            .unwrap();
        s.enqueue(Queued::new(&q, &[], "q3".into(), true, t(2), 3))
            .unwrap();
        let over = s
            .enqueue(Queued::new(&q, &[], "q4".into(), true, t(2), 4))
            .unwrap_err();
        assert_eq!(
            over.error(),
            ScheduleError::Overloaded { queued: 3, max: 3 }
        );
        assert_eq!(s.queue_len(), 3);
        assert!(s.drain_ready(t(3)).is_empty());
        assert_eq!(s.queue_len(), 3);

        // Key 1 frees up: q1 goes there (and makes it busy again); q2 is pinned to busy
        // key 2, q3 stays.
        assert!(s.mark_prefill(on_key1));
        let out = s.drain_ready(t(4));
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].0, 1);
        let placed = out[0].1.as_ref().unwrap();
        assert_eq!(
            placed.queued,
            Duration::from_secs(3),
            "queued at 1, placed at 4"
        );
        assert_eq!(first.queued, Duration::ZERO, "placed on arrival");
        assert!(s.contains_request("q1"));
        assert_eq!(s.queue_len(), 2);

        // The pinned worker leaves: q2 fails for a non-busy reason, q3 keeps waiting.
        let dropped = s.remove_worker(2);
        assert!(!dropped.is_empty());
        let out = s.drain_ready(t(5));
        assert_eq!(out.len(), 1);
        assert_eq!(out[0], (2, Err(ScheduleError::UnknownWorker(2))));
        assert_eq!(s.queue_len(), 1);

        // q3 times out.
        let out = s.drain_ready(t(12));
        assert_eq!(out, vec![(3, Err(ScheduleError::QueueTimeout))]);
        assert_eq!(s.queue_len(), 0);
    }

    #[test]
    fn wspt_retries_the_shortest_uncached_prompt_first() {
        assert_eq!(
            order_placed(QueuePolicy::Fcfs, [0.0; 4]),
            ["long", "short", "half-cached", "short-2"]
        );
        assert_eq!(
            order_placed(QueuePolicy::Wspt, [0.0; 4]),
            ["short", "short-2", "half-cached", "long"]
        );
    }

    #[test]
    fn a_priority_jump_moves_a_request_up_the_queue() {
        // Arrivals 1 s apart: a 2.5 s jump passes two earlier requests, not three.
        assert_eq!(
            order_placed(QueuePolicy::Fcfs, [0.0, 0.0, 0.0, 2.5]),
            ["long", "short-2", "short", "half-cached"]
        );
        assert_eq!(
            order_placed(QueuePolicy::Fcfs, [0.0, 0.0, 0.5, 0.0]),
            ["long", "short", "half-cached", "short-2"]
        );
        assert_eq!(
            order_placed(QueuePolicy::Fcfs, [0.0, 0.0, 1.5, 0.0]),
            ["long", "half-cached", "short", "short-2"]
        );
        // Under wspt a jump of j divides the uncached tokens by 1 + j: the long prompt (16)
        // with a 3 s jump weighs 4, level with the short ones and, first to arrive, first.
        assert_eq!(
            order_placed(QueuePolicy::Wspt, [3.0, 0.0, 0.0, 0.0]),
            ["long", "short", "short-2", "half-cached"]
        );
        assert_eq!(
            order_placed(QueuePolicy::Wspt, [0.0, 0.0, 0.0, 1.0]),
            ["short-2", "short", "half-cached", "long"]
        );
    }

    /// The order four queued requests are placed in, one per freed prefill: uncached tokens
    /// 16 ("long"), 4 ("short"), 8 (a 16-token prompt with 2 of its 4 blocks cached) and 4
    /// ("short-2"), arriving 1 s apart with these priority jumps.
    fn order_placed(policy: QueuePolicy, jumps: [f64; 4]) -> Vec<&'static str> {
        let mut s = sched(|c| {
            c.block_size = 4;
            c.busy_prefill_tokens = Some(1);
            c.max_queued_requests = 8;
            c.queue_timeout = Duration::from_secs(10);
            c.queue_policy = policy;
        });
        let t0 = Instant::now();
        s.add_worker_key(k(1, 0), 100);
        let h = hs(&[1, 2, 3, 4]);
        let busy = s.route(&RouteQuery::new(4, &h), &[], "busy".into(), true, t0);
        let on = busy.unwrap().key;
        let cached = [(on, 2)];
        let names = ["long", "short", "half-cached", "short-2"];
        let arrivals = [(16, &[][..]), (4, &[][..]), (16, &cached[..]), (4, &[][..])];
        for (i, (tokens, overlaps)) in arrivals.into_iter().enumerate() {
            let mut q = RouteQuery::new(tokens, &h);
            q.priority_jump = jumps[i];
            let at = t0 + Duration::from_secs(i as u64);
            s.enqueue(Queued::new(
                &q,
                overlaps,
                names[i].into(),
                true,
                at,
                i as u32,
            ))
            .unwrap();
        }
        // Each freed prefill lets exactly one queued request in (and makes the key busy).
        let mut placed = Vec::new();
        let mut prev = "busy";
        while s.queue_len() > 0 {
            assert!(s.mark_prefill(prev));
            let out = s.drain_ready(t0 + Duration::from_secs(5));
            assert_eq!(out.len(), 1, "{out:?}");
            prev = names[out[0].0 as usize];
            placed.push(prev);
        }
        placed
    }

    #[test]
    fn priority_jumps_are_clamped_to_the_configured_maximum() {
        assert_eq!(clamp_priority_jump(1e308, 60.0), 60.0);
        assert_eq!(clamp_priority_jump(2.5, 60.0), 2.5);
        for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, -1.0] {
            assert_eq!(clamp_priority_jump(bad, 60.0), 0.0, "{bad}");
        }
        // A 1e308 jump passes no more than a 1.5 s one when the maximum is 1.5 s.
        let mut s = sched(|c| {
            c.block_size = 4;
            c.busy_prefill_tokens = Some(1);
            c.max_queued_requests = 8;
            c.queue_timeout = Duration::from_secs(10);
            c.max_priority_jump = 1.5;
        });
        let t0 = Instant::now();
        s.add_worker_key(k(1, 0), 100);
        let h = hs(&[1]);
        s.route(&RouteQuery::new(4, &h), &[], "busy".into(), true, t0)
            .unwrap();
        for (i, (name, jump)) in [("first", 0.0), ("second", 0.0), ("huge", 1e308)]
            .into_iter()
            .enumerate()
        {
            let mut q = RouteQuery::new(4, &h);
            q.priority_jump = jump;
            let at = t0 + Duration::from_secs(i as u64);
            s.enqueue(Queued::new(&q, &[], name.into(), true, at, i as u32))
                .unwrap();
        }
        assert!(s.mark_prefill("busy"));
        let out = s.drain_ready(t0 + Duration::from_secs(5));
        // "huge" arrived 2 s after "first": 1.5 s of jump passes "second" only.
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].0, 0, "the first arrival is still first: {out:?}");
        assert!(s.mark_prefill("first"));
        let out = s.drain_ready(t0 + Duration::from_secs(5));
        assert_eq!(out[0].0, 2, "the clamped jump passes the second arrival");
    }

    #[test]
    fn expected_output_is_clamped_to_the_cap_and_the_rank_capacity() {
        let mut s = sched(|c| c.block_size = 4);
        let t0 = Instant::now();
        s.add_worker_key(k(1, 0), 100);
        s.add_worker_key(k(2, 0), 0); // unknown capacity: only the constant cap applies
        let h = hs(&[1]);
        let mut q = RouteQuery::new(4, &h);
        q.expected_output_tokens = Some(u32::MAX);
        q.filters = FilterView {
            pinned: Some(k(1, 0)),
            ..FilterView::default()
        };
        s.route(&q, &[], "a".into(), true, t0).unwrap();
        assert_eq!(s.output_blocks("a"), Some(100), "the rank's capacity");
        q.filters.pinned = Some(k(2, 0));
        s.route(&q, &[], "b".into(), true, t0).unwrap();
        assert_eq!(
            s.output_blocks("b"),
            Some(MAX_EXPECTED_OUTPUT_TOKENS / 4),
            "the constant cap"
        );
    }

    #[test]
    fn expected_and_generated_output_count_in_the_decode_load() {
        let mut s = sched(|c| c.block_size = 4);
        let t0 = Instant::now();
        s.add_worker_key(k(1, 0), 100);
        let h = hs(&[1, 2]);
        let mut q = RouteQuery::new(8, &h);
        q.expected_output_tokens = Some(10); // 3 blocks
        s.route(&q, &[], "a".into(), true, t0).unwrap();
        let blocks = |s: &Scheduler<u32>| s.load(k(1, 0)).unwrap().active_blocks;
        assert_eq!(blocks(&s), 2 + 3);
        // Generating within the expectation changes nothing, past it grows the load.
        for _ in 0..3 {
            assert_eq!(s.add_output_block("a", None), Some(3));
        }
        assert_eq!(s.add_output_block("a", None), Some(4));
        assert_eq!(blocks(&s), 2 + 4);
        // Half of it still ahead: half of it counts (rounded up).
        assert_eq!(s.add_output_block("a", Some(0.5)), Some(3));
        assert_eq!(blocks(&s), 2 + 3);
        assert_eq!(s.add_output_block("unknown", None), None);
        // A peer's word sets it; freeing takes it all away.
        assert!(s.set_output_blocks("a", 7));
        assert_eq!(blocks(&s), 2 + 7);
        assert!(s.free("a"));
        assert_eq!(blocks(&s), 0);
    }

    #[test]
    fn sweep_and_remove_return_request_ids() {
        let mut s = sched(|c| c.request_timeout = Duration::from_secs(5));
        let t0 = Instant::now();
        s.add_worker_key(k(1, 0), 10);
        s.add_worker_key(k(1, 1), 10);
        let h = hs(&[1, 2]);
        s.add_request("a".into(), k(1, 0), &h, 3, t0).unwrap();
        s.add_request("b".into(), k(1, 1), &h, 3, t0 + Duration::from_secs(3))
            .unwrap();
        assert_eq!(
            s.add_request("c".into(), k(1, 7), &h, 3, t0),
            Err(ScheduleError::InvalidRank {
                worker_id: 1,
                dp_rank: 7
            })
        );
        assert_eq!(s.sweep(t0 + Duration::from_secs(5)), vec!["a"]);
        assert_eq!(s.load(k(1, 0)).unwrap().active_blocks, 0);
        assert_eq!(s.remove_worker_key(k(1, 1)), vec!["b"]);
        assert!(!s.has_key(k(1, 1)));
        assert_eq!(s.worker_keys().collect::<Vec<_>>(), vec![k(1, 0)]);
        assert_eq!(s.active_requests(), 0);
    }
}

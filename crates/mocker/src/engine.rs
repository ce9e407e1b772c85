//! [`RankEngine`]: one simulated data-parallel rank, scheduled step by step.
//!
//! Each [`RankEngine::step`] is one forward pass, scheduled like vLLM v1:
//! 1. every running request that is decoding gets one token (1 token of the budget each);
//! 2. running requests part-way through a chunked prefill get their next chunk;
//! 3. waiting requests are admitted first come, first served, while the token budget
//!    (`max_num_batched_tokens`), `max_num_seqs` and the KV cache allow. The prefix cache
//!    lookup happens here, when a request is first scheduled: its cached leading blocks are
//!    reused and counted (`cached_blocks` in [`OutputKind::PrefillDone`]). As in vLLM, the
//!    last prompt token is always computed, so a fully cached prompt whose length is a
//!    multiple of the block size reuses all its full blocks but the last.
//!
//! With chunked prefill on, a prompt longer than the remaining budget is split across steps;
//! with it off, a prompt is prefilled whole in one step or waits.
//!
//! **Transferred KV** ([`RankEngine::submit_transferred`], what a decode worker of a
//! disaggregated deployment does). The prompt's KV was computed elsewhere and arrives with
//! the request. At admission its cached leading blocks are reused as usual and the rest of
//! the prompt's blocks are allocated and filled at once: they are registered in the prefix
//! cache (`Stored` events for the newly filled full blocks, as vLLM decode workers cache
//! transferred blocks) but cost no prefill compute. The request is admitted like any other
//! (same capacity reservation, 1 token of the step budget) and its first output token comes
//! from that one step, costed as one decode over the prompt's context. The transfer itself
//! is not simulated here: the worker submits the request once every tp rank received its KV
//! (see `disagg`), with an arrival time that counts the transfer.
//!
//! **Admission control.** A request is admitted only if the KV cache can hold everything it
//! will ever need (`ceil((prompt + max_tokens - 1) / block_size)` blocks, minus reused ones)
//! on top of what already running requests may still need. Running requests therefore never
//! run out of blocks and there is no preemption. vLLM instead admits on the prompt alone and
//! preempts (recomputes) when decode runs out of blocks; the reservation here is more
//! conservative under long `max_tokens` but keeps the simulation simple and its events exact.
//!
//! **Lower tiers** (`host_capacity_blocks`, `disk_capacity_blocks`). Where a request's
//! device prefix ends, host and disk may continue it: those blocks are loaded at admission
//! instead of computed (the step pays their transfer, see [`crate::config`]), counted in
//! `cached_blocks` and by tier in [`OutputKind::PrefillDone`], and registered on the device
//! again with the step's prefill.
//!
//! Simulated time: `step(now)` starts a step at `now` and returns its duration; outputs are
//! stamped at the end of the step (`now + duration`). Nothing here reads a clock.

use crate::config::{BatchShape, ConfigError, EngineConfig};
use crate::kv_cache::{BlockTable, KvCache, PromptBlocks};
use kvrouter_protocol::{EventId, KvEvent, Tier, WorkerKey};
use rustc_hash::FxHashSet;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::time::Duration;
use thiserror::Error;

/// Simulated time: the time since the engine started.
pub type SimTime = Duration;

/// A generation request as a rank receives it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    pub request_id: String,
    pub tokens: Vec<u32>,
    /// Tokens to generate; 0 finishes right after prefill.
    pub max_tokens: u32,
}

/// Why a request was refused. Requests come from the network: nothing here panics.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum SubmitError {
    #[error("empty prompt")]
    EmptyPrompt,
    #[error(
        "request needs {needed_blocks} KV blocks (prompt {prompt_tokens} + max_tokens \
         {max_tokens} tokens) but the rank holds only {capacity_blocks}"
    )]
    TooLong {
        prompt_tokens: usize,
        max_tokens: u32,
        needed_blocks: usize,
        capacity_blocks: usize,
    },
    #[error(
        "prompt of {prompt_tokens} tokens exceeds max_num_batched_tokens \
         {max_num_batched_tokens} and chunked prefill is off"
    )]
    PromptExceedsBatch {
        prompt_tokens: usize,
        max_num_batched_tokens: usize,
    },
    #[error("request id {0:?} is already in flight")]
    DuplicateRequestId(String),
}

/// What a step did, in simulated time.
#[derive(Clone, Debug, PartialEq)]
pub struct StepOutcome {
    /// How long the step took.
    pub duration: Duration,
    /// Per-request results, in scheduling order.
    pub outputs: Vec<Output>,
    /// KV events of the step, in order.
    pub events: Vec<KvEvent>,
}

/// One result for one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Output {
    pub request_id: String,
    pub kind: OutputKind,
}

/// What happened to a request in a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OutputKind {
    /// Prefill finished; the first generated token (index 0) comes with it, unless
    /// `max_tokens` is 0.
    PrefillDone {
        /// Leading full prompt blocks found in the prefix cache when first scheduled, in
        /// any tier (none of them computed).
        cached_blocks: usize,
        /// Of those, the blocks loaded from host memory and from disk.
        host_blocks: usize,
        disk_blocks: usize,
        /// Full prompt blocks (`prompt tokens / block_size`, rounded down).
        prompt_blocks: usize,
        /// From submit to the end of this step.
        ttft: Duration,
    },
    /// A generated token after the first (`index` ≥ 1).
    Token {
        index: u32,
        /// Since the end of the step that produced the previous token.
        itl: Duration,
    },
    /// The request is done (after its last token, in the same step).
    Finished {
        /// Tokens generated (`max_tokens`).
        output_tokens: u32,
        /// From submit to the end of this step.
        latency: Duration,
    },
}

/// A rank's load, as workers report it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadReport {
    /// Blocks referenced by running requests.
    pub active_blocks: usize,
    /// Blocks in the prefix cache (published), referenced or not.
    pub cached_blocks: usize,
    /// The rank's KV capacity in blocks.
    pub capacity_blocks: usize,
    /// Requests submitted but not yet admitted.
    pub waiting_requests: usize,
    /// Requests admitted and not finished.
    pub running_requests: usize,
}

#[derive(Debug)]
struct Sequence {
    id: String,
    prompt_len: usize,
    max_tokens: u32,
    prompt: PromptBlocks,
    arrival: SimTime,
    table: BlockTable,
    /// Blocks the request may hold at most over its life.
    total_blocks: usize,
    /// Leading prompt blocks found cached when first scheduled (any tier).
    cached_blocks: usize,
    /// Of those, loaded from host memory and from disk.
    host_blocks: usize,
    disk_blocks: usize,
    /// Prompt tokens in KV (cached or computed).
    computed: usize,
    /// Tokens generated so far.
    generated: u32,
    last_token_at: SimTime,
    /// The prompt's KV arrives with the request (see the module docs): no prefill compute.
    kv_transferred: bool,
}

impl Sequence {
    fn prefilling(&self) -> bool {
        self.computed < self.prompt_len
    }

    /// Blocks this request may still allocate.
    fn future_blocks(&self) -> usize {
        self.total_blocks.saturating_sub(self.table.len())
    }
}

#[derive(Clone, Copy, Debug)]
enum Work {
    Decode,
    Prefill { chunk: usize },
}

/// One simulated data-parallel rank: a paged KV cache with prefix reuse, continuous batching
/// and a timing model. Synchronous and clock-free; see the module docs.
#[derive(Debug)]
pub struct RankEngine {
    key: WorkerKey,
    config: EngineConfig,
    cache: KvCache,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    live_ids: FxHashSet<String>,
}

impl RankEngine {
    /// A rank with an empty cache. Fails on a configuration that cannot run.
    pub fn new(key: WorkerKey, config: EngineConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(Self {
            key,
            cache: KvCache::with_tiers(
                key,
                config.capacity_blocks,
                config.host_capacity_blocks,
                config.disk_capacity_blocks,
            ),
            config,
            waiting: VecDeque::new(),
            running: Vec::new(),
            live_ids: FxHashSet::default(),
        })
    }

    /// The rank this engine simulates.
    pub fn key(&self) -> WorkerKey {
        self.key
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The KV cache (read-only, for inspection and tests).
    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    /// Nothing waiting or running: [`step`](Self::step) would return `None`.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// Queues a request that arrived at `now`. Refuses an empty prompt, a request that could
    /// never fit the rank's KV cache, a prompt that cannot be prefilled in one step when
    /// chunked prefill is off, and an id already in flight.
    pub fn submit(&mut self, request: Request, now: SimTime) -> Result<(), SubmitError> {
        self.submit_inner(request, now, false)
    }

    /// Like [`submit`](Self::submit), for a request whose prompt KV was computed elsewhere
    /// and arrives with it (a decode worker's request): when admitted, its prompt's blocks
    /// are allocated and cached without prefill compute, and its first token comes after one
    /// decode-sized step. Same refusals as `submit`.
    pub fn submit_transferred(
        &mut self,
        request: Request,
        now: SimTime,
    ) -> Result<(), SubmitError> {
        self.submit_inner(request, now, true)
    }

    fn submit_inner(
        &mut self,
        request: Request,
        now: SimTime,
        kv_transferred: bool,
    ) -> Result<(), SubmitError> {
        let Request {
            request_id,
            tokens,
            max_tokens,
        } = request;
        if tokens.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        let bs = self.config.block_size;
        let prompt_len = tokens.len();
        let kv_tokens = prompt_len.saturating_add((max_tokens as usize).saturating_sub(1));
        let total_blocks = kv_tokens.div_ceil(bs);
        if total_blocks > self.config.capacity_blocks {
            return Err(SubmitError::TooLong {
                prompt_tokens: prompt_len,
                max_tokens,
                needed_blocks: total_blocks,
                capacity_blocks: self.config.capacity_blocks,
            });
        }
        if !self.config.enable_chunked_prefill && prompt_len > self.config.max_num_batched_tokens {
            return Err(SubmitError::PromptExceedsBatch {
                prompt_tokens: prompt_len,
                max_num_batched_tokens: self.config.max_num_batched_tokens,
            });
        }
        if self.live_ids.contains(&request_id) {
            return Err(SubmitError::DuplicateRequestId(request_id));
        }
        let prompt = PromptBlocks::new(&tokens, bs, self.config.engine_hash_seed);
        self.live_ids.insert(request_id.clone());
        self.waiting.push_back(Sequence {
            id: request_id,
            prompt_len,
            max_tokens,
            prompt,
            arrival: now,
            table: BlockTable::default(),
            total_blocks,
            cached_blocks: 0,
            host_blocks: 0,
            disk_blocks: 0,
            computed: 0,
            generated: 0,
            last_token_at: now,
            kv_transferred,
        });
        Ok(())
    }

    /// Runs one step starting at `now`; `None` when there is nothing to do.
    pub fn step(&mut self, now: SimTime) -> Option<StepOutcome> {
        if self.is_idle() {
            return None;
        }
        let bs = self.config.block_size;
        let mut budget = self.config.max_num_batched_tokens;
        let mut shape = BatchShape::default();
        let mut work: Vec<(usize, Work)> = Vec::new();

        // 1. Decodes: one token each, for the token being fed back into KV.
        for (i, s) in self.running.iter_mut().enumerate() {
            if budget == 0 {
                break;
            }
            if s.prefilling() {
                continue;
            }
            let kv = s.prompt_len + s.generated as usize;
            let need = kv.div_ceil(bs).saturating_sub(s.table.len());
            if self.cache.allocate(&mut s.table, need).is_err() {
                debug_assert!(false, "admission reserved the decode blocks");
                continue;
            }
            budget -= 1;
            shape.add_decode(kv);
            work.push((i, Work::Decode));
        }

        // 2. Chunked prefills already under way.
        for (i, s) in self.running.iter_mut().enumerate() {
            if budget == 0 {
                break;
            }
            if !s.prefilling() {
                continue;
            }
            let chunk = (s.prompt_len - s.computed).min(budget);
            let need = (s.computed + chunk)
                .div_ceil(bs)
                .saturating_sub(s.table.len());
            if self.cache.allocate(&mut s.table, need).is_err() {
                debug_assert!(false, "admission reserved the prefill blocks");
                continue;
            }
            budget -= chunk;
            shape.add_prefill_chunk(s.computed, chunk);
            work.push((i, Work::Prefill { chunk }));
        }

        // 3. Admit waiting requests, first come first served.
        let mut reserved: usize = self.running.iter().map(Sequence::future_blocks).sum();
        while let Some(s) = self.waiting.front() {
            if budget == 0 || self.running.len() >= self.config.max_num_seqs {
                break;
            }
            // The last prompt token is always computed (to sample the first output token).
            let max_hit = (s.prompt_len - 1) / bs;
            let hit_seq = &s.prompt.seq[..max_hit.min(s.prompt.len())];
            let m = self.cache.match_prefix(hit_seq);
            // Lower tiers continue the device prefix (a transferred prompt needs no load).
            let (host, disk) = if s.kv_transferred {
                (0, 0)
            } else {
                self.cache.match_lower(&hit_seq[m.blocks..])
            };
            let reused = m.blocks + host + disk;
            let new_blocks = s.total_blocks - m.blocks;
            let available = self.cache.available_blocks() - m.unreferenced;
            if new_blocks + reserved > available {
                break;
            }
            // A transferred prompt only has its last token left to run (as a decode).
            let remaining = if s.kv_transferred {
                1
            } else {
                s.prompt_len - reused * bs
            };
            let chunk = remaining.min(budget);
            if chunk < remaining && !self.config.enable_chunked_prefill {
                break;
            }
            let Some(mut s) = self.waiting.pop_front() else {
                break;
            };
            s.table = self.cache.new_table();
            let hit_len = max_hit.min(s.prompt.len());
            let hit = self
                .cache
                .acquire_prefix(&mut s.table, &s.prompt.seq[..hit_len]);
            debug_assert_eq!(hit, m.blocks);
            s.cached_blocks = reused;
            (s.host_blocks, s.disk_blocks) = (host, disk);
            s.computed = if s.kv_transferred {
                s.prompt_len - 1
            } else {
                reused * bs
            };
            let need = (s.computed + chunk).div_ceil(bs).saturating_sub(hit);
            if self.cache.allocate(&mut s.table, need).is_err() {
                // Unreachable by the check above; put the request back untouched.
                debug_assert!(false, "admission checked availability");
                self.cache.release(std::mem::take(&mut s.table));
                (s.cached_blocks, s.host_blocks, s.disk_blocks) = (0, 0, 0);
                s.computed = 0;
                self.waiting.push_front(s);
                break;
            }
            budget -= chunk;
            if s.kv_transferred {
                // Its KV is in place: the step samples its first token like a decode.
                shape.add_decode(s.prompt_len);
            } else {
                shape.add_loaded(host * bs, disk * bs);
                shape.add_prefill_chunk(s.computed, chunk);
            }
            reserved += s.future_blocks();
            work.push((self.running.len(), Work::Prefill { chunk }));
            self.running.push(s);
        }

        if work.is_empty() {
            debug_assert!(false, "a non-idle rank always makes progress");
            return None;
        }

        let duration = self.config.timing.step_duration(&shape);
        let end = now.saturating_add(duration);
        let mut outputs = Vec::with_capacity(work.len() + 4);
        let mut finished = false;
        for &(i, w) in &work {
            let s = &mut self.running[i];
            match w {
                Work::Decode => {
                    s.generated += 1;
                    outputs.push(Output {
                        request_id: s.id.clone(),
                        kind: OutputKind::Token {
                            index: s.generated - 1,
                            itl: end.saturating_sub(s.last_token_at),
                        },
                    });
                    s.last_token_at = end;
                }
                Work::Prefill { chunk } => {
                    s.computed += chunk;
                    self.cache.commit(&mut s.table, &s.prompt, s.computed / bs);
                    if s.prefilling() {
                        continue;
                    }
                    outputs.push(Output {
                        request_id: s.id.clone(),
                        kind: OutputKind::PrefillDone {
                            cached_blocks: s.cached_blocks,
                            host_blocks: s.host_blocks,
                            disk_blocks: s.disk_blocks,
                            prompt_blocks: s.prompt.len(),
                            ttft: end.saturating_sub(s.arrival),
                        },
                    });
                    s.generated = s.max_tokens.min(1);
                    s.last_token_at = end;
                }
            }
            if s.generated >= s.max_tokens {
                finished = true;
                outputs.push(Output {
                    request_id: s.id.clone(),
                    kind: OutputKind::Finished {
                        output_tokens: s.generated,
                        latency: end.saturating_sub(s.arrival),
                    },
                });
            }
        }
        if finished {
            let mut i = 0;
            while i < self.running.len() {
                let s = &self.running[i];
                if !s.prefilling() && s.generated >= s.max_tokens {
                    let s = self.running.remove(i);
                    self.live_ids.remove(&s.id);
                    self.cache.release(s.table);
                } else {
                    i += 1;
                }
            }
        }
        Some(StepOutcome {
            duration,
            outputs,
            events: self.cache.take_events(),
        })
    }

    /// Drops a waiting or running request and its block references (its cached prompt blocks
    /// stay cached). Returns whether it was in flight. Emits no event.
    pub fn abort(&mut self, request_id: &str) -> bool {
        if !self.live_ids.remove(request_id) {
            return false;
        }
        if let Some(pos) = self.waiting.iter().position(|s| s.id == request_id) {
            self.waiting.remove(pos);
        } else if let Some(pos) = self.running.iter().position(|s| s.id == request_id) {
            let s = self.running.remove(pos);
            self.cache.release(s.table);
        }
        true
    }

    /// Drops the prefix cache (like vLLM's `reset_prefix_cache`) and returns the `Cleared`
    /// event. Running requests keep their blocks and carry on, but publish nothing more.
    pub fn clear(&mut self) -> KvEvent {
        self.cache.clear();
        let mut events = self.cache.take_events();
        debug_assert_eq!(events.len(), 1);
        events.pop().unwrap_or_else(|| KvEvent {
            tier: Tier::Device,
            key: self.key,
            event_id: self.cache.last_event_id().unwrap_or(0),
            data: kvrouter_protocol::KvEventData::Cleared,
        })
    }

    /// The rank's current load.
    pub fn load(&self) -> LoadReport {
        LoadReport {
            active_blocks: self.cache.active_blocks(),
            cached_blocks: self.cache.cached_blocks(),
            capacity_blocks: self.cache.capacity(),
            waiting_requests: self.waiting.len(),
            running_requests: self.running.len(),
        }
    }

    /// The current cache as `Stored` events (parents first, at most `max_blocks_per_event`
    /// blocks each, all carrying the last event id) and the last event id: what a router
    /// fetches to recover this rank's state.
    pub fn state_events(&self, max_blocks_per_event: usize) -> (Vec<KvEvent>, Option<EventId>) {
        self.cache.state_events(max_blocks_per_event)
    }

    /// The last event id this rank emitted, if any.
    pub fn last_event_id(&self) -> Option<EventId> {
        self.cache.last_event_id()
    }

    /// Checks the cache bookkeeping against the running requests' block tables. For tests.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.cache
            .check_invariants(self.running.iter().map(|s| &s.table))?;
        if self.cache.used_blocks() > self.config.capacity_blocks {
            return Err("capacity exceeded".into());
        }
        let reserved: usize = self.running.iter().map(Sequence::future_blocks).sum();
        if reserved > self.cache.available_blocks() {
            return Err(format!(
                "{reserved} blocks reserved, {} available",
                self.cache.available_blocks()
            ));
        }
        if self.live_ids.len() != self.waiting.len() + self.running.len() {
            return Err("live request ids out of sync".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrouter_protocol::KvEventData;

    const KEY: WorkerKey = WorkerKey::new(3, 0);

    fn req(id: &str, tokens: Vec<u32>, max_tokens: u32) -> Request {
        Request {
            request_id: id.into(),
            tokens,
            max_tokens,
        }
    }

    fn engine(config: EngineConfig) -> RankEngine {
        RankEngine::new(KEY, config).unwrap()
    }

    /// Steps until idle; returns every step's outcome and the final time.
    fn drain(e: &mut RankEngine, mut now: SimTime) -> (Vec<StepOutcome>, SimTime) {
        let mut steps = Vec::new();
        while let Some(out) = e.step(now) {
            e.check_invariants().unwrap();
            now += out.duration;
            steps.push(out);
            assert!(steps.len() < 100_000, "runaway");
        }
        (steps, now)
    }

    fn outputs_of<'a>(steps: &'a [StepOutcome], id: &'a str) -> Vec<&'a OutputKind> {
        steps
            .iter()
            .flat_map(|s| s.outputs.iter())
            .filter(|o| o.request_id == id)
            .map(|o| &o.kind)
            .collect()
    }

    fn prefill_done(steps: &[StepOutcome], id: &str) -> (usize, usize, Duration) {
        for k in outputs_of(steps, id) {
            if let OutputKind::PrefillDone {
                cached_blocks,
                prompt_blocks,
                ttft,
                ..
            } = *k
            {
                return (cached_blocks, prompt_blocks, ttft);
            }
        }
        panic!("no PrefillDone for {id}")
    }

    #[test]
    fn repeated_prompt_finds_its_blocks_cached() {
        let mut e = engine(EngineConfig::default());
        // 1000 tokens: 15 full blocks of 64 and a partial one.
        let tokens: Vec<u32> = (0..1000).collect();
        e.submit(req("a", tokens.clone(), 4), Duration::ZERO)
            .unwrap();
        let (steps, now) = drain(&mut e, Duration::ZERO);
        assert_eq!(prefill_done(&steps, "a").0, 0);
        e.submit(req("b", tokens, 4), now).unwrap();
        let (steps, now) = drain(&mut e, now);
        assert_eq!(prefill_done(&steps, "b").0, 15);
        assert_eq!(prefill_done(&steps, "b").1, 15);
        assert!(
            steps.iter().all(|s| s.events.is_empty()),
            "nothing new stored"
        );

        // Block-aligned prompt: the last token is always recomputed, so the last block is
        // not reused (as in vLLM); it is adopted again, not republished.
        let aligned: Vec<u32> = (5000..6024).collect();
        e.submit(req("c", aligned.clone(), 1), now).unwrap();
        let (_, now) = drain(&mut e, now);
        e.submit(req("d", aligned, 1), now).unwrap();
        let (steps, _) = drain(&mut e, now);
        assert_eq!(prefill_done(&steps, "d").0, 15);
        assert_eq!(prefill_done(&steps, "d").1, 16);
        assert!(steps.iter().all(|s| s.events.is_empty()));
    }

    #[test]
    fn cached_prompt_ttft_is_much_lower() {
        let mut e = engine(EngineConfig::default());
        let tokens: Vec<u32> = (0..8000).collect();
        e.submit(req("cold", tokens.clone(), 1), Duration::ZERO)
            .unwrap();
        let (steps, now) = drain(&mut e, Duration::ZERO);
        let cold = prefill_done(&steps, "cold").2;
        e.submit(req("warm", tokens, 1), now).unwrap();
        let (steps, _) = drain(&mut e, now);
        let warm = prefill_done(&steps, "warm").2;
        assert!(cold > Duration::from_millis(400), "{cold:?}");
        assert!(warm * 10 < cold, "warm {warm:?} cold {cold:?}");
    }

    /// Blocks by tier of a request's `PrefillDone`: (cached, host, disk).
    fn tiers_of(steps: &[StepOutcome], id: &str) -> (usize, usize, usize) {
        outputs_of(steps, id)
            .into_iter()
            .find_map(|k| match *k {
                OutputKind::PrefillDone {
                    cached_blocks,
                    host_blocks,
                    disk_blocks,
                    ..
                } => Some((cached_blocks, host_blocks, disk_blocks)),
                _ => None,
            })
            .expect("a PrefillDone")
    }

    #[test]
    fn evicted_prefix_is_loaded_from_the_host_tier_and_costs_a_transfer() {
        // 32 device blocks; prompt a (16 full blocks) is pushed out by b, then asked again.
        let tiered = EngineConfig {
            capacity_blocks: 32,
            host_capacity_blocks: 64,
            ..EngineConfig::default()
        };
        let a: Vec<u32> = (0..1030).collect();
        let b: Vec<u32> = (10_000..12_030).collect();
        let run = |config: EngineConfig| {
            let mut e = engine(config);
            e.submit(req("a", a.clone(), 1), Duration::ZERO).unwrap();
            let (_, now) = drain(&mut e, Duration::ZERO);
            e.submit(req("b", b.clone(), 1), now).unwrap();
            let (steps_b, now) = drain(&mut e, now);
            e.submit(req("again", a.clone(), 1), now).unwrap();
            let (steps, _) = drain(&mut e, now);
            (e, steps_b, steps)
        };
        let (e, steps_b, steps) = run(tiered.clone());
        let (cached, host, disk) = tiers_of(&steps, "again");
        assert_eq!(
            (cached, host, disk),
            (16, 16, 0),
            "every block came back from the host"
        );
        // b's admission moved a's blocks down: stored on the host, then removed from the device.
        let moved: Vec<(Tier, bool)> = steps_b
            .iter()
            .flat_map(|s| &s.events)
            .map(|ev| (ev.tier, matches!(ev.data, KvEventData::Stored { .. })))
            .collect();
        assert!(
            moved.starts_with(&[(Tier::Host, true), (Tier::Device, false)]),
            "{moved:?}"
        );
        // Loading them back takes them off the host (b's blocks went there to make room).
        let off_host: usize = steps
            .iter()
            .flat_map(|s| &s.events)
            .filter(|ev| ev.tier == Tier::Host)
            .map(|ev| match &ev.data {
                KvEventData::Removed { engine_hashes } => engine_hashes.len(),
                _ => 0,
            })
            .sum();
        assert_eq!(off_host, 16);
        assert_eq!(
            e.cache().tier_blocks(Tier::Host),
            16,
            "b's blocks made room for a's"
        );

        // Against no tier: the transfer is far cheaper than the prefill it replaces.
        let ttft_tiered = prefill_done(&steps, "again").2;
        let (_, _, cold) = run(EngineConfig {
            host_capacity_blocks: 0,
            ..tiered.clone()
        });
        assert_eq!(tiers_of(&cold, "again"), (0, 0, 0));
        let ttft_cold = prefill_done(&cold, "again").2;
        assert!(
            ttft_tiered * 3 < ttft_cold,
            "{ttft_tiered:?} vs {ttft_cold:?}"
        );
        let load = tiered.timing.host_load_ns_per_token * (16 * 64) as f64;
        assert!(
            ttft_tiered >= Duration::from_nanos(load as u64),
            "{ttft_tiered:?}"
        );
    }

    #[test]
    fn transferred_prompt_skips_prefill_but_caches_its_blocks() {
        let tokens: Vec<u32> = (0..8192).collect();
        let mut cold = engine(EngineConfig::default());
        cold.submit(req("cold", tokens.clone(), 3), Duration::ZERO)
            .unwrap();
        let (steps, _) = drain(&mut cold, Duration::ZERO);
        let cold_ttft = prefill_done(&steps, "cold").2;
        assert!(cold_ttft > Duration::from_millis(500), "{cold_ttft:?}");

        let mut e = engine(EngineConfig::default());
        e.submit_transferred(req("t", tokens.clone(), 3), Duration::ZERO)
            .unwrap();
        let (steps, now) = drain(&mut e, Duration::ZERO);
        // One step to the first token, then two decode steps.
        assert_eq!(steps.len(), 3);
        let (cached, prompt_blocks, ttft) = prefill_done(&steps, "t");
        assert_eq!((cached, prompt_blocks), (0, 128));
        assert!(ttft < Duration::from_millis(20), "{ttft:?}");
        assert!(
            ttft * 20 < cold_ttft,
            "transferred {ttft:?} cold {cold_ttft:?}"
        );
        assert_eq!(ttft, e.config().timing.decode_time(&[8192]));
        assert!(matches!(
            outputs_of(&steps, "t").last(),
            Some(OutputKind::Finished {
                output_tokens: 3,
                ..
            })
        ));
        // Every full block is stored, in one event chained from the root.
        assert_eq!(steps[0].events.len(), 1);
        let KvEventData::Stored { parent, blocks } = &steps[0].events[0].data else {
            panic!()
        };
        assert_eq!((*parent, blocks.len()), (None, 128));
        assert!(steps[1..].iter().all(|s| s.events.is_empty()));
        assert_eq!(e.load().cached_blocks, 128);

        // Another request with the same prefix reuses the blocks, as after a local prefill.
        let mut longer = tokens.clone();
        longer.extend(10_000..10_100);
        e.submit_transferred(req("t2", longer, 1), now).unwrap();
        let (steps, now) = drain(&mut e, now);
        assert_eq!(prefill_done(&steps, "t2").0, 128);
        let stored: usize = steps
            .iter()
            .flat_map(|s| &s.events)
            .map(|ev| match &ev.data {
                KvEventData::Stored { blocks, .. } => blocks.len(),
                _ => 0,
            })
            .sum();
        assert_eq!(stored, 1, "only the one new full block");
        e.submit(req("agg", tokens, 1), now).unwrap();
        let (steps, _) = drain(&mut e, now);
        assert_eq!(prefill_done(&steps, "agg").0, 127);
    }

    #[test]
    fn transferred_prompt_still_waits_for_capacity() {
        let mut e = engine(EngineConfig {
            block_size: 4,
            capacity_blocks: 10,
            ..Default::default()
        });
        // Each needs ceil((16 + 8 - 1) / 4) = 6 blocks: only one fits at a time.
        for i in 0..2u32 {
            let tokens: Vec<u32> = (0..16).map(|t| t + 100 * i).collect();
            e.submit_transferred(req(&format!("r{i}"), tokens, 8), Duration::ZERO)
                .unwrap();
        }
        let first = e.step(Duration::ZERO).unwrap();
        assert_eq!(e.load().running_requests, 1);
        assert_eq!(e.load().waiting_requests, 1);
        assert!(matches!(
            first.outputs[0].kind,
            OutputKind::PrefillDone {
                prompt_blocks: 4,
                ..
            }
        ));
        drain(&mut e, first.duration);
        assert!(e.is_idle());
    }

    #[test]
    fn decode_step_time_grows_with_batch_size() {
        let decode_step = |n: usize| {
            let mut e = engine(EngineConfig::default());
            for i in 0..n {
                let tokens: Vec<u32> = (0..512).map(|t| t + 1000 * i as u32).collect();
                e.submit(req(&format!("r{i}"), tokens, 10), Duration::ZERO)
                    .unwrap();
            }
            let mut now = Duration::ZERO;
            // Prefill everything (one step, 512 × n ≤ 8192 tokens), then one decode-only step.
            let first = e.step(now).unwrap();
            now += first.duration;
            let second = e.step(now).unwrap();
            assert_eq!(second.outputs.len(), n);
            assert!(second
                .outputs
                .iter()
                .all(|o| matches!(o.kind, OutputKind::Token { index: 1, .. })));
            second.duration
        };
        let d1 = decode_step(1);
        let d8 = decode_step(8);
        let d16 = decode_step(16);
        assert!(d1 < d8 && d8 < d16, "{d1:?} {d8:?} {d16:?}");
        assert!(d1 >= Duration::from_millis(7));
    }

    #[test]
    fn chunked_prefill_of_20k_tokens_takes_several_steps() {
        let mut e = engine(EngineConfig::default());
        let tokens: Vec<u32> = (0..20_000).collect();
        e.submit(req("long", tokens, 2), Duration::ZERO).unwrap();
        let (steps, _) = drain(&mut e, Duration::ZERO);
        // 8192 + 8192 + 3616 prompt tokens, then one decode step.
        assert_eq!(steps.len(), 4);
        assert!(steps[0].outputs.is_empty() && steps[1].outputs.is_empty());
        assert!(matches!(
            steps[2].outputs[0].kind,
            OutputKind::PrefillDone {
                cached_blocks: 0,
                prompt_blocks: 312,
                ..
            }
        ));
        // One Stored per step, chained through the parent of the previous step's last block.
        let mut ids = Vec::new();
        let mut last_engine = None;
        let mut stored = 0;
        for s in &steps[..3] {
            assert_eq!(s.events.len(), 1);
            let KvEventData::Stored { parent, blocks } = &s.events[0].data else {
                panic!()
            };
            assert_eq!(*parent, last_engine);
            last_engine = blocks.last().map(|b| b.engine_hash);
            stored += blocks.len();
            ids.push(s.events[0].event_id);
        }
        assert_eq!(ids, vec![0, 1, 2]);
        assert_eq!(stored, 312);
        // The first chunk step costs about as much as an 8k prefill; the whole prefill more.
        let ttft = steps[..3].iter().map(|s| s.duration).sum::<Duration>();
        assert!(ttft > Duration::from_millis(1300), "{ttft:?}");
    }

    #[test]
    fn untrusted_requests_get_typed_errors() {
        let cfg = EngineConfig {
            block_size: 16,
            capacity_blocks: 10,
            ..Default::default()
        };
        let mut e = engine(cfg.clone());
        assert_eq!(
            e.submit(req("a", vec![], 1), Duration::ZERO),
            Err(SubmitError::EmptyPrompt)
        );
        assert!(matches!(
            e.submit(req("a", vec![1; 161], 1), Duration::ZERO),
            Err(SubmitError::TooLong {
                needed_blocks: 11,
                ..
            })
        ));
        assert!(matches!(
            e.submit(req("a", vec![1; 100], u32::MAX), Duration::ZERO),
            Err(SubmitError::TooLong { .. })
        ));
        e.submit(req("a", vec![1; 160], 1), Duration::ZERO).unwrap();
        assert_eq!(
            e.submit(req("a", vec![1; 10], 1), Duration::ZERO),
            Err(SubmitError::DuplicateRequestId("a".into()))
        );
        let mut e = engine(EngineConfig {
            enable_chunked_prefill: false,
            max_num_batched_tokens: 64,
            ..cfg
        });
        assert!(matches!(
            e.submit(req("b", vec![1; 65], 1), Duration::ZERO),
            Err(SubmitError::PromptExceedsBatch { .. })
        ));
        assert_eq!(
            RankEngine::new(
                KEY,
                EngineConfig {
                    max_num_seqs: 0,
                    ..Default::default()
                }
            )
            .err(),
            Some(ConfigError::ZeroMaxNumSeqs)
        );
    }

    #[test]
    fn token_stream_and_finish() {
        let mut e = engine(EngineConfig::default());
        e.submit(req("zero", vec![1; 100], 0), Duration::from_millis(1))
            .unwrap();
        e.submit(req("three", vec![2; 100], 3), Duration::from_millis(1))
            .unwrap();
        let (steps, _) = drain(&mut e, Duration::from_millis(2));
        let zero = outputs_of(&steps, "zero");
        assert_eq!(zero.len(), 2);
        assert!(matches!(zero[0], OutputKind::PrefillDone { .. }));
        assert!(matches!(
            zero[1],
            OutputKind::Finished {
                output_tokens: 0,
                ..
            }
        ));
        let three = outputs_of(&steps, "three");
        assert_eq!(three.len(), 4);
        let OutputKind::PrefillDone { ttft, .. } = *three[0] else {
            panic!()
        };
        assert_eq!(ttft, steps[0].duration + Duration::from_millis(1));
        assert_eq!(
            *three[1],
            OutputKind::Token {
                index: 1,
                itl: steps[1].duration
            }
        );
        assert!(matches!(three[2], OutputKind::Token { index: 2, .. }));
        let OutputKind::Finished {
            output_tokens: 3,
            latency,
        } = *three[3]
        else {
            panic!()
        };
        assert_eq!(
            latency,
            steps.iter().map(|s| s.duration).sum::<Duration>() + Duration::from_millis(1)
        );
        assert!(e.is_idle());
        assert_eq!(e.step(Duration::from_secs(9)), None);
    }

    #[test]
    fn admission_waits_for_capacity_and_max_num_seqs() {
        let mut e = engine(EngineConfig {
            block_size: 4,
            capacity_blocks: 10,
            max_num_seqs: 2,
            ..Default::default()
        });
        // Each needs ceil((16 + 8 - 1) / 4) = 6 blocks: only one fits at a time.
        for i in 0..3u32 {
            let tokens: Vec<u32> = (0..16).map(|t| t + 100 * i).collect();
            e.submit(req(&format!("r{i}"), tokens, 8), Duration::ZERO)
                .unwrap();
        }
        e.step(Duration::ZERO).unwrap();
        assert_eq!(e.load().running_requests, 1);
        assert_eq!(e.load().waiting_requests, 2);
        let (_, now) = drain(&mut e, Duration::ZERO);
        assert!(e.load().cached_blocks <= 10);

        // Small requests: max_num_seqs bounds the running set.
        for i in 0..5u32 {
            e.submit(req(&format!("s{i}"), vec![i; 3], 2), now).unwrap();
        }
        e.step(now).unwrap();
        assert_eq!(e.load().running_requests, 2);
        assert_eq!(e.load().waiting_requests, 3);
        drain(&mut e, now);
        assert!(e.is_idle());
    }

    #[test]
    fn abort_clear_load_and_state() {
        let mut e = engine(EngineConfig {
            block_size: 4,
            capacity_blocks: 100,
            max_num_batched_tokens: 8,
            ..Default::default()
        });
        e.submit(req("a", (0..40).collect(), 5), Duration::ZERO)
            .unwrap();
        e.submit(req("b", (100..140).collect(), 5), Duration::ZERO)
            .unwrap();
        let out = e.step(Duration::ZERO).unwrap();
        assert_eq!(out.events.len(), 1); // a's first 2 blocks
        let load = e.load();
        assert_eq!((load.running_requests, load.waiting_requests), (1, 1));
        assert_eq!((load.active_blocks, load.cached_blocks), (2, 2));
        assert!(e.abort("b"));
        assert!(e.abort("a"));
        assert!(!e.abort("a"));
        e.check_invariants().unwrap();
        assert_eq!(e.load().active_blocks, 0);
        assert_eq!(e.load().cached_blocks, 2);
        let (dump, last) = e.state_events(1);
        assert_eq!(last, Some(0));
        assert_eq!(dump.len(), 2);
        let cleared = e.clear();
        assert_eq!((cleared.event_id, cleared.data), (1, KvEventData::Cleared));
        assert_eq!(e.state_events(1), (vec![], Some(1)));
        assert_eq!(e.load().cached_blocks, 0);
        // The id of an aborted request may be reused.
        e.submit(req("a", (0..40).collect(), 1), Duration::ZERO)
            .unwrap();
    }
}

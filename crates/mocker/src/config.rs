//! Engine configuration and the timing model of a simulated rank.
//!
//! # Defaults: an 8B model on one H100 with vLLM (estimates)
//!
//! Every constant below is an *estimate* for Llama-3-8B (bf16) served by vLLM on one H100
//! SXM 80 GB, derived from first principles and public ballpark figures, not measured here.
//! They give the simulation the right shape (prefill cost grows with uncached tokens,
//! decode cost with batch and context), not benchmark-grade absolute numbers.
//!
//! - **KV capacity** ([`EngineConfig::capacity_blocks`] = 6400 blocks of 64 tokens =
//!   409,600 tokens). Llama-3-8B keeps `2 (K,V) × 32 layers × 8 KV heads × 128 dims × 2 bytes
//!   = 128 KiB` of KV per token. With `gpu_memory_utilization = 0.9` (≈ 72 GB), minus ≈ 16 GB
//!   of weights and a few GB of activations / CUDA graphs, ≈ 50 GiB remain for KV, i.e.
//!   ≈ 400k tokens, which is what vLLM logs for this set-up give, give or take 10%.
//! - **Prefill** ([`TimingModel::prefill_base`] 5 ms, [`TimingModel::prefill_ns_per_token`]
//!   60 µs, [`TimingModel::prefill_attention_ns_per_pair`] 1.5 ns). The linear term is the
//!   dense compute, `2 × 8e9 = 16 GFLOP` per token; at an effective ≈ 270 TFLOP/s (about 27%
//!   of the bf16 dense peak, which is what served prefill achieves end-to-end once sampling,
//!   scheduling and kernel launch gaps are counted) that is ≈ 60 µs per token. The quadratic
//!   term is causal attention: `4 × 32 layers × 4096 = 0.5 MFLOP` per (query, key) pair, at
//!   ≈ 350 TFLOP/s ≈ 1.5 ns per pair. An uncached 8k-token prompt:
//!   `5 ms + 8192 × 60 µs + 8192²/2 × 1.5 ns ≈ 5 + 492 + 50 ≈ 547 ms`.
//!   Attention runs over the whole context, so a chunk that follows a cached prefix still
//!   pays attention over that prefix (but not its dense compute).
//! - **Decode** ([`TimingModel::decode_base`] 7 ms, [`TimingModel::decode_ns_per_seq`]
//!   100 µs, [`TimingModel::decode_ns_per_context_token`] 40 ns). A decode step is memory
//!   bound: reading 16 GB of weights at ≈ 3 TB/s is ≈ 5.5 ms, plus scheduling and sampling
//!   ≈ 7 ms; each sequence adds sampling, its own MLP rows and bookkeeping (≈ 0.1 ms); each
//!   context token adds its 128 KiB of KV read at ≈ 3 TB/s ≈ 40 ns.
//! - **Mixed batches** (chunked prefill piggy-backing on decodes) run as one forward pass:
//!   the larger of the two bases, plus every prefill and decode term.
//! - **Lower tiers** ([`EngineConfig::host_capacity_blocks`], [`EngineConfig::disk_capacity_blocks`],
//!   both 0 by default: no tier). A block the device evicts moves to host memory, then to
//!   disk (see the `offload` module). A request whose device prefix ends where a lower tier
//!   continues it loads those blocks instead of computing them: they cost a transfer,
//!   [`TimingModel::host_load_ns_per_token`] 5 µs and [`TimingModel::disk_load_ns_per_token`]
//!   25 µs per token, paid in the step that admits the request (on the step's critical path,
//!   as a synchronous load; engines that overlap loads with other requests' compute do
//!   better for the neighbours). A token's 128 KiB of KV over PCIe at ≈ 26 GB/s effective is
//!   ≈ 5 µs, from an NVMe drive at ≈ 5 GB/s ≈ 25 µs, against 60 µs to compute it. Loaded
//!   blocks count as context for the attention of the chunk that follows, as cached ones do.
//! - **Batching limits**: `max_num_batched_tokens = 8192`, `max_num_seqs = 256` and chunked
//!   prefill on, as vLLM v1 defaults for an H100-class GPU.

use crate::engine_hash::DEFAULT_ENGINE_HASH_SEED;
use serde::{Deserialize, Serialize};
use std::time::Duration;
use thiserror::Error;

/// How long one scheduler step of a rank takes, from the shape of its batch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TimingModel {
    /// Fixed cost of a step that computes any prefill tokens.
    pub prefill_base: Duration,
    /// Dense compute per uncached prompt token computed in the step.
    pub prefill_ns_per_token: f64,
    /// Attention per (query token, context token) pair of the prefill chunks in the step.
    pub prefill_attention_ns_per_pair: f64,
    /// Fixed cost of a step that decodes any sequence (weights read once per step).
    pub decode_base: Duration,
    /// Cost per sequence decoded in the step.
    pub decode_ns_per_seq: f64,
    /// Cost per context token (KV read) of the sequences decoded in the step.
    pub decode_ns_per_context_token: f64,
    /// Copying a prompt token's KV from host memory to the device.
    #[serde(default = "default_host_load")]
    pub host_load_ns_per_token: f64,
    /// Reading a prompt token's KV from disk to the device.
    #[serde(default = "default_disk_load")]
    pub disk_load_ns_per_token: f64,
}

fn default_host_load() -> f64 {
    5_000.0
}

fn default_disk_load() -> f64 {
    25_000.0
}

impl Default for TimingModel {
    /// Llama-3-8B on one H100 with vLLM; see the module docs for how each value is estimated.
    fn default() -> Self {
        Self {
            prefill_base: Duration::from_millis(5),
            prefill_ns_per_token: 60_000.0,
            prefill_attention_ns_per_pair: 1.5,
            decode_base: Duration::from_millis(7),
            decode_ns_per_seq: 100_000.0,
            decode_ns_per_context_token: 40.0,
            host_load_ns_per_token: default_host_load(),
            disk_load_ns_per_token: default_disk_load(),
        }
    }
}

/// What one step computes, as the timing model sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BatchShape {
    /// Prompt tokens computed (cached prefix tokens are not computed).
    pub prefill_tokens: u64,
    /// Sum over prefill chunks of `chunk × (context before the chunk + (chunk + 1) / 2)`:
    /// the causal attention pairs of the chunks, including over cached prefixes.
    pub prefill_attention_pairs: f64,
    /// Sequences that decode one token in the step.
    pub decode_seqs: u64,
    /// Sum of the context lengths (KV tokens read) of the decoding sequences.
    pub decode_context_tokens: u64,
    /// Prompt tokens loaded from host memory instead of computed.
    pub host_loaded_tokens: u64,
    /// Prompt tokens loaded from disk instead of computed.
    pub disk_loaded_tokens: u64,
}

impl BatchShape {
    /// Adds one prefill chunk of `chunk` tokens that follows `context_before` tokens in KV.
    pub fn add_prefill_chunk(&mut self, context_before: usize, chunk: usize) {
        self.prefill_tokens += chunk as u64;
        let c = chunk as f64;
        self.prefill_attention_pairs += c * (context_before as f64 + (c + 1.0) / 2.0);
    }

    /// Adds one decoding sequence whose KV holds `context` tokens.
    pub fn add_decode(&mut self, context: usize) {
        self.decode_seqs += 1;
        self.decode_context_tokens += context as u64;
    }

    /// Adds prompt tokens loaded from the host and the disk tiers.
    pub fn add_loaded(&mut self, host_tokens: usize, disk_tokens: usize) {
        self.host_loaded_tokens += host_tokens as u64;
        self.disk_loaded_tokens += disk_tokens as u64;
    }

    /// Nothing is computed or loaded.
    pub fn is_empty(&self) -> bool {
        self.prefill_tokens == 0
            && self.decode_seqs == 0
            && self.host_loaded_tokens == 0
            && self.disk_loaded_tokens == 0
    }
}

impl TimingModel {
    /// The simulated duration of a step with this batch shape (zero for an empty batch).
    pub fn step_duration(&self, shape: &BatchShape) -> Duration {
        let mut base = Duration::ZERO;
        let mut ns = 0.0f64;
        if shape.prefill_tokens > 0 {
            base = base.max(self.prefill_base);
            ns += self.prefill_ns_per_token * shape.prefill_tokens as f64;
            ns += self.prefill_attention_ns_per_pair * shape.prefill_attention_pairs;
        }
        if shape.decode_seqs > 0 {
            base = base.max(self.decode_base);
            ns += self.decode_ns_per_seq * shape.decode_seqs as f64;
            ns += self.decode_ns_per_context_token * shape.decode_context_tokens as f64;
        }
        ns += self.host_load_ns_per_token * shape.host_loaded_tokens as f64;
        ns += self.disk_load_ns_per_token * shape.disk_loaded_tokens as f64;
        // `as` saturates: negative or NaN costs count as zero, huge ones as u64::MAX ns.
        base.saturating_add(Duration::from_nanos(ns.round() as u64))
    }

    /// Time to prefill `tokens` uncached prompt tokens after `cached` cached ones, alone.
    pub fn prefill_time(&self, cached: usize, tokens: usize) -> Duration {
        let mut shape = BatchShape::default();
        shape.add_prefill_chunk(cached, tokens);
        self.step_duration(&shape)
    }

    /// Time of a decode-only step over sequences with these context lengths.
    pub fn decode_time(&self, contexts: &[usize]) -> Duration {
        let mut shape = BatchShape::default();
        for &c in contexts {
            shape.add_decode(c);
        }
        self.step_duration(&shape)
    }
}

/// Configuration of one simulated data-parallel rank.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EngineConfig {
    /// Tokens per KV block (default 64).
    pub block_size: usize,
    /// KV cache capacity of this rank, in blocks (default 6400: ≈ 400k tokens, see module docs).
    pub capacity_blocks: usize,
    /// Token budget of one step: decode tokens plus prefill chunk tokens (default 8192).
    pub max_num_batched_tokens: usize,
    /// Most requests running (admitted, unfinished) at once (default 256).
    pub max_num_seqs: usize,
    /// Split long prompts across steps (default true). When false, a prompt is prefilled in
    /// one step and must fit `max_num_batched_tokens`.
    pub enable_chunked_prefill: bool,
    /// Host-memory tier of this rank, in blocks (default 0: none). See the module docs.
    #[serde(default)]
    pub host_capacity_blocks: usize,
    /// Disk tier of this rank, in blocks (default 0: none).
    #[serde(default)]
    pub disk_capacity_blocks: usize,
    /// Seed of the engine block hash chain (default [`DEFAULT_ENGINE_HASH_SEED`]).
    pub engine_hash_seed: u64,
    /// Step durations.
    pub timing: TimingModel,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: 64,
            capacity_blocks: 6400,
            max_num_batched_tokens: 8192,
            max_num_seqs: 256,
            enable_chunked_prefill: true,
            host_capacity_blocks: 0,
            disk_capacity_blocks: 0,
            engine_hash_seed: DEFAULT_ENGINE_HASH_SEED,
            timing: TimingModel::default(),
        }
    }
}

/// An engine configuration that cannot run.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ConfigError {
    #[error("block_size must be at least 1 token")]
    ZeroBlockSize,
    #[error("capacity_blocks must be at least 1 block")]
    ZeroCapacity,
    #[error("capacity_blocks {0} does not fit a u32 block id")]
    CapacityTooLarge(usize),
    #[error("max_num_batched_tokens must be at least 1")]
    ZeroBatchedTokens,
    #[error("max_num_seqs must be at least 1")]
    ZeroMaxNumSeqs,
    #[error("timing model constant {0} must be finite and non-negative")]
    BadTiming(&'static str),
}

impl EngineConfig {
    /// Checks that the configuration can run.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.block_size == 0 {
            return Err(ConfigError::ZeroBlockSize);
        }
        if self.capacity_blocks == 0 {
            return Err(ConfigError::ZeroCapacity);
        }
        if self.capacity_blocks >= u32::MAX as usize {
            return Err(ConfigError::CapacityTooLarge(self.capacity_blocks));
        }
        if self.max_num_batched_tokens == 0 {
            return Err(ConfigError::ZeroBatchedTokens);
        }
        if self.max_num_seqs == 0 {
            return Err(ConfigError::ZeroMaxNumSeqs);
        }
        let t = &self.timing;
        for (name, v) in [
            ("prefill_ns_per_token", t.prefill_ns_per_token),
            (
                "prefill_attention_ns_per_pair",
                t.prefill_attention_ns_per_pair,
            ),
            ("decode_ns_per_seq", t.decode_ns_per_seq),
            ("decode_ns_per_context_token", t.decode_ns_per_context_token),
            ("host_load_ns_per_token", t.host_load_ns_per_token),
            ("disk_load_ns_per_token", t.disk_load_ns_per_token),
        ] {
            if !v.is_finite() || v < 0.0 {
                return Err(ConfigError::BadTiming(name));
            }
        }
        Ok(())
    }

    /// Tokens the KV cache of this rank holds.
    pub fn capacity_tokens(&self) -> usize {
        self.capacity_blocks.saturating_mul(self.block_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_prefill_of_8k_tokens_is_about_half_a_second() {
        let t = TimingModel::default();
        let d = t.prefill_time(0, 8192);
        assert!(
            d >= Duration::from_millis(500) && d <= Duration::from_millis(600),
            "{d:?}"
        );
        // Cached prefix: only attention over it is paid, not its dense compute.
        let warm = t.prefill_time(8128, 64);
        assert!(warm < Duration::from_millis(20), "{warm:?}");
    }

    #[test]
    fn decode_grows_with_batch_and_context() {
        let t = TimingModel::default();
        let one = t.decode_time(&[1000]);
        let many = t.decode_time(&[1000; 64]);
        let long = t.decode_time(&[100_000]);
        assert!(one >= Duration::from_millis(7) && one < Duration::from_millis(8));
        assert!(many > one + Duration::from_millis(5));
        assert!(long > one);
        assert_eq!(t.step_duration(&BatchShape::default()), Duration::ZERO);
    }

    #[test]
    fn mixed_step_uses_the_larger_base() {
        let t = TimingModel::default();
        let mut s = BatchShape::default();
        s.add_decode(10);
        s.add_prefill_chunk(0, 1);
        let d = t.step_duration(&s);
        assert!(d >= t.decode_base && d < t.decode_base + Duration::from_millis(1));
    }

    #[test]
    fn validation() {
        assert_eq!(EngineConfig::default().validate(), Ok(()));
        let mut c = EngineConfig {
            block_size: 0,
            ..Default::default()
        };
        assert_eq!(c.validate(), Err(ConfigError::ZeroBlockSize));
        c.block_size = 16;
        c.capacity_blocks = 0;
        assert_eq!(c.validate(), Err(ConfigError::ZeroCapacity));
        c.capacity_blocks = 10;
        c.timing.decode_ns_per_seq = f64::NAN;
        assert!(matches!(c.validate(), Err(ConfigError::BadTiming(_))));
    }
}

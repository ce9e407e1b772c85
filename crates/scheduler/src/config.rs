//! Scheduler configuration and its validation.

use crate::error::ScheduleError;
use std::time::Duration;

/// How a worker key is chosen among the candidates that pass the filters and busy thresholds.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum RoutingPolicy {
    /// Lowest cost (cached prefix and load), the point of kvrouter.
    #[default]
    Kv,
    /// Each candidate in turn.
    RoundRobin,
    /// Uniformly at random.
    Random,
    /// Least load (active blocks plus in-flight prefill, in blocks), ignoring cached prefixes.
    LeastLoaded,
}

impl RoutingPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Kv => "kv",
            Self::RoundRobin => "round-robin",
            Self::Random => "random",
            Self::LeastLoaded => "least-loaded",
        }
    }
}

impl std::fmt::Display for RoutingPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for RoutingPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "kv" => Ok(Self::Kv),
            "round-robin" | "rr" => Ok(Self::RoundRobin),
            "random" => Ok(Self::Random),
            "least-loaded" => Ok(Self::LeastLoaded),
            other => Err(format!(
                "unknown policy {other:?}: expected kv, round-robin, random or least-loaded"
            )),
        }
    }
}

/// In which order queued requests (those that found every candidate busy) are retried.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum QueuePolicy {
    /// First come, first served.
    #[default]
    Fcfs,
    /// Weighted shortest processing time: fewest uncached prompt tokens (on the rank that
    /// caches most of the prompt, as seen when queued) first, so short prefills do not wait
    /// behind long ones; ties first come, first served. Mean waiting time is lowest; a long
    /// prompt may wait until the queue timeout under sustained overload.
    Wspt,
}

impl QueuePolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Fcfs => "fcfs",
            Self::Wspt => "wspt",
        }
    }
}

impl std::fmt::Display for QueuePolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for QueuePolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fcfs" => Ok(Self::Fcfs),
            "wspt" => Ok(Self::Wspt),
            other => Err(format!(
                "unknown queue policy {other:?}: expected fcfs or wspt"
            )),
        }
    }
}

/// Tunables of one model's scheduler. See the crate docs for the cost formula.
#[derive(Clone, Debug, PartialEq)]
pub struct SchedulerConfig {
    /// Tokens per KV block (per model). Must be > 0.
    pub block_size: u32,
    /// How many prefill blocks one overlapping (cached) block saves. ≥ 0.
    pub overlap_credit: f64,
    /// Credit per cached block found only in a worker's host memory. ≥ 0.
    pub host_cache_hit_weight: f64,
    /// Credit per cached block found only on a worker's disk. ≥ 0.
    pub disk_cache_hit_weight: f64,
    /// Credit per cached block found only in shared storage. ≥ 0.
    pub shared_cache_hit_weight: f64,
    /// Weight of prefill blocks against decode blocks in the cost. ≥ 0.
    pub prefill_load_scale: f64,
    /// Predicted blocks: credit per leading prompt block that is not (yet) in a key's index
    /// but belongs to a request active on the key (routed there, its prefill under way or
    /// done: the blocks will be cached by the time this request is prefilled, unless
    /// evicted). The prediction lasts as long as that request is active; KV events confirm
    /// it meanwhile. 0 turns it off. ≥ 0.
    pub active_prefix_credit: f64,
    /// In-flight prefill tokens on a key past this many no longer count against it in the
    /// cost (0: no cap): once every candidate has seconds of prefill queued, the cached
    /// prefix decides, not which backlog is a little shorter.
    pub prefill_queue_cap_tokens: u64,
    /// 0: lowest cost wins (random tie-break). > 0: softmax sampling over normalised costs.
    pub temperature: f64,
    /// A key is busy when its active blocks ≥ `frac × capacity_blocks` (in (0, 1]).
    /// Keys with an unknown capacity (0) never trip this threshold.
    pub busy_active_blocks_frac: Option<f64>,
    /// A key is busy when its in-flight prefill tokens ≥ this (> 0).
    pub busy_prefill_tokens: Option<u64>,
    /// A key is busy when its engine last reported at least this many waiting requests
    /// (> 0; engines behind `kvrouter bridge` report it from their own metrics).
    pub busy_waiting_requests: Option<u64>,
    /// Bound of the queue of requests that found every candidate busy (0: no queue).
    pub max_queued_requests: usize,
    /// Active sequences older than this are freed by `sweep`.
    pub request_timeout: Duration,
    /// Queued requests waiting this long fail with `QueueTimeout`. Keep it under the
    /// callers' route timeout: a request placed after its caller gave up is load nobody frees.
    pub queue_timeout: Duration,
    /// Seed of the scheduler's own random generator (tie-breaks and sampling).
    pub seed: u64,
    /// How the candidate is chosen (baselines other than `Kv` exist for comparisons).
    pub policy: RoutingPolicy,
    /// In which order queued requests are retried.
    pub queue_policy: QueuePolicy,
    /// The largest `priority_jump` a request gets, in seconds (finite, ≥ 0): a larger one
    /// counts as this much (clamped, not refused), so no caller jumps the queue by more.
    pub max_priority_jump: f64,
}

/// Default credit of a host-memory hit: a transfer over PCIe, far cheaper than a prefill
/// (Dynamo's default; llm-d uses 0.8 for CPU).
pub const DEFAULT_HOST_CACHE_HIT_WEIGHT: f64 = 0.75;
/// Default credit of a disk hit.
pub const DEFAULT_DISK_CACHE_HIT_WEIGHT: f64 = 0.25;
/// Default of [`SchedulerConfig::prefill_load_scale`]: a prompt block to prefill costs the
/// mocker's model (an 8B model on one H100) about 3.8 ms, against about 0.9 ms that a block
/// held in a worker's KV adds to the steps of a request decoding a few hundred tokens there;
/// replaying the shipped and generated traces agrees (see docs/benchmarks.md).
pub const DEFAULT_PREFILL_LOAD_SCALE: f64 = 4.0;
/// Default of [`SchedulerConfig::active_prefix_credit`] (chosen by replaying the shipped and
/// generated traces; see docs/benchmarks.md).
pub const DEFAULT_ACTIVE_PREFIX_CREDIT: f64 = 1.0;
/// Default of [`SchedulerConfig::prefill_queue_cap_tokens`]: about 4 s of the mocker's prefill
/// (60 µs a token), or a few seconds of a large model's on one GPU (chosen by replaying the
/// shipped and generated traces; see docs/benchmarks.md).
pub const DEFAULT_PREFILL_QUEUE_CAP_TOKENS: u64 = 65_536;
/// Default credit of a shared-storage hit.
pub const DEFAULT_SHARED_CACHE_HIT_WEIGHT: f64 = 0.25;

/// Default of [`SchedulerConfig::queue_timeout`]: under the client library's 2 s route
/// timeout, so callers get `QueueTimeout` rather than a timeout of their own.
pub const DEFAULT_QUEUE_TIMEOUT: Duration = Duration::from_millis(1500);

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            block_size: 64,
            overlap_credit: 1.0,
            host_cache_hit_weight: DEFAULT_HOST_CACHE_HIT_WEIGHT,
            disk_cache_hit_weight: DEFAULT_DISK_CACHE_HIT_WEIGHT,
            shared_cache_hit_weight: DEFAULT_SHARED_CACHE_HIT_WEIGHT,
            prefill_load_scale: DEFAULT_PREFILL_LOAD_SCALE,
            active_prefix_credit: DEFAULT_ACTIVE_PREFIX_CREDIT,
            prefill_queue_cap_tokens: DEFAULT_PREFILL_QUEUE_CAP_TOKENS,
            temperature: 0.0,
            busy_active_blocks_frac: None,
            busy_prefill_tokens: None,
            busy_waiting_requests: None,
            max_queued_requests: 1024,
            request_timeout: Duration::from_secs(300),
            queue_timeout: DEFAULT_QUEUE_TIMEOUT,
            seed: 0,
            policy: RoutingPolicy::Kv,
            queue_policy: QueuePolicy::Fcfs,
            max_priority_jump: kvrouter_protocol::limits::DEFAULT_MAX_PRIORITY_JUMP_SECS,
        }
    }
}

impl SchedulerConfig {
    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<(), ScheduleError> {
        let bad = |msg: String| Err(ScheduleError::InvalidConfig(msg));
        if self.block_size == 0 {
            return bad("block_size must be > 0".into());
        }
        for (name, v) in [
            ("overlap_credit", self.overlap_credit),
            ("host_cache_hit_weight", self.host_cache_hit_weight),
            ("disk_cache_hit_weight", self.disk_cache_hit_weight),
            ("shared_cache_hit_weight", self.shared_cache_hit_weight),
            ("prefill_load_scale", self.prefill_load_scale),
            ("active_prefix_credit", self.active_prefix_credit),
            ("temperature", self.temperature),
            ("max_priority_jump", self.max_priority_jump),
        ] {
            if !v.is_finite() || v < 0.0 {
                return bad(format!("{name} must be a finite number ≥ 0, got {v}"));
            }
        }
        if let Some(frac) = self.busy_active_blocks_frac {
            if !(frac > 0.0 && frac <= 1.0) {
                return bad(format!(
                    "busy_active_blocks_frac must be in (0, 1], got {frac}"
                ));
            }
        }
        if self.busy_prefill_tokens == Some(0) {
            return bad("busy_prefill_tokens must be > 0 (0 would make every worker busy)".into());
        }
        if self.busy_waiting_requests == Some(0) {
            return bad(
                "busy_waiting_requests must be > 0 (0 would make every worker busy)".into(),
            );
        }
        if self.max_queued_requests > 0 && self.queue_timeout.is_zero() {
            return bad(
                "queue_timeout must be > 0 with a queue (give max_queued_requests 0 for none)"
                    .into(),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_valid() {
        SchedulerConfig::default().validate().unwrap();
    }

    #[test]
    fn rejects_bad_values() {
        let cases: [fn(&mut SchedulerConfig); 15] = [
            |c| c.max_priority_jump = -1.0,
            |c| c.max_priority_jump = f64::INFINITY,
            |c| c.active_prefix_credit = -1.0,
            |c| c.active_prefix_credit = f64::NAN,
            |c| c.block_size = 0,
            |c| c.overlap_credit = -1.0,
            |c| c.overlap_credit = f64::NAN,
            |c| c.prefill_load_scale = f64::NAN,
            |c| c.prefill_load_scale = -0.5,
            |c| c.temperature = -0.1,
            |c| c.temperature = f64::INFINITY,
            |c| c.busy_active_blocks_frac = Some(0.0),
            |c| c.busy_active_blocks_frac = Some(1.5),
            |c| c.busy_active_blocks_frac = Some(f64::NAN),
            |c| c.busy_prefill_tokens = Some(0),
        ];
        for (i, f) in cases.iter().enumerate() {
            let mut c = SchedulerConfig::default();
            f(&mut c);
            assert!(
                matches!(c.validate(), Err(ScheduleError::InvalidConfig(_))),
                "case {i} accepted: {c:?}"
            );
        }
    }

    #[test]
    fn accepts_edges() {
        let c = SchedulerConfig {
            busy_active_blocks_frac: Some(1.0),
            busy_prefill_tokens: Some(1),
            overlap_credit: 0.0,
            prefill_load_scale: 0.0,
            temperature: 0.0,
            ..Default::default()
        };
        c.validate().unwrap();
    }
}

//! `kvrouter bench gen-trace`: Mooncake-format traces from a model of a multi-turn chat
//! service, so the index and the router can be measured on workloads with the churn of a
//! real service without shipping one.
//!
//! The model, per session:
//! - sessions arrive as a Poisson process at `rate / turns_mean` per second;
//! - a session starts with one of a few shared system prompts (picked by `system_weights`;
//!   with probability `no_system_prompt` none) and a first user message whose length in
//!   tokens is log-normal (`first_median`, `first_sigma`);
//! - it has a geometric number of turns, mean `turns_mean`; with `turns_length_bias` b > 0
//!   a session's mean grows as (first message / median)^b (long documents get more
//!   questions), normalised so the fleet-wide mean stays `turns_mean`;
//! - each turn's prompt is the previous prompt + the previous answer (its output length,
//!   log-normal `output_median`, `output_sigma`) + a new user message (log-normal
//!   `message_median`, `message_sigma`); a session ends when its prompt would pass
//!   `max_prompt_tokens`;
//! - the next turn arrives after the answer is generated (`decode_ms_per_token` a token)
//!   and a think time (exponential, mean `think_secs`).
//!
//! Requests are sorted by arrival and the first `requests` kept; the trace lasts about
//! `requests / rate` seconds. A prompt is a token sequence that only grows within a session,
//! so hash ids follow from content: block `k` (tokens `512k..512k+512`) has one id per
//! distinct content: inside a system prompt it is shared by every session using it; a full
//! block of a session's own tokens is shared by that session's later turns; a prompt's
//! partial last block is its own.

use crate::trace::TraceRequest;
use rustc_hash::FxHashMap;
use serde::Serialize;
use std::io::Write;

/// Tokens per hash id, as in the Mooncake traces.
pub const TRACE_BLOCK_TOKENS: u64 = 512;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TraceKind {
    /// A chat service shaped like the public Mooncake conversation trace.
    Conversation,
    /// Long documents with follow-up questions, no shared system prompt, shaped like the
    /// shipped synthetic trace.
    Synthetic,
}

impl std::str::FromStr for TraceKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "conversation" => Ok(Self::Conversation),
            "synthetic" => Ok(Self::Synthetic),
            other => Err(format!(
                "unknown trace kind {other:?} (expected conversation or synthetic)"
            )),
        }
    }
}

/// The parameters of the chat-service model (see the module docs).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ChatModel {
    /// Requests per second, all sessions together.
    pub rate: f64,
    pub turns_mean: f64,
    pub turns_length_bias: f64,
    /// Weight of each shared system prompt.
    pub system_weights: Vec<f64>,
    /// System prompt lengths are drawn uniformly from this range (tokens).
    pub system_tokens: (u64, u64),
    pub no_system_prompt: f64,
    pub first_median: f64,
    pub first_sigma: f64,
    pub message_median: f64,
    pub message_sigma: f64,
    pub output_median: f64,
    pub output_sigma: f64,
    pub max_output_tokens: u64,
    pub max_prompt_tokens: u64,
    pub think_secs: f64,
    pub decode_ms_per_token: f64,
}

impl ChatModel {
    /// Defaults fitted to the kind's public trace (docs/benchmarks.md lists the fit).
    pub fn for_kind(kind: TraceKind) -> Self {
        match kind {
            TraceKind::Conversation => Self {
                rate: 12_031.0 / 3_540.0,
                turns_mean: 1.6,
                turns_length_bias: 0.0,
                system_weights: vec![0.49, 0.36, 0.15],
                system_tokens: (520, 1000),
                no_system_prompt: 0.003,
                first_median: 5600.0,
                first_sigma: 1.25,
                message_median: 300.0,
                message_sigma: 1.3,
                output_median: 240.0,
                output_sigma: 0.85,
                max_output_tokens: 8192,
                max_prompt_tokens: 128_000,
                think_secs: 60.0,
                decode_ms_per_token: 30.0,
            },
            TraceKind::Synthetic => Self {
                rate: 4.0,
                turns_mean: 2.3,
                turns_length_bias: 1.0,
                system_weights: Vec::new(),
                system_tokens: (0, 0),
                no_system_prompt: 1.0,
                first_median: 6300.0,
                first_sigma: 0.9,
                message_median: 200.0,
                message_sigma: 1.0,
                output_median: 110.0,
                output_sigma: 0.8,
                max_output_tokens: 8192,
                max_prompt_tokens: 192_000,
                think_secs: 60.0,
                decode_ms_per_token: 30.0,
            },
        }
    }

    /// The default number of requests of the kind's public trace.
    pub fn default_requests(kind: TraceKind) -> usize {
        match kind {
            TraceKind::Conversation => 12_031,
            TraceKind::Synthetic => 3_993,
        }
    }
}

/// Seeded random draws (fastrand's wyrand, Box-Muller normals).
struct Draw(fastrand::Rng);

impl Draw {
    fn unit(&mut self) -> f64 {
        // (0, 1]: safe under ln.
        1.0 - self.0.f64()
    }
    fn normal(&mut self) -> f64 {
        let (u, v) = (self.unit(), self.0.f64());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
    fn log_normal(&mut self, median: f64, sigma: f64) -> f64 {
        median * (sigma * self.normal()).exp()
    }
    fn exponential(&mut self, mean: f64) -> f64 {
        -mean * self.unit().ln()
    }
    fn tokens(&mut self, median: f64, sigma: f64, max: u64) -> u64 {
        (self.log_normal(median, sigma) as u64).clamp(1, max)
    }
    fn weighted(&mut self, weights: &[f64]) -> usize {
        let total: f64 = weights.iter().sum();
        let mut x = self.0.f64() * total;
        for (i, w) in weights.iter().enumerate() {
            if x < *w {
                return i;
            }
            x -= w;
        }
        weights.len() - 1
    }
}

struct Planned {
    at_ms: f64,
    session: u64,
    system: Option<usize>,
    input: u64,
    output: u64,
}

/// What identifies a 512-token block's content.
#[derive(Hash, PartialEq, Eq)]
enum BlockContent {
    System { prompt: usize, block: u64 },
    Session { session: u64, block: u64 },
    Partial { request: usize },
}

/// Generates `requests` requests of the model, in arrival order, deterministic in `seed`.
pub fn generate(model: &ChatModel, requests: usize, seed: u64) -> Vec<TraceRequest> {
    let mut d = Draw(fastrand::Rng::with_seed(seed));
    let system_len: Vec<u64> = model
        .system_weights
        .iter()
        .map(|_| d.0.u64(model.system_tokens.0..=model.system_tokens.1))
        .collect();
    let rate = model.rate.max(1e-9);
    let turns_mean = model.turns_mean.max(1.0);
    // Sessions arriving over 1.5x the target duration leave enough requests after the sort
    // even though late sessions' turns fall past the end.
    let horizon_ms = requests as f64 / rate * 1000.0 * 1.5;
    let session_gap_ms = 1000.0 * turns_mean / rate;
    let bias_norm = (model.turns_length_bias * model.first_sigma).powi(2) / 2.0;
    let mut planned = Vec::with_capacity(requests * 3 / 2);
    let (mut t, mut session) = (0.0, 0u64);
    loop {
        t += d.exponential(session_gap_ms);
        if t >= horizon_ms {
            break;
        }
        session += 1;
        let first = d.tokens(model.first_median, model.first_sigma, u64::MAX / 4);
        let mean = 1.0
            + (turns_mean - 1.0)
                * ((first as f64 / model.first_median).powf(model.turns_length_bias)
                    / bias_norm.exp());
        let mut turns = 1u32;
        while d.0.f64() > 1.0 / mean && turns < 1000 {
            turns += 1;
        }
        let system = (!system_len.is_empty() && d.0.f64() >= model.no_system_prompt)
            .then(|| d.weighted(&model.system_weights));
        let mut input = system.map_or(0, |s| system_len[s]) + first;
        let mut at = t;
        for _ in 0..turns {
            if input > model.max_prompt_tokens {
                break;
            }
            let output = d.tokens(
                model.output_median,
                model.output_sigma,
                model.max_output_tokens,
            );
            planned.push(Planned {
                at_ms: at,
                session,
                system,
                input,
                output,
            });
            at += output as f64 * model.decode_ms_per_token
                + d.exponential(model.think_secs * 1000.0);
            input += output + d.tokens(model.message_median, model.message_sigma, u64::MAX / 4);
        }
    }
    planned.sort_by(|a, b| a.at_ms.total_cmp(&b.at_ms));
    planned.truncate(requests);
    let mut ids: FxHashMap<BlockContent, u64> = FxHashMap::default();
    let mut out = Vec::with_capacity(planned.len());
    for (i, p) in planned.iter().enumerate() {
        let blocks = p.input.div_ceil(TRACE_BLOCK_TOKENS);
        let hash_ids = (0..blocks)
            .map(|k| {
                let end = (k + 1) * TRACE_BLOCK_TOKENS;
                let content = match p.system {
                    Some(s) if end <= system_len[s] => BlockContent::System {
                        prompt: s,
                        block: k,
                    },
                    _ if end <= p.input => BlockContent::Session {
                        session: p.session,
                        block: k,
                    },
                    _ => BlockContent::Partial { request: i },
                };
                let next = ids.len() as u64;
                *ids.entry(content).or_insert(next)
            })
            .collect();
        out.push(TraceRequest {
            timestamp: p.at_ms as u64,
            input_length: p.input,
            output_length: p.output,
            hash_ids,
        });
    }
    out
}

/// Writes requests as Mooncake JSONL.
pub fn write_trace(w: &mut impl Write, requests: &[TraceRequest]) -> std::io::Result<()> {
    for r in requests {
        serde_json::to_writer(&mut *w, r)?;
        w.write_all(b"\n")?;
    }
    w.flush()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace_stats::TraceStats;

    #[test]
    fn deterministic_in_the_seed_and_sorted() {
        let m = ChatModel::for_kind(TraceKind::Conversation);
        let a = generate(&m, 500, 7);
        assert_eq!(a, generate(&m, 500, 7));
        assert_ne!(a, generate(&m, 500, 8));
        assert_eq!(a.len(), 500);
        assert!(a.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
        for r in &a {
            assert_eq!(
                r.hash_ids.len() as u64,
                r.input_length.div_ceil(TRACE_BLOCK_TOKENS)
            );
        }
    }

    #[test]
    fn later_turns_extend_their_sessions_full_blocks() {
        // No system prompt, every session many turns: each later turn's prompt starts with
        // every full block of an earlier request.
        let m = ChatModel {
            turns_mean: 50.0,
            system_weights: vec![],
            no_system_prompt: 1.0,
            ..ChatModel::for_kind(TraceKind::Conversation)
        };
        let reqs = generate(&m, 300, 1);
        let mut extended = 0;
        for (i, r) in reqs.iter().enumerate() {
            let earlier = reqs[..i].iter().find(|e| {
                let full = (e.input_length / TRACE_BLOCK_TOKENS) as usize;
                full > 0 && r.hash_ids.len() > full && r.hash_ids[..full] == e.hash_ids[..full]
            });
            if let Some(e) = earlier {
                extended += 1;
                // a partial last block is never reused
                if e.input_length % TRACE_BLOCK_TOKENS != 0 {
                    let last = *e.hash_ids.last().unwrap();
                    assert!(!r.hash_ids.contains(&last));
                }
            }
        }
        assert!(
            extended > 200,
            "only {extended} of 300 extend an earlier turn"
        );
    }

    /// The defaults match the public traces' shape (the figures).
    #[test]
    fn conversation_defaults_match_the_public_trace() {
        let m = ChatModel::for_kind(TraceKind::Conversation);
        let s = TraceStats::of(generate(&m, 12_031, 1).iter());
        assert_eq!(s.requests, 12_031);
        assert!((50.0..70.0).contains(&s.duration_mins), "{s:?}");
        assert!((21.0..27.0).contains(&s.prompt_blocks_mean), "{s:?}");
        assert!((12..=16).contains(&s.prompt_blocks_median), "{s:?}");
        assert!((46..=62).contains(&s.prompt_blocks_p90), "{s:?}");
        assert!((200..=260).contains(&s.prompt_blocks_max), "{s:?}");
        assert!((160_000..210_000).contains(&s.distinct_blocks), "{s:?}");
        assert!((0.32..0.42).contains(&s.seen_before_ratio), "{s:?}");
        assert!((310.0..380.0).contains(&s.output_tokens_mean), "{s:?}");
        assert!(s.top_first_block_share > 0.4, "{s:?}");
    }

    #[test]
    fn synthetic_defaults_match_the_shipped_trace() {
        let m = ChatModel::for_kind(TraceKind::Synthetic);
        let s = TraceStats::of(generate(&m, 3_993, 1).iter());
        assert!((25.0..36.0).contains(&s.prompt_blocks_mean), "{s:?}");
        assert!((0.55..0.72).contains(&s.seen_before_ratio), "{s:?}");
        assert!((130.0..170.0).contains(&s.output_tokens_mean), "{s:?}");
        assert!(s.top_first_block_share < 0.05, "{s:?}");
    }
}

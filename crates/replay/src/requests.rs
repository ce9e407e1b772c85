//! Trace records → the prompts the replay sends.
//!
//! Each Mooncake hash id stands for [`TOKENS_PER_HASH_ID`] tokens derived deterministically from
//! the id alone (a SplitMix64 stream seeded with the id), so equal ids give equal tokens and
//! therefore equal blocks at every block size dividing 512, and different ids give different
//! tokens. A prompt is its ids' tokens, in order, cut to `input_length`.
//!
//! A request whose `input_length` exceeds what its ids give (512 × `hash_ids.len()`) is cut to
//! the ids' tokens rather than refused: real traces round lengths loosely, and padding with
//! made-up tokens would invent blocks no other request can share. [`count_truncated`] says how
//! many requests that affects. A prompt that ends up empty is an error.

use crate::trace::{TraceError, TraceReader, TraceRequest};
use std::path::Path;
use std::time::Duration;
use thiserror::Error;

/// Tokens each trace hash id stands for.
pub const TOKENS_PER_HASH_ID: usize = 512;

/// Token ids are drawn from `1..=VOCAB_SIZE`.
pub const VOCAB_SIZE: u32 = 32_000;

/// One request of the replay.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplayRequest {
    /// Position in the trace.
    pub index: usize,
    /// Simulated arrival, from the trace's first timestamp, divided by the rate scale.
    pub arrival: Duration,
    pub tokens: Vec<u32>,
    pub output_tokens: u32,
}

#[derive(Debug, Error)]
pub enum ReplayError {
    #[error("rate scale must be a finite number above 0, got {0}")]
    InvalidRateScale(f64),
    #[error("trace request {index} has input_length 0")]
    EmptyInput { index: usize },
    #[error("trace request {index} has input_length {input_length} but no hash_ids")]
    NoHashIds { index: usize, input_length: u64 },
    #[error("trace request {index}: output_length {output_length} does not fit in 32 bits")]
    OutputTooLong { index: usize, output_length: u64 },
    #[error("the trace has no requests")]
    EmptyTrace,
    #[error(transparent)]
    Trace(#[from] TraceError),
}

/// Reads a trace, keeping at most `limit` requests (all with `None`). Stops reading once the
/// limit is reached, so a malformed line after it is not reported.
pub fn load_trace(path: &Path, limit: Option<usize>) -> Result<Vec<TraceRequest>, ReplayError> {
    let reader = TraceReader::open(path)?;
    let trace: Vec<TraceRequest> = match limit {
        Some(n) => reader.take(n).collect::<Result<_, _>>()?,
        None => reader.collect::<Result<_, _>>()?,
    };
    if trace.is_empty() {
        return Err(ReplayError::EmptyTrace);
    }
    Ok(trace)
}

/// The prompts of a trace, in trace order. Request `i` arrives at
/// `(timestamp_i − first timestamp) / rate_scale` ms of simulated time (a timestamp earlier than
/// the first one counts as 0). `rate_scale` 2 replays twice as fast as recorded.
pub fn build_requests(
    trace: &[TraceRequest],
    rate_scale: f64,
) -> Result<Vec<ReplayRequest>, ReplayError> {
    if !rate_scale.is_finite() || rate_scale <= 0.0 {
        return Err(ReplayError::InvalidRateScale(rate_scale));
    }
    let Some(first) = trace.first() else {
        return Ok(Vec::new());
    };
    let t0 = first.timestamp;
    let mut out = Vec::with_capacity(trace.len());
    for (index, rec) in trace.iter().enumerate() {
        if rec.input_length == 0 {
            return Err(ReplayError::EmptyInput { index });
        }
        if rec.hash_ids.is_empty() {
            return Err(ReplayError::NoHashIds {
                index,
                input_length: rec.input_length,
            });
        }
        let output_tokens =
            u32::try_from(rec.output_length).map_err(|_| ReplayError::OutputTooLong {
                index,
                output_length: rec.output_length,
            })?;
        let available = TOKENS_PER_HASH_ID as u64 * rec.hash_ids.len() as u64;
        let len = rec.input_length.min(available) as usize;
        let mut tokens = Vec::with_capacity(len);
        for &id in &rec.hash_ids {
            let want = (len - tokens.len()).min(TOKENS_PER_HASH_ID);
            if want == 0 {
                break;
            }
            push_id_tokens(id, want, &mut tokens);
        }
        let ms = rec.timestamp.saturating_sub(t0) as f64 / rate_scale;
        out.push(ReplayRequest {
            index,
            arrival: Duration::from_secs_f64(ms / 1000.0),
            tokens,
            output_tokens,
        });
    }
    Ok(out)
}

/// How many requests [`build_requests`] cuts because their `input_length` exceeds
/// 512 × `hash_ids.len()`.
pub fn count_truncated(trace: &[TraceRequest]) -> usize {
    trace
        .iter()
        .filter(|r| r.input_length > TOKENS_PER_HASH_ID as u64 * r.hash_ids.len() as u64)
        .count()
}

/// The 512 tokens hash id `id` stands for.
pub fn id_tokens(id: u64) -> Vec<u32> {
    let mut out = Vec::with_capacity(TOKENS_PER_HASH_ID);
    push_id_tokens(id, TOKENS_PER_HASH_ID, &mut out);
    out
}

/// Appends the first `n` (≤ 512) tokens of hash id `id`.
fn push_id_tokens(id: u64, n: usize, out: &mut Vec<u32>) {
    // SplitMix64 seeded with the id. Two ids' streams are the same full-period sequence at
    // different offsets; they overlap within 512 tokens only when the ids differ by k × the
    // increment (mod 2^64) with |k| < 512, huge numbers that small trace ids never differ by.
    let mut state = id;
    for _ in 0..n.min(TOKENS_PER_HASH_ID) {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        out.push((z % VOCAB_SIZE as u64) as u32 + 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(timestamp: u64, input_length: u64, hash_ids: &[u64]) -> TraceRequest {
        TraceRequest {
            timestamp,
            input_length,
            output_length: 7,
            hash_ids: hash_ids.to_vec(),
        }
    }

    #[test]
    fn tokens_follow_ids() {
        let reqs = build_requests(
            &[
                rec(10, 1024, &[1, 2]),
                rec(20, 700, &[1, 3]),
                rec(30, 512, &[2]),
            ],
            1.0,
        )
        .unwrap();
        assert_eq!(reqs[0].tokens.len(), 1024);
        assert_eq!(reqs[1].tokens.len(), 700);
        assert_eq!(reqs[0].tokens[..512], reqs[1].tokens[..512]);
        assert_ne!(reqs[0].tokens[512..700], reqs[1].tokens[512..700]);
        assert_eq!(reqs[0].tokens[512..], reqs[2].tokens[..]);
        assert!(reqs[0]
            .tokens
            .iter()
            .all(|&t| (1..=VOCAB_SIZE).contains(&t)));
        assert_eq!(reqs[1].output_tokens, 7);
        assert_eq!(reqs[1].index, 1);
    }

    #[test]
    fn arrivals_are_relative_and_scaled() {
        let reqs = build_requests(
            &[rec(1000, 1, &[1]), rec(1500, 1, &[1]), rec(3000, 1, &[1])],
            2.0,
        )
        .unwrap();
        let ms: Vec<u128> = reqs.iter().map(|r| r.arrival.as_millis()).collect();
        assert_eq!(ms, vec![0, 250, 1000]);
    }

    #[test]
    fn bad_input_is_a_typed_error() {
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(matches!(
                build_requests(&[rec(0, 1, &[1])], bad),
                Err(ReplayError::InvalidRateScale(_))
            ));
        }
        assert!(matches!(
            build_requests(&[rec(0, 1, &[1]), rec(0, 0, &[1])], 1.0),
            Err(ReplayError::EmptyInput { index: 1 })
        ));
        assert!(matches!(
            build_requests(&[rec(0, 5, &[])], 1.0),
            Err(ReplayError::NoHashIds { index: 0, .. })
        ));
    }

    #[test]
    fn long_inputs_are_cut_and_counted() {
        let trace = [rec(0, 2000, &[1, 2]), rec(0, 1024, &[1, 2])];
        let reqs = build_requests(&trace, 1.0).unwrap();
        assert_eq!(reqs[0].tokens.len(), 1024);
        assert_eq!(reqs[0].tokens, reqs[1].tokens);
        assert_eq!(count_truncated(&trace), 1);
    }
}

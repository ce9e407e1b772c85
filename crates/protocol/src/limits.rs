//! How large a caller's input may be: every size a route request (or an update naming a
//! request) carries is bounded here, in one place, so that no peer can make a replica hold,
//! copy to its peers or scan more than these allow.
//!
//! Replicas check every request as it enters (bus endpoints and the JSON API) and answer an
//! oversize one with an `invalid_request` error (HTTP 400) naming the field, its size and
//! the limit; a frontend calls the same checks before it routes
//! ([`RouteRequest::check_limits`]). docs/operations.md, "Limits", lists them.

use crate::messages::{
    Abandon, DisaggRouteRequest, OutputBlock, OverlapRequest, RequestUpdate, RouteRequest,
};
use crate::types::PromptExtras;
use thiserror::Error;

/// Longest request id, in bytes (UTF-8). A replica keeps each booked id (twice with
/// replica sync, plus once per peer) for up to the request timeout; 256 bytes fits a uuid
/// with any prefix a caller adds.
pub const MAX_REQUEST_ID_BYTES: usize = 256;

/// Longest model name, in bytes. Hugging Face names (`org/name`) are far shorter.
pub const MAX_MODEL_NAME_BYTES: usize = 256;

/// Longest LoRA adapter name, in bytes.
pub const MAX_LORA_NAME_BYTES: usize = 256;

/// Longest replica id a caller may name (`Abandon::kept_by`, a JSON update's `replica_id`).
pub const MAX_REPLICA_ID_BYTES: usize = 256;

/// Most entries in `allowed_workers`, and (separately) in `excluded_workers`. A fleet of
/// more workers than this per model is not something one request needs to enumerate.
pub const MAX_WORKER_LIST_LEN: usize = 4096;

/// Longest extra key of a block (a multimodal identifier) and longest cache salt, in bytes.
pub const MAX_EXTRA_KEY_BYTES: usize = 1024;

/// Most extra keys in a request, over all its blocks.
pub const MAX_EXTRA_KEYS: usize = 16_384;

/// Most bytes of extra keys (and cache salt) in a request, over all its blocks.
pub const MAX_EXTRAS_BYTES: usize = 256 * 1024;

/// Most output tokens a request may expect (`expected_output_tokens`): a replica counts at
/// most this many (2^20, past the longest context any engine serves today); larger values
/// are clamped, not refused. A replica also clamps the blocks they fill to the chosen rank's
/// registered KV capacity, which no single request can outgrow.
pub const MAX_EXPECTED_OUTPUT_TOKENS: u32 = 1 << 20;

/// Most fallbacks a route decision carries (`RouteRequest::fallbacks`): more asked for are
/// clamped to it. A gateway tries few endpoints before it gives up.
pub const MAX_FALLBACKS: u8 = 8;

/// Default of a replica's `--max-priority-jump-secs`: a `priority_jump` above it counts as
/// this much. Far longer than any request may wait in the queue (`--max-queue-wait-ms`).
pub const DEFAULT_MAX_PRIORITY_JUMP_SECS: f64 = 60.0;

/// An input over one of the limits above. Messages name the field, its size and the limit,
/// for a client to show as they are.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum LimitError {
    /// A string field is longer than its limit.
    #[error("{field} is {len} bytes long, over the limit of {limit} bytes")]
    TooLong {
        field: &'static str,
        len: usize,
        limit: usize,
    },
    /// A list has more entries than its limit.
    #[error("{field} has {len} entries, over the limit of {limit}")]
    TooMany {
        field: &'static str,
        len: usize,
        limit: usize,
    },
}

impl LimitError {
    /// The field over its limit (as the JSON API names it).
    pub fn field(&self) -> &'static str {
        match self {
            Self::TooLong { field, .. } | Self::TooMany { field, .. } => field,
        }
    }
}

/// `s` is at most `limit` bytes long.
pub fn check_len(field: &'static str, s: &str, limit: usize) -> Result<(), LimitError> {
    if s.len() > limit {
        return Err(LimitError::TooLong {
            field,
            len: s.len(),
            limit,
        });
    }
    Ok(())
}

/// `len` entries are at most `limit`.
pub fn check_count(field: &'static str, len: usize, limit: usize) -> Result<(), LimitError> {
    if len > limit {
        return Err(LimitError::TooMany { field, len, limit });
    }
    Ok(())
}

/// A request id within [`MAX_REQUEST_ID_BYTES`] (what `prefill_done`, `free`,
/// `output_block` and the JSON API's paths take).
pub fn check_request_id(request_id: &str) -> Result<(), LimitError> {
    check_len("request_id", request_id, MAX_REQUEST_ID_BYTES)
}

/// The id a replica tracks a disaggregated request's prefill half by ends with this
/// ([`crate::prefill_request_id`]).
const PREFILL_SUFFIX: &str = "/prefill";

/// A request id as updates name it (`mark_prefill`, `free`, `add_output_block`, `abandon`
/// and the JSON API's paths): within [`MAX_REQUEST_ID_BYTES`], or that plus `/prefill` for
/// a disaggregated request's prefill half.
pub fn check_tracked_request_id(request_id: &str) -> Result<(), LimitError> {
    let limit = match request_id.ends_with(PREFILL_SUFFIX) {
        true => MAX_REQUEST_ID_BYTES + PREFILL_SUFFIX.len(),
        false => MAX_REQUEST_ID_BYTES,
    };
    check_len("request_id", request_id, limit)
}

/// A model name within [`MAX_MODEL_NAME_BYTES`].
pub fn check_model(model: &str) -> Result<(), LimitError> {
    check_len("model", model, MAX_MODEL_NAME_BYTES)
}

fn check_lora(lora: Option<&str>) -> Result<(), LimitError> {
    lora.map_or(Ok(()), |l| check_len("lora", l, MAX_LORA_NAME_BYTES))
}

fn check_allowed(allowed: Option<&[u64]>) -> Result<(), LimitError> {
    allowed.map_or(Ok(()), |a| {
        check_count("allowed_workers", a.len(), MAX_WORKER_LIST_LEN)
    })
}

impl PromptExtras {
    /// Every key and the salt within [`MAX_EXTRA_KEY_BYTES`], at most [`MAX_EXTRA_KEYS`]
    /// keys and [`MAX_EXTRAS_BYTES`] in all, and no more blocks named than `max_blocks` (a
    /// prompt of `n` tokens has at most `n` blocks).
    pub fn check_limits(&self, max_blocks: usize) -> Result<(), LimitError> {
        check_count("block_extras", self.block_extras.len(), max_blocks)?;
        let mut keys = 0usize;
        let mut bytes = 0usize;
        if let Some(salt) = &self.cache_salt {
            check_len("cache_salt", salt, MAX_EXTRA_KEY_BYTES)?;
            bytes = salt.len();
        }
        for block in &self.block_extras {
            keys = keys.saturating_add(block.len());
            check_count("block_extras keys", keys, MAX_EXTRA_KEYS)?;
            for key in block {
                check_len("block_extras key", key, MAX_EXTRA_KEY_BYTES)?;
                bytes = bytes.saturating_add(key.len());
            }
            check_len_total(bytes)?;
        }
        check_len_total(bytes)
    }
}

fn check_len_total(bytes: usize) -> Result<(), LimitError> {
    if bytes > MAX_EXTRAS_BYTES {
        return Err(LimitError::TooLong {
            field: "block_extras and cache_salt together",
            len: bytes,
            limit: MAX_EXTRAS_BYTES,
        });
    }
    Ok(())
}

impl RouteRequest {
    /// Checks every size the request carries against this module's limits: model, request
    /// id and LoRA name lengths, `allowed_workers` and `excluded_workers` entries, extra keys
    /// and salt. The prompt's length is the replica's own limit (`--max-prompt-tokens`), and
    /// numeric hints are clamped where they are used, so neither is checked here.
    ///
    /// ```
    /// # use kvrouter_protocol::{RouteRequest, limits::{LimitError, MAX_REQUEST_ID_BYTES}};
    /// let ok = RouteRequest::new("m", vec![1, 2, 3]).booked("req-1");
    /// assert!(ok.check_limits().is_ok());
    /// let long = RouteRequest::new("m", vec![1]).booked("x".repeat(MAX_REQUEST_ID_BYTES + 1));
    /// assert!(matches!(long.check_limits(), Err(LimitError::TooLong { field: "request_id", .. })));
    /// ```
    pub fn check_limits(&self) -> Result<(), LimitError> {
        check_model(&self.model)?;
        check_request_id(&self.request_id)?;
        check_lora(self.lora.as_deref())?;
        check_allowed(self.allowed_workers.as_deref())?;
        check_count(
            "excluded_workers",
            self.excluded_workers.len(),
            MAX_WORKER_LIST_LEN,
        )?;
        if let Some(extras) = &self.extras {
            extras.check_limits(self.tokens.len())?;
        }
        Ok(())
    }
}

impl DisaggRouteRequest {
    /// As [`RouteRequest::check_limits`]; the prefill half's id (`{request_id}/prefill`)
    /// may be 8 bytes longer than the limit.
    pub fn check_limits(&self) -> Result<(), LimitError> {
        check_model(&self.model)?;
        check_request_id(&self.request_id)?;
        check_lora(self.lora.as_deref())?;
        check_allowed(self.allowed_workers.as_deref())
    }
}

impl OverlapRequest {
    /// Model and LoRA name lengths.
    pub fn check_limits(&self) -> Result<(), LimitError> {
        check_model(&self.model)?;
        check_lora(self.lora.as_deref())
    }
}

impl RequestUpdate {
    /// Model name and request id lengths (see [`check_tracked_request_id`]).
    pub fn check_limits(&self) -> Result<(), LimitError> {
        check_model(&self.model)?;
        check_tracked_request_id(&self.request_id)
    }
}

impl OutputBlock {
    /// Model name and request id lengths (see [`check_tracked_request_id`]).
    pub fn check_limits(&self) -> Result<(), LimitError> {
        check_model(&self.model)?;
        check_tracked_request_id(&self.request_id)
    }
}

impl Abandon {
    /// Model name, request id and replica id lengths.
    pub fn check_limits(&self) -> Result<(), LimitError> {
        check_model(&self.model)?;
        check_tracked_request_id(&self.request_id)?;
        self.kept_by
            .as_deref()
            .map_or(Ok(()), |r| check_len("kept_by", r, MAX_REPLICA_ID_BYTES))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn long(n: usize) -> String {
        "x".repeat(n)
    }

    #[test]
    fn every_limit_is_inclusive_and_named() {
        let at = RouteRequest::new(long(MAX_MODEL_NAME_BYTES), vec![1; 4])
            .booked(long(MAX_REQUEST_ID_BYTES))
            .with_lora(long(MAX_LORA_NAME_BYTES))
            .with_allowed_workers((0..MAX_WORKER_LIST_LEN as u64).collect::<Vec<_>>())
            .with_excluded_workers((0..MAX_WORKER_LIST_LEN as u64).collect())
            .with_extras(PromptExtras {
                block_extras: vec![vec![long(MAX_EXTRA_KEY_BYTES)]; 4],
                cache_salt: Some(long(MAX_EXTRA_KEY_BYTES)),
            });
        assert_eq!(at.check_limits(), Ok(()));
        let over: Vec<(RouteRequest, &str)> = vec![
            (
                RouteRequest {
                    model: long(MAX_MODEL_NAME_BYTES + 1),
                    ..at.clone()
                },
                "model",
            ),
            (
                at.clone().with_request_id(long(MAX_REQUEST_ID_BYTES + 1)),
                "request_id",
            ),
            (at.clone().with_lora(long(MAX_LORA_NAME_BYTES + 1)), "lora"),
            (
                at.clone()
                    .with_allowed_workers(vec![7; MAX_WORKER_LIST_LEN + 1]),
                "allowed_workers",
            ),
            (
                at.clone()
                    .with_excluded_workers(vec![7; MAX_WORKER_LIST_LEN + 1]),
                "excluded_workers",
            ),
            (
                at.clone().with_extras(PromptExtras {
                    block_extras: vec![Vec::new(); 5],
                    cache_salt: None,
                }),
                "block_extras",
            ),
            (
                at.clone().with_extras(PromptExtras {
                    block_extras: Vec::new(),
                    cache_salt: Some(long(MAX_EXTRA_KEY_BYTES + 1)),
                }),
                "cache_salt",
            ),
            (
                at.clone().with_extras(PromptExtras {
                    block_extras: vec![vec![long(MAX_EXTRA_KEY_BYTES + 1)]],
                    cache_salt: None,
                }),
                "block_extras key",
            ),
        ];
        for (req, field) in over {
            let e = req.check_limits().unwrap_err();
            assert_eq!(e.field(), field, "{e}");
            assert!(e.to_string().starts_with(field), "{e}");
        }
    }

    #[test]
    fn extras_are_bounded_in_count_and_bytes() {
        let many = PromptExtras {
            block_extras: vec![vec![String::new(); 64]; 300],
            cache_salt: None,
        };
        let e = many.check_limits(1000).unwrap_err();
        assert_eq!(
            e,
            LimitError::TooMany {
                field: "block_extras keys",
                len: MAX_EXTRA_KEYS + 64 - MAX_EXTRA_KEYS % 64,
                limit: MAX_EXTRA_KEYS
            }
        );
        let heavy = PromptExtras {
            block_extras: vec![vec![long(MAX_EXTRA_KEY_BYTES)]; 300],
            cache_salt: None,
        };
        let e = heavy.check_limits(1000).unwrap_err();
        assert_eq!(e.field(), "block_extras and cache_salt together");
        assert!(e.to_string().contains(&MAX_EXTRAS_BYTES.to_string()), "{e}");
    }

    #[test]
    fn updates_and_other_requests_check_their_ids() {
        let id = long(MAX_REQUEST_ID_BYTES + 1);
        let update = RequestUpdate {
            model: "m".into(),
            request_id: id.clone(),
            lease: crate::Lease::NONE,
        };
        assert_eq!(update.check_limits().unwrap_err().field(), "request_id");
        let block = OutputBlock {
            model: "m".into(),
            request_id: id.clone(),
            decay_fraction: None,
            lease: crate::Lease::NONE,
        };
        assert_eq!(block.check_limits().unwrap_err().field(), "request_id");
        let abandon = Abandon {
            model: "m".into(),
            request_id: "r".into(),
            call_id: 1,
            kept_by: Some(long(MAX_REPLICA_ID_BYTES + 1)),
            lease: crate::Lease::NONE,
        };
        assert_eq!(abandon.check_limits().unwrap_err().field(), "kept_by");
        let disagg = DisaggRouteRequest {
            model: long(MAX_MODEL_NAME_BYTES + 1),
            request_id: "r".into(),
            tokens: vec![1],
            lora: None,
            allowed_workers: None,
            update_states: true,
            lease: crate::Lease::NONE,
            trace: None,
        };
        assert_eq!(disagg.check_limits().unwrap_err().field(), "model");
        let overlap = OverlapRequest {
            model: "m".into(),
            tokens: vec![1],
            lora: Some(long(MAX_LORA_NAME_BYTES + 1)),
        };
        assert_eq!(overlap.check_limits().unwrap_err().field(), "lora");
        assert_eq!(check_request_id(&long(MAX_REQUEST_ID_BYTES)), Ok(()));
        // A prefill half of the longest id may be freed.
        let half = crate::prefill_request_id(&long(MAX_REQUEST_ID_BYTES));
        assert_eq!(check_tracked_request_id(&half), Ok(()));
        assert!(check_request_id(&half).is_err());
        let update = RequestUpdate {
            model: "m".into(),
            request_id: half,
            lease: crate::Lease::NONE,
        };
        assert_eq!(update.check_limits(), Ok(()));
        let longer = format!("{}x/prefill", long(MAX_REQUEST_ID_BYTES));
        assert!(check_tracked_request_id(&longer).is_err());
    }
}

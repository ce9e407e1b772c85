//! A request to place: prompt, block hashes and the filters narrowing where it may go.

use crate::filters::FilterView;
use kvrouter_protocol::{Lease, RouteOverrides, SequenceHash, TierBlocks, WorkerKey};

/// A request to place.
#[derive(Copy, Clone, Debug, Default, PartialEq)]
pub struct RouteQuery<'a> {
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Sequence hashes of the prompt's full blocks.
    pub sequence_hashes: &'a [SequenceHash],
    /// Where it may go: allowed and excluded workers, a pinned worker or key, allowed keys.
    pub filters: FilterView<'a>,
    /// This request's own cost settings (each `None`: the scheduler's).
    pub overrides: RouteOverrides,
    /// Keys whose cached prefix a lower tier (host, disk, shared storage) extends, by tier
    /// (the index's `OverlapScores::tiers`).
    pub lower_tiers: &'a [(WorkerKey, TierBlocks)],
    /// The shared-storage overlap of a key in neither overlap list.
    pub shared_blocks: u32,
    /// Seconds the request counts as having waited already if it must queue (see the
    /// scheduler's queue policy).
    pub priority_jump: f64,
    /// Output tokens the caller expects: their blocks count in the chosen key's decode load
    /// from the start.
    pub expected_output_tokens: Option<u32>,
    /// The lease a booking is held under ([`Lease::NONE`]: none; any caller may end it).
    pub lease: Lease,
    /// Next-best workers wanted beside the choice ([`crate::Selection::fallbacks`]).
    pub fallbacks: u8,
}

impl<'a> RouteQuery<'a> {
    /// An unfiltered query.
    pub fn new(prompt_tokens: usize, sequence_hashes: &'a [SequenceHash]) -> Self {
        Self {
            prompt_tokens,
            sequence_hashes,
            ..Self::default()
        }
    }

    /// The query with these filters (in place of its own).
    pub fn with_filters(self, filters: FilterView<'a>) -> Self {
        Self { filters, ..self }
    }

    /// True if any filter (allowed, excluded or pinned workers, allowed or pinned keys) is
    /// set.
    pub fn is_filtered(&self) -> bool {
        self.filters.is_filtered()
    }
}

//! A request to place: prompt, block hashes and the filters narrowing where it may go.

use crate::filters::FilterView;
use kvrouter_protocol::{RouteOverrides, SequenceHash, TierBlocks, WorkerId, WorkerKey};

/// A request to place. Its five filter fields are one [`crate::RouteFilters`] borrowed
/// ([`RouteQuery::filters`], [`RouteQuery::with_filters`]); they stay plain fields so a
/// test or a caller can set one filter alone.
#[derive(Copy, Clone, Debug, Default, PartialEq)]
pub struct RouteQuery<'a> {
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Sequence hashes of the prompt's full blocks.
    pub sequence_hashes: &'a [SequenceHash],
    /// Only these workers may serve it (None: any).
    pub allowed_workers: Option<&'a [WorkerId]>,
    /// Only this worker key may serve it.
    pub pinned: Option<WorkerKey>,
    /// Only this worker (any of its ranks) may serve it.
    pub pinned_worker: Option<WorkerId>,
    /// Only these worker keys may serve it (None: any), on top of the other filters (e.g.
    /// the decode ranks a disaggregated request may go to).
    pub allowed_keys: Option<&'a [WorkerKey]>,
    /// Never these workers, whatever the other filters allow.
    pub excluded_workers: &'a [WorkerId],
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
    pub fn with_filters(self, f: FilterView<'a>) -> Self {
        Self {
            allowed_workers: f.allowed_workers,
            excluded_workers: f.excluded_workers,
            pinned: f.pinned,
            pinned_worker: f.pinned_worker,
            allowed_keys: f.allowed_keys,
            ..self
        }
    }

    /// The query's filters.
    pub fn filters(&self) -> FilterView<'a> {
        FilterView {
            allowed_workers: self.allowed_workers,
            excluded_workers: self.excluded_workers,
            pinned: self.pinned,
            pinned_worker: self.pinned_worker,
            allowed_keys: self.allowed_keys,
        }
    }

    /// True if any filter (allowed, excluded or pinned workers, allowed or pinned keys) is
    /// set.
    pub fn is_filtered(&self) -> bool {
        self.filters().is_filtered()
    }
}

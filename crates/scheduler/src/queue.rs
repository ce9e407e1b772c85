//! The bounded queue of requests that found every candidate busy, in retry order.

use crate::active::RequestId;
use crate::error::ScheduleError;
use crate::filters::RouteFilters;
use crate::route_query::RouteQuery;
use kvrouter_protocol::{Lease, RouteOverrides, SequenceHash, TierBlocks, WorkerKey};
use std::collections::VecDeque;
use std::time::Instant;

/// A request waiting for a worker key to stop being busy. Owns everything needed to route
/// it later, plus the caller's opaque `token` (e.g. the reply port).
#[derive(Clone, Debug)]
pub struct Queued<P> {
    pub request_id: RequestId,
    pub prompt_tokens: usize,
    pub sequence_hashes: Vec<SequenceHash>,
    /// Where it may go.
    pub filters: RouteFilters,
    pub overrides: RouteOverrides,
    /// Sparse overlaps (keys with overlap > 0) as seen when the request arrived.
    pub overlaps: Vec<(WorkerKey, u32)>,
    /// Lower-tier overlaps as seen when the request arrived (see [`RouteQuery`]).
    pub lower_tiers: Vec<(WorkerKey, TierBlocks)>,
    pub shared_blocks: u32,
    pub update_states: bool,
    /// Seconds the request counts as having waited already (see [`RouteQuery`]).
    pub priority_jump: f64,
    pub expected_output_tokens: Option<u32>,
    /// The lease its booking will be held under (see [`RouteQuery`]).
    pub lease: Lease,
    /// Fallbacks wanted (see [`RouteQuery`]).
    pub fallbacks: u8,
    pub enqueued_at: Instant,
    /// Retry order: lower first, ties in arrival order (set by the scheduler's queue policy).
    pub order: f64,
    pub token: P,
}

impl<P> Queued<P> {
    /// Captures a query the scheduler answered with `AllBusy`.
    pub fn new(
        query: &RouteQuery<'_>,
        overlaps: &[(WorkerKey, u32)],
        request_id: RequestId,
        update_states: bool,
        enqueued_at: Instant,
        token: P,
    ) -> Self {
        Self {
            request_id,
            prompt_tokens: query.prompt_tokens,
            sequence_hashes: query.sequence_hashes.to_vec(),
            filters: query.filters.to_filters(),
            overrides: query.overrides,
            overlaps: overlaps.to_vec(),
            lower_tiers: query.lower_tiers.to_vec(),
            shared_blocks: query.shared_blocks,
            update_states,
            priority_jump: query.priority_jump,
            expected_output_tokens: query.expected_output_tokens,
            lease: query.lease,
            fallbacks: query.fallbacks,
            enqueued_at,
            order: 0.0,
            token,
        }
    }

    /// The request as a query.
    pub fn query(&self) -> RouteQuery<'_> {
        RouteQuery {
            prompt_tokens: self.prompt_tokens,
            sequence_hashes: &self.sequence_hashes,
            overrides: self.overrides,
            lower_tiers: &self.lower_tiers,
            shared_blocks: self.shared_blocks,
            priority_jump: self.priority_jump,
            expected_output_tokens: self.expected_output_tokens,
            lease: self.lease,
            fallbacks: self.fallbacks,
            ..RouteQuery::default()
        }
        .with_filters(self.filters.view())
    }
}

/// The queue was full: the request comes back (boxed: this is the rare path) so the
/// caller can answer it.
#[derive(Clone, Debug)]
pub struct Overloaded<P> {
    pub request: Box<Queued<P>>,
    /// Requests in the queue.
    pub queued: usize,
    /// The queue's bound.
    pub max: usize,
}

impl<P> Overloaded<P> {
    /// The error to answer the request with.
    pub fn error(&self) -> ScheduleError {
        ScheduleError::Overloaded {
            queued: self.queued,
            max: self.max,
        }
    }

    /// The caller's token back.
    pub fn into_token(self) -> P {
        self.request.token
    }
}

/// Bounded, kept in retry order ([`Queued::order`], then arrival).
#[derive(Debug)]
pub(crate) struct RequestQueue<P> {
    items: VecDeque<Queued<P>>,
    max: usize,
}

impl<P> RequestQueue<P> {
    pub fn new(max: usize) -> Self {
        Self {
            items: VecDeque::new(),
            max,
        }
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Inserts a request after every one of lower or equal order, unless the queue holds
    /// `max` already.
    pub fn push(&mut self, request: Queued<P>) -> Result<(), Overloaded<P>> {
        if self.items.len() >= self.max {
            return Err(Overloaded {
                request: Box::new(request),
                queued: self.items.len(),
                max: self.max,
            });
        }
        let at = self.items.partition_point(|q| q.order <= request.order);
        self.items.insert(at, request);
        Ok(())
    }

    pub fn pop_front(&mut self) -> Option<Queued<P>> {
        self.items.pop_front()
    }

    /// Puts a request popped during a retry pass back at the end (a pass over `len()`
    /// requests that requeues the busy ones keeps their order). Not bounded: the request
    /// was already counted.
    pub fn requeue(&mut self, request: Queued<P>) {
        self.items.push_back(request);
    }

    pub fn drain(&mut self) -> impl Iterator<Item = Queued<P>> + '_ {
        self.items.drain(..)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(id: &str, t: Instant) -> Queued<u32> {
        let hashes = [SequenceHash(1)];
        let query = RouteQuery::new(10, &hashes);
        Queued::new(&query, &[(WorkerKey::new(1, 0), 1)], id.into(), true, t, 7)
    }

    #[test]
    fn bounded_fifo() {
        let now = Instant::now();
        let mut queue = RequestQueue::new(2);
        queue.push(q("a", now)).unwrap();
        queue.push(q("b", now)).unwrap();
        let over = queue.push(q("c", now)).unwrap_err();
        assert_eq!(
            over.error(),
            ScheduleError::Overloaded { queued: 2, max: 2 }
        );
        assert_eq!(
            over.error().to_string(),
            "overloaded: 2 requests queued, max 2"
        );
        assert_eq!(over.request.request_id, "c");
        assert_eq!(over.into_token(), 7);

        // A retry pass keeping "b" only.
        let a = queue.pop_front().unwrap();
        assert_eq!(a.request_id, "a");
        assert_eq!(a.query().sequence_hashes, &[SequenceHash(1)]);
        let b = queue.pop_front().unwrap();
        queue.requeue(b);
        queue.push(q("d", now)).unwrap();
        let order: Vec<_> = queue.drain().map(|r| r.request_id).collect();
        assert_eq!(order, ["b", "d"]);
        assert_eq!(queue.len(), 0);
    }

    #[test]
    fn lower_order_first_then_arrival() {
        let now = Instant::now();
        let mut queue = RequestQueue::new(8);
        for (id, order) in [("a", 5.0), ("b", 1.0), ("c", 5.0), ("d", 0.0), ("e", 1.0)] {
            let mut r = q(id, now);
            r.order = order;
            queue.push(r).unwrap();
        }
        let order: Vec<_> = queue.drain().map(|r| r.request_id).collect();
        assert_eq!(order, ["d", "b", "e", "a", "c"]);
    }

    #[test]
    fn zero_bound_rejects_everything() {
        let mut queue = RequestQueue::new(0);
        assert!(queue.push(q("a", Instant::now())).is_err());
        assert_eq!(queue.len(), 0);
    }
}

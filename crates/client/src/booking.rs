//! What a booked route gives its caller.

use kvrouter_protocol::{Lease, RouteDecision};

/// A request booked as active load (`update_states`): the replica that counts it, and the
/// lease that lets its holder (only) mark its prefill done, add output blocks and free it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Booking {
    pub replica_id: String,
    pub model: String,
    pub request_id: String,
    pub lease: Lease,
}

impl Booking {
    /// The booking a decision for `request_id` of `model` made.
    pub fn new(decision: &RouteDecision, model: &str, request_id: &str) -> Self {
        Self {
            replica_id: decision.replica_id.clone(),
            model: model.to_string(),
            request_id: request_id.to_string(),
            lease: decision.lease,
        }
    }
}

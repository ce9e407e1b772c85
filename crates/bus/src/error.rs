//! The one error type of the bus, shared by both implementations.

use std::time::Duration;

/// Everything that can go wrong on the bus. Messages are written for an operator: they name the
/// subject, URL, size or limit involved and, where there is one, the likely fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BusError {
    /// A request was published but no subscriber matched its subject.
    #[error(
        "no responders on subject '{subject}': nobody is subscribed to it \
         (is the service that answers it running and connected to the same bus?)"
    )]
    NoResponders { subject: String },

    /// A request (or the next message of a streamed reply) did not arrive in time.
    #[error(
        "timed out after {after:?} waiting for a reply on subject '{subject}' \
         (a responder is subscribed but did not answer in time: overloaded, stuck or slow)"
    )]
    Timeout { subject: String, after: Duration },

    /// The payload is larger than the bus accepts in one message; the caller must chunk it.
    #[error(
        "payload of {len} bytes exceeds the bus maximum of {max} bytes \
         (split it into smaller messages, or raise max_payload on the NATS server)"
    )]
    PayloadTooLarge { len: usize, max: usize },

    /// The initial connection failed, or the connection options are inconsistent.
    #[error("NATS connection failed: {0}")]
    Connect(String),

    /// A subject, reply subject or queue group name is malformed.
    #[error("invalid subject: {0}")]
    InvalidSubject(String),

    /// The bus (connection or in-process broker) has been closed.
    #[error("the bus is closed: the NATS connection was shut down or the in-process bus dropped")]
    Closed,

    /// A bounded publish or flush ([`Bus::publish_within`](crate::Bus::publish_within),
    /// [`Bus::flush_within`](crate::Bus::flush_within)) gave up: while NATS is disconnected a
    /// flush waits for the reconnect and a publish waits once the client's outbound queue is
    /// full, possibly for ever.
    #[error(
        "NATS did not take the {what} within {after:?}: the connection is down or its outbound \
         queue is full (is nats-server reachable?)"
    )]
    Stalled { what: String, after: Duration },

    /// Anything else, with the underlying cause.
    #[error("bus error: {0}")]
    Other(String),
}

//! A message as received from the bus.

use bytes::Bytes;

/// One message delivered to a [`Subscription`](crate::Subscription) or returned by
/// [`Bus::request`](crate::Bus::request).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// The subject the message was published to (never a wildcard).
    pub subject: String,
    /// Where the publisher expects replies, if anywhere.
    pub reply: Option<String>,
    /// The payload. An empty payload on a reply subject is the end-of-stream marker of a
    /// streamed reply (see the crate docs).
    pub payload: Bytes,
}

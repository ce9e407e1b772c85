//! The message bus: NATS and an in-process bus with the same semantics.
//!
//! [`Bus`] is one handle over two implementations: [`Bus::connect`] talks to a NATS server
//! (core NATS, no JetStream), [`Bus::local`] is an in-process broker for the demo and tests. Code
//! written against `Bus` behaves the same on both; `tests/bus_conformance.rs` checks every
//! behaviour below against each.
//!
//! # Semantics
//! - **Subjects** are `.`-separated non-empty tokens without whitespace or control characters.
//!   Subscriptions may use `*` (exactly one token) and, as the last token, `>` (one or more
//!   tokens). Publish and reply subjects may not contain wildcard tokens. Invalid subjects are
//!   rejected with [`BusError::InvalidSubject`] before anything is sent, identically on both.
//! - **Plain subscribers** each get every matching message. **Queue subscribers** sharing a group
//!   name share the messages: each message goes to exactly one member of each group.
//! - **Order**: one subscriber sees one publisher's messages in publish order.
//! - **Delivery** is at most once, with no persistence: a message published while nobody
//!   matches is dropped. A dropped [`Subscription`] stops receiving at once.
//! - **Payload limit**: a payload larger than [`Bus::max_payload`] (the NATS server's
//!   `max_payload`, 1 MiB by default; the same default for the in-process bus) is rejected with
//!   [`BusError::PayloadTooLarge`]; callers chunk.
//! - **Request/reply**: [`Bus::request`] publishes with a fresh `_INBOX.<unique>` reply subject
//!   (on NATS with an nkey `_INBOX.<public key>.<unique>`, see [`NatsOptions`])
//!   and returns the first reply. It fails with [`BusError::NoResponders`] when nobody is
//!   subscribed to the subject (NATS reports this with a status-503 message) and with
//!   [`BusError::Timeout`] when nobody answers in time. A reply with an empty payload is
//!   returned as is.
//! - **Connection** (NATS): the first connection must succeed (else [`BusError::Connect`],
//!   promptly); after that the client reconnects without limit, subscriptions survive, and
//!   [`Bus::is_connected`] tells whether the link is currently up. While it is down a flush
//!   waits for the reconnect (and a publish, once the outbound queue is full): paths that must
//!   finish, such as a shutdown, use [`Bus::flush_within`] and [`Bus::publish_within`].
//!
//! # Wire contract: streamed replies
//! A requester calls [`Bus::request_stream`]; the request is an ordinary message whose reply
//! subject is a fresh inbox. The responder publishes any number of **non-empty** messages to
//! that reply subject, in order, then **one message with an empty payload**: the end-of-stream
//! marker ([`Bus::end_stream`] sends it). Our codec never encodes a message as zero bytes, so
//! the marker is unambiguous. A responder in another language follows the same rule: publish
//! chunks to the reply subject, then an empty message. [`ReplyStream::next`] yields the
//! payloads, then `None`; it yields `Err(Timeout)` if no message arrives within the idle
//! timeout and `Err(NoResponders)` if nobody was subscribed to the request's subject.

mod bus;
mod error;
mod local;
mod message;
mod nats;
mod options;
pub mod subject;
mod subscription;

pub use bus::Bus;
pub use error::BusError;
pub use local::{LocalBus, DEFAULT_MAX_PAYLOAD};
pub use message::Message;
pub use nats::NatsBus;
pub use options::{NatsOptions, DEFAULT_NATS_URL};
pub use subscription::{ReplyStream, Subscription};

/// How long a shutdown path may spend on its final [`Bus::flush_within`] (and bounded
/// publishes): long enough for a live server, short enough that a dead one does not hold up
/// the exit.
pub const SHUTDOWN_FLUSH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

//! Encoding messages for the bus and publishing them.

use bytes::Bytes;
use kvrouter_bus::Bus;
use kvrouter_protocol::{chunk_events, encode_as, KvEvent, Wire, FORMAT_VERSION};

/// Publishes an encodable message; failures are logged (the bus is at most once anyway).
pub async fn publish_msg<T: Wire>(bus: &Bus, subject: &str, msg: &T) -> bool {
    publish_as(bus, subject, msg, FORMAT_VERSION).await
}

/// [`publish_msg`] in format `version` (an answer goes out in its request's version).
pub async fn publish_as<T: Wire>(bus: &Bus, subject: &str, msg: &T, version: u8) -> bool {
    match encode_as(msg, version) {
        Ok(bytes) => match bus.publish(subject, Bytes::from(bytes)).await {
            Ok(()) => true,
            Err(e) => {
                tracing::debug!(subject, error = %e, "publish failed");
                false
            }
        },
        Err(e) => {
            tracing::error!(subject, error = %e, "cannot encode a message");
            false
        }
    }
}

/// Encodes `events` in format `version` as one or more messages, each under `max_payload`
/// bytes and at most `max_blocks` blocks, in order. `wrap` builds the message around a slice
/// of events. A single event too large for any message is logged and left out.
pub fn encode_chunked<T: Wire>(
    events: Vec<KvEvent>,
    max_payload: usize,
    wrap: &dyn Fn(Vec<KvEvent>) -> T,
    version: u8,
) -> Vec<Bytes> {
    fn push<T: Wire>(
        events: Vec<KvEvent>,
        max_payload: usize,
        wrap: &dyn Fn(Vec<KvEvent>) -> T,
        version: u8,
        out: &mut Vec<Bytes>,
    ) {
        let n = events.len();
        let first_id = events.first().map(|e| e.event_id);
        let encoded = encode_as(&wrap(events.clone()), version);
        match encoded {
            Ok(b) if b.len() <= max_payload => out.push(Bytes::from(b)),
            _ if n > 1 => {
                // Many small events can outgrow the block budget's estimate: halve.
                let mut events = events;
                let tail = events.split_off(n / 2);
                push(events, max_payload, wrap, version, out);
                push(tail, max_payload, wrap, version, out);
            }
            other => {
                let size = other.as_ref().map(Vec::len).unwrap_or(usize::MAX);
                tracing::error!(
                    event_id = ?first_id,
                    size,
                    max_payload,
                    "a KV event is larger than the bus payload limit; dropped"
                );
            }
        }
    }
    let mut out = Vec::new();
    for chunk in chunk_events(events, max_payload) {
        push(chunk, max_payload, wrap, version, &mut out);
    }
    out
}

//! Answering a replica's state query: a rank's cache as chunks of events, then the end of
//! the stream; or one error.

use crate::publish::{encode_chunked, publish_as};
use bytes::Bytes;
use kvrouter_bus::Bus;
use kvrouter_protocol::{encode_as, EventId, KvEvent, Reply, StateChunk, Wire, WorkerKey};
use uuid::Uuid;

/// A consistent view of a rank's cache: `events` rebuild exactly the effect of events
/// `0..=last_event_id`.
pub struct Snapshot {
    pub events: Vec<KvEvent>,
    pub last_event_id: Option<EventId>,
}

/// Streams `snapshot` of rank `key` to `reply` in format `version`, chunked under the bus
/// payload limit (at least one chunk, so an empty rank still says its last event id).
pub async fn send_state(
    bus: &Bus,
    reply: &str,
    key: WorkerKey,
    instance_id: Uuid,
    snapshot: Snapshot,
    version: u8,
) {
    let last_event_id = snapshot.last_event_id;
    let wrap = |events: Vec<KvEvent>| {
        Reply::Ok(StateChunk {
            key,
            instance_id,
            last_event_id,
            events,
        })
    };
    let mut chunks = encode_chunked(snapshot.events, bus.max_payload(), &wrap, version);
    if chunks.is_empty() {
        match encode_as(&wrap(Vec::new()), version) {
            Ok(b) => chunks.push(Bytes::from(b)),
            Err(e) => tracing::error!(error = %e, "cannot encode a state chunk"),
        }
    }
    for chunk in chunks {
        if let Err(e) = bus.publish(reply, chunk).await {
            tracing::debug!(error = %e, "state reply failed");
            return;
        }
    }
    let _ = bus.end_stream(reply).await;
}

/// A single message (an error), then the end of the stream.
pub async fn send_error_stream<T: Wire>(bus: Bus, reply: String, msg: T, version: u8) {
    if publish_as(&bus, &reply, &msg, version).await {
        let _ = bus.end_stream(&reply).await;
    }
}

//! One emulated rank's ZeroMQ side, as vLLM's `ZmqEventPublisher` has it: a PUB socket
//! sending `[topic, seq (8 bytes big-endian), payload]` and a ROUTER socket that replays the
//! buffered batches from a sequence number on, ending with sequence number -1.

use bytes::Bytes;
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::Arc;
use zeromq::{PubSocket, RouterSocket, SocketRecv, SocketSend, ZmqMessage};

/// Batches kept for replay (vLLM's `buffer_steps` default).
pub const BUFFER_STEPS: usize = 10_000;
const END_SEQ: [u8; 8] = [0xff; 8];

/// What the publisher and the replay server of a rank share.
#[derive(Default)]
pub struct RankStream {
    inner: Mutex<StreamState>,
}

#[derive(Default)]
struct StreamState {
    next_seq: u64,
    buffer: VecDeque<(u64, Bytes)>,
    /// Batches still to drop (test hook): they take a sequence number and stay in the
    /// buffer, but are not sent.
    drop: u64,
    /// Every batch is dropped so while set (test hook: an engine that stops publishing).
    muted: bool,
}

impl RankStream {
    /// Numbers and buffers a batch; `Some(seq)` if it is to be sent.
    fn next(&self, payload: &Bytes) -> Option<u64> {
        let mut s = self.inner.lock();
        let seq = s.next_seq;
        s.next_seq += 1;
        if s.buffer.len() == BUFFER_STEPS {
            s.buffer.pop_front();
        }
        s.buffer.push_back((seq, payload.clone()));
        if s.muted {
            return None;
        }
        if s.drop > 0 {
            s.drop -= 1;
            return None;
        }
        Some(seq)
    }

    pub fn set_muted(&self, muted: bool) {
        self.inner.lock().muted = muted;
    }

    pub fn drop_next(&self, n: u64) {
        let mut s = self.inner.lock();
        s.drop = s.drop.saturating_add(n);
    }

    fn from(&self, start: u64) -> Vec<(u64, Bytes)> {
        let s = self.inner.lock();
        s.buffer
            .iter()
            .filter(|(q, _)| *q >= start)
            .cloned()
            .collect()
    }
}

/// Sends one batch on the rank's PUB socket (unless the drop hook takes it).
pub async fn publish(
    socket: &mut PubSocket,
    stream: &RankStream,
    topic: &Bytes,
    payload: Bytes,
) -> Result<(), zeromq::ZmqError> {
    let Some(seq) = stream.next(&payload) else {
        return Ok(());
    };
    let mut msg = ZmqMessage::from(topic.clone());
    msg.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
    msg.push_back(payload);
    socket.send(msg).await
}

/// Serves replay requests (`[identity, "", start]`) until the socket fails.
pub async fn serve_replay(mut socket: RouterSocket, stream: Arc<RankStream>) {
    loop {
        let Ok(msg) = socket.recv().await else { return };
        let frames = msg.into_vec();
        let (Some(id), Some(start)) = (frames.first(), frames.last()) else {
            continue;
        };
        let Ok(start) = <[u8; 8]>::try_from(&start[..]) else {
            continue;
        };
        let reply = |seq: [u8; 8], payload: Bytes| {
            let mut m = ZmqMessage::from(id.clone());
            m.push_back(Bytes::new());
            m.push_back(Bytes::copy_from_slice(&seq));
            m.push_back(payload);
            m
        };
        for (seq, payload) in stream.from(u64::from_be_bytes(start)) {
            if socket
                .send(reply(seq.to_be_bytes(), payload))
                .await
                .is_err()
            {
                return;
            }
        }
        if socket.send(reply(END_SEQ, Bytes::new())).await.is_err() {
            return;
        }
    }
}

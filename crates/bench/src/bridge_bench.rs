//! `kvrouter bench bridge`: what one bridge can take from a busy engine.
//!
//! - **Throughput**: a recorded stream of vLLM-style KV event payloads (msgpack, as msgspec
//!   writes them) decoded and turned into kvrouter events by the bridge's cores
//!   ([`decode_batch`] then [`WorkerMirror::apply`]) on one core: blocks per second.
//! - **Latency**: the same kind of payloads published on a real ZMQ PUB socket at a fixed
//!   rate, through a running [`Bridge`] on the in-process bus, until a consumer has applied
//!   them to an index (what a replica does): publish-to-index delay, p50/p99/max.
//!
//! The payloads are written by the mocker's vLLM emulation, the same encoder its emulated
//! engines publish with.

use crate::route_latency::LatencySummary;
use kvrouter_bridge::{decode_batch, Bridge, BridgeConfig, WorkerMirror};
use kvrouter_bus::Bus;
use kvrouter_indexer::Index;
use kvrouter_mocker::emulate::wire::{encode_batch, BlockTokens};
use kvrouter_mocker::emulate::{Emulated, ZmqWire};
use kvrouter_protocol::{
    decode, EngineBlockHash, EngineKind, KvEvent, KvEventBatch, KvEventData, LocalBlockHash,
    StoredBlock, Subjects, Tier, WorkerKey,
};
use rustc_hash::FxHashMap;
use std::time::{Duration, Instant};
use zeromq::{Socket, SocketSend, ZmqMessage};

#[derive(Debug, thiserror::Error)]
pub enum BridgeBenchError {
    #[error("stand-in engine HTTP: {0}")]
    Io(#[from] std::io::Error),
    #[error("ZMQ: {0}")]
    Zmq(#[from] zeromq::ZmqError),
    #[error(transparent)]
    Bridge(#[from] kvrouter_bridge::BridgeError),
    #[error(transparent)]
    Subject(#[from] kvrouter_protocol::SubjectError),
    #[error(transparent)]
    Bus(#[from] kvrouter_bus::BusError),
    #[error("the bridge did not connect: {0}")]
    NotConnected(String),
    #[error("{lost} of {total} batches never reached the index")]
    Lost { lost: usize, total: usize },
    #[error("the consumer task failed: {0}")]
    Join(#[from] tokio::task::JoinError),
}

/// The shape of the recorded stream.
#[derive(Clone, Debug)]
pub struct StreamShape {
    pub block_size: u32,
    /// Blocks per `BlockStored` event.
    pub blocks_per_event: usize,
    /// Events per batch (one ZMQ message).
    pub events_per_batch: usize,
    /// Blocks the rank holds at most: older chains are removed past it.
    pub capacity_blocks: usize,
    pub seed: u64,
}

impl Default for StreamShape {
    fn default() -> Self {
        Self {
            block_size: 16,
            blocks_per_event: 4,
            events_per_batch: 16,
            capacity_blocks: 100_000,
            seed: 1,
        }
    }
}

/// A recorded stream of `batches` payloads and the blocks they store, encoded by the
/// mocker's vLLM emulation (map-form events, as vLLM writes them today). Chains extend a
/// recent chain half the time (shared prefixes), start afresh otherwise; past the capacity
/// the oldest chains are removed, so the mirror stays bounded and removals are in the mix.
pub fn record_stream(shape: &StreamShape, batches: usize) -> (Vec<Vec<u8>>, u64) {
    let mut rng = fastrand::Rng::with_seed(shape.seed);
    let bs = shape.block_size as usize;
    let key = WorkerKey::new(1, 0);
    let mut next_hash = 1u64 << 40;
    let mut live: std::collections::VecDeque<Vec<u64>> = Default::default();
    let mut held = 0usize;
    let mut stored_blocks = 0u64;
    let mut tokens = BlockTokens::default();
    let mut out = Vec::with_capacity(batches);
    let mut block = vec![0u32; bs];
    let event = |data| KvEvent {
        tier: Tier::Device,
        key,
        event_id: 0,
        data,
    };
    for _ in 0..batches {
        let mut events = Vec::new();
        // Removals, when over capacity, go in the same batch before the stores.
        while held + shape.events_per_batch * shape.blocks_per_event > shape.capacity_blocks {
            let Some(chain) = live.pop_front() else { break };
            held -= chain.len();
            events.push(event(KvEventData::Removed {
                engine_hashes: chain.into_iter().map(EngineBlockHash).collect(),
            }));
        }
        for _ in 0..shape.events_per_batch {
            let parent = if rng.bool() {
                live.back().and_then(|c| c.last().copied())
            } else {
                None
            };
            let mut chain = Vec::with_capacity(shape.blocks_per_event);
            let mut blocks = Vec::with_capacity(shape.blocks_per_event);
            for _ in 0..shape.blocks_per_event {
                next_hash += 1;
                block.iter_mut().for_each(|t| *t = rng.u32(..150_000));
                tokens.insert(next_hash, &block);
                chain.push(next_hash);
                blocks.push(StoredBlock {
                    engine_hash: EngineBlockHash(next_hash),
                    // Not on the wire: the bridge computes local hashes from the tokens.
                    local_hash: LocalBlockHash(0),
                });
            }
            events.push(event(KvEventData::Stored {
                parent: parent.map(EngineBlockHash),
                blocks,
            }));
            stored_blocks += chain.len() as u64;
            held += chain.len();
            live.push_back(chain);
        }
        out.push(encode_batch(
            Emulated::Vllm,
            ZmqWire::ArrayBatch,
            1.7e9,
            0,
            &events,
            shape.block_size,
            &mut tokens,
        ));
    }
    (out, stored_blocks)
}

/// One throughput run: every payload decoded and applied to a fresh mirror, on this thread.
/// Returns the blocks stored and how long it took.
pub fn throughput_run(stream: &[Vec<u8>], shape: &StreamShape) -> (u64, Duration) {
    let mut mirror = WorkerMirror::new(1, 0, 1, shape.block_size, shape.capacity_blocks as u64 * 2);
    let mut blocks = 0u64;
    let t = Instant::now();
    for payload in stream {
        let batch = decode_batch(payload).expect("the recorded stream decodes");
        let out = mirror.apply(0, &batch.events).expect("rank 0");
        blocks += out
            .iter()
            .map(|e| match &e.data {
                KvEventData::Stored { blocks, .. } => blocks.len() as u64,
                _ => 0,
            })
            .sum::<u64>();
    }
    (blocks, t.elapsed())
}

/// Answers every HTTP request with 200 and an empty body (the engine's health and metrics).
async fn healthy_engine() -> std::io::Result<u16> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = l.local_addr()?.port();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let mut buf = [0u8; 1024];
                let _ = s.read(&mut buf).await;
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                    .await;
            });
        }
    });
    Ok(port)
}

/// Publishes `stream` at `blocks_per_sec` on a ZMQ PUB socket through a running bridge on
/// the in-process bus; a consumer applies the forwarded events to an index. Each batch's
/// delay runs from just before its publish to when its last block is in the index.
pub async fn latency_run(
    stream: &[Vec<u8>],
    shape: &StreamShape,
    blocks_per_sec: f64,
) -> Result<LatencySummary, BridgeBenchError> {
    let http = healthy_engine().await?;
    let mut publisher = zeromq::PubSocket::new();
    let bound = publisher.bind("tcp://127.0.0.1:0").await?;
    let endpoint = bound.to_string();
    let bus = Bus::local();
    let mut c = BridgeConfig::new(
        EngineKind::Vllm,
        "bench",
        endpoint,
        format!("http://127.0.0.1:{http}"),
    );
    c.block_size = shape.block_size;
    c.capacity_blocks = shape.capacity_blocks as u64 * 2;
    c.worker_id = Some(1);
    let subjects = Subjects::new(&c.namespace)?.model(&c.model)?;
    let mut events = bus.subscribe(&subjects.kv_events(1)).await?;
    let bridge = Bridge::start(c, bus.clone()).await?;
    // Wait until the bridge's subscription reaches the publisher (a PUB drops messages
    // for subscribers that have not joined yet).
    let deadline = Instant::now() + Duration::from_secs(10);
    while !bridge.readiness().0 {
        if Instant::now() > deadline {
            return Err(BridgeBenchError::NotConnected(bridge.readiness().1));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;

    let per_batch = (shape.blocks_per_event * shape.events_per_batch) as f64;
    let interval = Duration::from_secs_f64(per_batch / blocks_per_sec);
    // The last engine hash of each batch's last store → its batch number.
    let last_hash = |payload: &[u8]| -> u64 {
        let b = decode_batch(payload).expect("decodes");
        b.events
            .iter()
            .rev()
            .find_map(|e| match e {
                Ok(kvrouter_bridge::EngineEvent::Stored(s)) => s.block_hashes.last().copied(),
                _ => None,
            })
            .expect("a store")
    };
    let marks: FxHashMap<u64, usize> = stream
        .iter()
        .enumerate()
        .map(|(i, p)| (last_hash(p), i))
        .collect();
    let n = stream.len();
    let consumer = tokio::spawn(async move {
        let mut index = Index::new();
        let mut arrived: Vec<Option<Instant>> = vec![None; n];
        let mut seen = 0;
        while seen < n {
            let Ok(Some(msg)) = tokio::time::timeout(Duration::from_secs(10), events.next()).await
            else {
                break;
            };
            let Ok(batch) = decode::<KvEventBatch>(&msg.payload) else {
                continue;
            };
            for e in &batch.events {
                let _ = index.apply(e);
            }
            let now = Instant::now();
            for e in &batch.events {
                if let KvEventData::Stored { blocks, .. } = &e.data {
                    if let Some(&i) = blocks.last().and_then(|b| marks.get(&b.engine_hash.0)) {
                        if arrived[i].is_none() {
                            arrived[i] = Some(now);
                            seen += 1;
                        }
                    }
                }
            }
        }
        arrived
    });
    let mut sent = Vec::with_capacity(n);
    let start = tokio::time::Instant::now();
    for (seq, payload) in stream.iter().enumerate() {
        tokio::time::sleep_until(start + interval * seq as u32).await;
        let mut msg = ZmqMessage::from(bytes::Bytes::new());
        msg.push_back(bytes::Bytes::copy_from_slice(&(seq as u64).to_be_bytes()));
        msg.push_back(bytes::Bytes::copy_from_slice(payload));
        sent.push(Instant::now());
        publisher.send(msg).await?;
    }
    let arrived = consumer.await?;
    let _ = bridge.shutdown_within(Duration::from_secs(2)).await;
    let lost = arrived.iter().filter(|a| a.is_none()).count();
    if lost > 0 {
        return Err(BridgeBenchError::Lost { lost, total: n });
    }
    let mut samples: Vec<u64> = sent
        .iter()
        .zip(&arrived)
        .map(|(s, a)| a.expect("checked").duration_since(*s).as_micros() as u64)
        .collect();
    Ok(LatencySummary::from_samples(&mut samples))
}

//! `kvrouter mocker --emulate vllm|sglang`: simulated workers that look like vLLM or SGLang
//! from outside, with no bus: KV events on ZeroMQ (with replay), OpenAI-compatible HTTP, the
//! engine's health and metrics endpoints. A `kvrouter bridge` beside each is needed exactly
//! as for a real engine.
//!
//! Ports, with D = dp_size: worker i serves HTTP on `http_port + i`; its rank r publishes
//! on `zmq_port + 2·i·D + r` and answers replay on `zmq_port + 2·i·D + D + r` (the bridge's
//! `--zmq-endpoint` and `--replay-endpoint` are rank 0's; it offsets them by the rank).

mod http;
pub mod wire;
mod zmq;

use crate::config::ConfigError;
use crate::engine::RankEngine;
use crate::fleet::FleetConfig;
use crate::mock_info::{MockInfo, TransferConfig};
use crate::rank_task::RankTask;
use bytes::Bytes;
use http::{HttpRank, WorkerHttp};
use kvrouter_protocol::{EngineKind, KvEvent, WorkerKey};
use kvrouter_worker::{PubMsg, WorkerInfo, WorkerSpec};
use parking_lot::Mutex;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use thiserror::Error;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use wire::{encode_batch, BlockTokens};
pub use wire::{Emulated, ZmqWire};
use zeromq::Socket;

#[derive(Clone, Debug)]
pub struct EmulateConfig {
    pub engine: Emulated,
    pub wire: ZmqWire,
    /// Rank 0 of worker 0 publishes here (see the module docs for the others).
    pub zmq_port: u16,
    /// Worker 0's HTTP port.
    pub http_port: u16,
    /// Interface to bind (default 127.0.0.1).
    pub host: String,
    pub topic: String,
    /// Report cached prompt tokens in answers (`usage.prompt_tokens_details`), as the
    /// engines do when asked (vLLM `--enable-prompt-tokens-details`, SGLang
    /// `--enable-cache-report`).
    pub cache_report: bool,
    /// Model, workers, ranks, engine and speed, as a bus fleet has them.
    pub fleet: FleetConfig,
}

#[derive(Debug, Error)]
pub enum EmulateError {
    #[error(transparent)]
    Config(#[from] crate::fleet::FleetError),
    #[error(transparent)]
    Engine(#[from] ConfigError),
    #[error("ports: {0}")]
    Ports(String),
    #[error("cannot bind {what} on {addr}: {why}")]
    Bind {
        what: &'static str,
        addr: String,
        why: String,
    },
}

/// What one emulated worker serves, as printed at start.
#[derive(Clone, Debug, Serialize)]
pub struct WorkerEndpoints {
    pub worker: u32,
    pub base_url: String,
    pub metrics_url: String,
    /// Rank 0's publisher and replay endpoints (rank r adds r to the port).
    pub zmq_endpoint: String,
    pub replay_endpoint: String,
    pub dp_start_rank: u32,
    pub dp_size: u32,
}

pub struct EmulatedFleet {
    pub workers: Vec<WorkerEndpoints>,
    shutdown: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl EmulatedFleet {
    pub async fn start(config: EmulateConfig) -> Result<Self, EmulateError> {
        let c = &config.fleet;
        c.validate()?;
        let d = c.dp_size;
        let last = u32::from(config.zmq_port) + 2 * c.workers * d;
        let last_http = u32::from(config.http_port) + c.workers;
        if last > 65535 || last_http > 65535 {
            return Err(EmulateError::Ports(format!(
                "{} workers of {d} ranks need ZMQ ports {}..{last} and HTTP ports {}..{last_http}",
                c.workers, config.zmq_port, config.http_port
            )));
        }
        let (shutdown, _) = watch::channel(false);
        let mut fleet = Self {
            workers: Vec::new(),
            shutdown,
            tasks: Vec::new(),
        };
        for i in 0..c.workers {
            fleet.start_worker(&config, i).await?;
        }
        Ok(fleet)
    }

    async fn start_worker(&mut self, config: &EmulateConfig, i: u32) -> Result<(), EmulateError> {
        let c = &config.fleet;
        let host = &config.host;
        let d = c.dp_size;
        let zmq_base = u32::from(config.zmq_port) + 2 * i * d;
        let http_port = u32::from(config.http_port) + i;
        let base_url = format!("http://{host}:{http_port}");
        let spec = WorkerSpec {
            worker_id: c.worker_id_start + u64::from(i),
            model: c.model.clone(),
            role: c.role,
            block_size: c.engine.block_size as u32,
            dp_size: d,
            dp_start_rank: c.dp_start_rank,
            tp_size: c.tp_size,
            capacity_blocks: c.engine.capacity_blocks as u64,
            heartbeat_interval_ms: 1000,
            engine: match config.engine {
                Emulated::Vllm => EngineKind::Vllm,
                Emulated::Sglang => EngineKind::Sglang,
            },
            base_url: base_url.clone(),
        };
        let transfer = TransferConfig {
            per_block: c.kv_transfer_per_block,
            receive_timeout: c.kv_receive_timeout,
            speedup: c.speedup,
        };
        let info = Arc::new(MockInfo::new(WorkerInfo::new(spec), transfer));
        let (pub_tx, mut pub_rx) = mpsc::unbounded_channel::<PubMsg>();
        // Raw payloads from the test hook `POST /kvrouter/test/raw_frame`: (rank, payload).
        let (raw_tx, mut raw_rx) = mpsc::unbounded_channel::<(u32, Bytes)>();
        let mut ranks = Vec::new();
        let mut sockets = BTreeMap::new();
        for r in 0..d {
            let key = WorkerKey::new(info.worker_id, c.dp_start_rank + r);
            let engine = RankEngine::new(key, c.engine.clone())?;
            let (tx, rx) = mpsc::unbounded_channel();
            let task = RankTask::new(engine, r as usize, info.clone(), pub_tx.clone(), c.speedup);
            self.tasks
                .push(tokio::spawn(task.run(rx, self.shutdown.subscribe())));
            let stream = Arc::new(zmq::RankStream::default());
            let tokens = Arc::new(Mutex::new(BlockTokens::default()));
            let pub_addr = format!("tcp://{host}:{}", zmq_base + r);
            let mut publisher = zeromq::PubSocket::new();
            publisher
                .bind(&pub_addr)
                .await
                .map_err(|e| bind_error("the KV event publisher", &pub_addr, e))?;
            let replay_addr = format!("tcp://{host}:{}", zmq_base + d + r);
            let mut replay = zeromq::RouterSocket::new();
            replay
                .bind(&replay_addr)
                .await
                .map_err(|e| bind_error("the replay endpoint", &replay_addr, e))?;
            self.tasks
                .push(tokio::spawn(zmq::serve_replay(replay, stream.clone())));
            sockets.insert(key.dp_rank, (publisher, stream.clone(), tokens.clone()));
            ranks.push(HttpRank {
                cmds: tx,
                tokens,
                stream,
                in_flight: AtomicU64::new(0),
            });
        }
        drop(pub_tx);

        // Events from the ranks, one batch per step and rank, onto the rank's socket.
        let (engine, wire, block_size) = (config.engine, config.wire, info.block_size);
        let topic = Bytes::from(config.topic.clone().into_bytes());
        let mut stop = self.shutdown.subscribe();
        self.tasks.push(tokio::spawn(async move {
            loop {
                let msg = tokio::select! {
                    _ = kvrouter_worker::stopped(&mut stop) => return,
                    m = pub_rx.recv() => match m { Some(m) => m, None => return },
                    Some((rank, payload)) = raw_rx.recv() => {
                        if let Some((socket, stream, _)) = sockets.get_mut(&rank) {
                            if let Err(e) = zmq::publish(socket, stream, &topic, payload).await {
                                tracing::warn!(dp_rank = rank, error = %e, "cannot publish a raw frame");
                            }
                        }
                        continue;
                    }
                };
                let PubMsg::Events(events) = msg else {
                    continue;
                };
                let mut by_rank: BTreeMap<u32, Vec<KvEvent>> = BTreeMap::new();
                for e in events {
                    by_rank.entry(e.key.dp_rank).or_default().push(e);
                }
                let ts = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map(|d| d.as_secs_f64())
                    .unwrap_or(0.0);
                for (rank, events) in by_rank {
                    let Some((socket, stream, tokens)) = sockets.get_mut(&rank) else {
                        continue;
                    };
                    let payload = {
                        let mut t = tokens.lock();
                        encode_batch(engine, wire, ts, rank, &events, block_size, &mut t)
                    };
                    if let Err(e) = zmq::publish(socket, stream, &topic, Bytes::from(payload)).await
                    {
                        tracing::warn!(dp_rank = rank, error = %e, "cannot publish KV events");
                    }
                }
            }
        }));

        let http = Arc::new(WorkerHttp {
            engine: config.engine,
            model: c.model.clone(),
            info,
            engine_seed: c.engine.engine_hash_seed,
            ranks,
            next_id: AtomicU64::new(0),
            raw_frames: raw_tx,
            cache_report: config.cache_report,
            traceparents: Default::default(),
        });
        let addr = format!("{host}:{http_port}");
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .map_err(|e| bind_error("HTTP", &addr, e))?;
        let mut stop = self.shutdown.subscribe();
        let server = kvrouter_admin::HttpServer::start(
            listener,
            kvrouter_admin::HttpLimits::default(),
            "engine",
            move |req| http.clone().handle(req),
        )
        .map_err(|e| bind_error("HTTP", &addr, e))?;
        self.tasks.push(tokio::spawn(async move {
            kvrouter_worker::stopped(&mut stop).await;
            drop(server);
        }));
        self.workers.push(WorkerEndpoints {
            worker: i,
            metrics_url: format!("{base_url}/metrics"),
            base_url,
            zmq_endpoint: format!("tcp://{host}:{zmq_base}"),
            replay_endpoint: format!("tcp://{host}:{}", zmq_base + d),
            dp_start_rank: c.dp_start_rank,
            dp_size: d,
        });
        Ok(())
    }

    /// Stops every task within `budget`.
    pub async fn shutdown_within(mut self, budget: Duration) {
        let _ = self.shutdown.send(true);
        let deadline = tokio::time::Instant::now() + budget;
        for mut t in std::mem::take(&mut self.tasks) {
            if tokio::time::timeout_at(deadline, &mut t).await.is_err() {
                t.abort();
            }
        }
    }
}

impl Drop for EmulatedFleet {
    fn drop(&mut self) {
        let _ = self.shutdown.send(true);
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn bind_error(what: &'static str, addr: &str, e: impl std::fmt::Display) -> EmulateError {
    EmulateError::Bind {
        what,
        addr: addr.to_string(),
        why: e.to_string(),
    }
}

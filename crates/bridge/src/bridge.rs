//! A running bridge: one engine's ranks on the bus as one kvrouter worker.

use crate::config::{BridgeConfig, BridgeError, Resolved};
use crate::engine_watch::EngineWatch;
use crate::metrics::BridgeMetrics;
use crate::mirror_task::{MirrorCmd, MirrorTask};
use crate::worker_mirror::WorkerMirror;
use crate::zmq_rank::{RankConnected, RankStream};
use kvrouter_admin::AdminView;
use kvrouter_bus::{Bus, Message, Subscription};
use kvrouter_protocol::{
    decode, reply_version, ErrorKind, ErrorReply, ModelSubjects, Reply, StateChunk, StateQuery,
    Tier, WorkerId, WorkerKey,
};
use kvrouter_worker::{
    announce, deregister_within, discovery_task, send_error_stream, send_state, stopped, Publisher,
    WorkerInfo, WorkerSpec,
};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// Commands queued for the mirror task before senders wait (a burst of engine batches).
const MIRROR_QUEUE: usize = 4096;

/// What `/readyz` and `/metrics` read.
pub struct BridgeView {
    pub info: Arc<WorkerInfo>,
    pub connected: Vec<(u32, Arc<RankConnected>)>,
    pub metrics: Arc<BridgeMetrics>,
    pub bus: Bus,
    /// The admin listener's connection counts, once it listens.
    pub http_stats: parking_lot::Mutex<Vec<(SocketAddr, Arc<kvrouter_admin::HttpStats>)>>,
}

impl AdminView for BridgeView {
    fn readiness(&self) -> (bool, String) {
        if !self.bus.is_connected() {
            return (false, "not connected to the bus".into());
        }
        let down: Vec<u32> = self
            .connected
            .iter()
            .filter(|(_, c)| !c.0.load(Ordering::Relaxed))
            .map(|(r, _)| *r)
            .collect();
        if !down.is_empty() {
            return (
                false,
                format!("ranks {down:?} not connected to the engine's KV events"),
            );
        }
        let live = self.info.live_ranks();
        if live.is_empty() {
            return (false, "the engine is not healthy: no rank is live".into());
        }
        (true, format!("ready: ranks {live:?} live"))
    }

    fn metrics(&self) -> String {
        let listeners = self.http_stats.lock().clone();
        kvrouter_admin::append_http_stats(self.metrics.render(), "kvrouter_bridge", &listeners)
    }
}

pub struct Bridge {
    info: Arc<WorkerInfo>,
    bus: Bus,
    subjects: ModelSubjects,
    shutdown: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    admin_addr: Option<SocketAddr>,
    /// The admin server: it serves until aborted, last, so probes answer while the bridge
    /// drains.
    admin: Option<JoinHandle<()>>,
    view: Arc<BridgeView>,
}

impl Bridge {
    pub async fn start(config: BridgeConfig, bus: Bus) -> Result<Self, BridgeError> {
        let Resolved {
            config: c,
            worker_id,
            ranks,
            health_url,
            metrics_url,
        } = config.resolve()?;
        let subjects = kvrouter_protocol::Subjects::new(&c.namespace)?.model(&c.model)?;
        let spec = WorkerSpec {
            worker_id,
            model: c.model.clone(),
            role: c.role,
            block_size: c.block_size,
            dp_size: c.dp_size,
            dp_start_rank: c.dp_start_rank,
            tp_size: c.tp_size,
            capacity_blocks: c.capacity_blocks,
            heartbeat_interval_ms: c.heartbeat_interval.as_millis() as u32,
            engine: c.engine,
            base_url: c.base_url.clone(),
        };
        // Not live until the engine's health check passes.
        let info = Arc::new(WorkerInfo::with_live(spec, false));
        let metrics = Arc::new(BridgeMetrics::new());
        let (shutdown, _) = watch::channel(false);
        let mut tasks = Vec::new();

        let (pub_tx, pub_rx) = mpsc::unbounded_channel();
        let publisher = Publisher {
            bus: bus.clone(),
            info: info.clone(),
            kv_events_subject: subjects.kv_events(worker_id),
            load_subject: subjects.load(worker_id),
            event_marks_subject: subjects.event_marks(worker_id),
            batch_interval: c.event_batch_interval,
            load_interval: c.metrics_interval,
        };
        tasks.push(tokio::spawn(publisher.run(pub_rx, shutdown.subscribe())));

        let (mirror_tx, mirror_rx) = mpsc::channel(MIRROR_QUEUE);
        let mirror = MirrorTask {
            mirror: WorkerMirror::new(
                worker_id,
                c.dp_start_rank,
                c.dp_size,
                c.block_size,
                c.capacity_blocks,
            )
            .with_tier_capacity(Tier::Host, c.host_capacity_blocks)
            .with_tier_capacity(Tier::Disk, c.disk_capacity_blocks),
            info: info.clone(),
            publisher: pub_tx,
            metrics: metrics.clone(),
            bus: bus.clone(),
            subjects: subjects.clone(),
            // The first instance is new: a rank's first batch is never a restart anyway.
            // A new instance: nothing came from any rank yet.
            fresh: vec![true; c.dp_size as usize],
        };
        tasks.push(tokio::spawn(mirror.run(mirror_rx)));

        let (reconnect, reconnect_rx) = watch::channel(0u64);
        let mut connected = Vec::new();
        for (rank, endpoint, replay_endpoint) in ranks {
            let up = Arc::new(RankConnected::default());
            connected.push((rank, up.clone()));
            let stream = RankStream {
                rank,
                endpoint,
                bind: c.zmq_bind,
                replay_endpoint,
                topic: c.topic.clone(),
                replay_timeout: c.replay_timeout,
                mirror: mirror_tx.clone(),
                metrics: metrics.clone(),
                connected: up,
                reconnect: reconnect_rx.clone(),
            };
            tasks.push(tokio::spawn(stream.run(shutdown.subscribe())));
        }

        let state = bus.subscribe(&subjects.state(worker_id)).await?;
        tasks.push(tokio::spawn(serve_state(
            state,
            bus.clone(),
            info.clone(),
            mirror_tx.clone(),
            shutdown.subscribe(),
        )));
        let who = bus.subscribe(&subjects.who_is_there()).await?;
        tasks.push(tokio::spawn(discovery_task(
            bus.clone(),
            subjects.clone(),
            vec![info.clone()],
            who,
            c.heartbeat_interval,
            shutdown.subscribe(),
        )));
        let watch = Arc::new(EngineWatch {
            kind: c.engine,
            health_url,
            health_interval: c.health_interval,
            metrics_url,
            metrics_interval: c.metrics_interval,
            timeout: c.http_timeout,
            events_silent_after: c.events_silent_after,
            zmq: c.zmq_endpoint.clone(),
            zmq_bind: c.zmq_bind,
            topic: c.topic.clone(),
            info: info.clone(),
            bus: bus.clone(),
            subjects: subjects.clone(),
            metrics: metrics.clone(),
            reconnect,
            mirror: mirror_tx.clone(),
        });
        tasks.push(tokio::spawn(watch.clone().health(shutdown.subscribe())));
        tasks.push(tokio::spawn(watch.load(shutdown.subscribe())));
        let view = Arc::new(BridgeView {
            info: info.clone(),
            connected,
            metrics,
            bus: bus.clone(),
            http_stats: Default::default(),
        });
        let (admin_addr, admin) = match c.admin_addr {
            Some(addr) => {
                let (local, stats, task) =
                    kvrouter_admin::serve(addr, c.http_limits.clone(), view.clone())
                        .await
                        .map_err(|source| BridgeError::Admin { addr, source })?;
                view.http_stats.lock().push((local, stats));
                (Some(local), Some(task))
            }
            None => (None, None),
        };
        if let Err(e) = bus.flush().await {
            tracing::warn!(error = %e, "cannot flush subscriptions");
        }
        announce(&bus, &subjects, &info).await;
        tracing::info!(
            worker_id,
            instance_id = %info.instance_id(),
            engine = %c.engine,
            model = %c.model,
            dp_start_rank = c.dp_start_rank,
            dp_size = c.dp_size,
            zmq = %c.zmq_endpoint,
            zmq_bind = c.zmq_bind,
            replay = ?c.replay_endpoint,
            base_url = %c.base_url,
            admin = ?admin_addr,
            "bridge started"
        );
        Ok(Self {
            info,
            bus,
            subjects,
            shutdown,
            tasks,
            admin_addr,
            admin,
            view,
        })
    }

    pub fn worker_id(&self) -> WorkerId {
        self.info.worker_id
    }

    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin_addr
    }

    /// Ready or not, and why (what `/readyz` says).
    pub fn readiness(&self) -> (bool, String) {
        self.view.readiness()
    }

    /// Stops reading the engine, deregisters, and ends within `budget` whatever the bus does.
    pub async fn shutdown_within(self, budget: Duration) -> Result<(), String> {
        let _ = self.shutdown.send(true);
        let deadline = Instant::now() + budget / 2;
        let mut aborted = 0;
        for mut t in self.tasks {
            if tokio::time::timeout_at(deadline, &mut t).await.is_err() {
                t.abort();
                aborted += 1;
            }
        }
        let left = budget / 2;
        let dereg = deregister_within(&self.bus, &self.subjects, &[&*self.info], left).await;
        if let Some(admin) = self.admin {
            admin.abort();
        }
        match (aborted, dereg) {
            (0, r) => r,
            (n, Ok(())) => Err(format!("{n} task(s) did not stop in time and were aborted")),
            (n, Err(e)) => Err(format!("{n} task(s) aborted; {e}")),
        }
    }
}

/// Answers replicas' state queries from the mirror.
async fn serve_state(
    mut sub: Subscription,
    bus: Bus,
    info: Arc<WorkerInfo>,
    mirror: mpsc::Sender<MirrorCmd>,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        let msg: Message = tokio::select! {
            _ = stopped(&mut shutdown) => return,
            m = sub.next() => match m { Some(m) => m, None => return },
        };
        let version = reply_version(&msg.payload);
        let Some(reply) = msg.reply else { continue };
        let error = |kind, message: String| {
            let bus = bus.clone();
            let reply = reply.clone();
            tokio::spawn(send_error_stream(
                bus,
                reply,
                Reply::<StateChunk>::Err(ErrorReply::new(kind, message)),
                version,
            ));
        };
        let query: StateQuery = match decode(&msg.payload) {
            Ok(q) => q,
            Err(e) => {
                error(ErrorKind::Malformed, format!("bad StateQuery: {e}"));
                continue;
            }
        };
        if info.live_rank_index(query.dp_rank).is_none() {
            error(
                ErrorKind::InvalidRank,
                format!(
                    "rank {} of worker {} is not live (live ranks {:?})",
                    query.dp_rank,
                    info.worker_id,
                    info.live_ranks()
                ),
            );
            continue;
        }
        let (tx, rx) = oneshot::channel();
        let cmd = MirrorCmd::Snapshot {
            rank: query.dp_rank,
            reply: tx,
        };
        if mirror.send(cmd).await.is_err() {
            error(ErrorKind::Unavailable, "the bridge is shutting down".into());
            continue;
        }
        let key = WorkerKey::new(info.worker_id, query.dp_rank);
        let instance_id = info.instance_id();
        let bus = bus.clone();
        tokio::spawn(async move {
            match rx.await {
                Ok(Some(snapshot)) => {
                    send_state(&bus, &reply, key, instance_id, snapshot, version).await
                }
                _ => {
                    let err =
                        ErrorReply::new(ErrorKind::Unavailable, "the bridge is shutting down");
                    send_error_stream(bus, reply, Reply::<StateChunk>::Err(err), version).await;
                }
            }
        });
    }
}

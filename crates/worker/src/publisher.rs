//! A worker's publisher task: batches its ranks' KV events and publishes its load reports.

use crate::info::WorkerInfo;
use crate::publish::{encode_chunked, publish_msg};
use crate::shutdown::stopped;
use kvrouter_bus::Bus;
use kvrouter_protocol::{KvEvent, KvEventBatch, FORMAT_VERSION};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

/// Without changes, a load report still goes out this often.
const LOAD_KEEPALIVE: Duration = Duration::from_secs(1);

/// What the publisher of a worker receives from its ranks and endpoints.
pub enum PubMsg {
    /// KV events of one rank, in event-id order.
    Events(Vec<KvEvent>),
    /// Drop (do not publish) the next `n` event batches.
    DropBatches(u64),
    /// Publish the events received so far now, then answer (before a new instance id, so
    /// no event goes out under the wrong one).
    Flush(oneshot::Sender<()>),
}

/// Batches a worker's KV events (one `KvEventBatch` per flush, chunked under the payload
/// limit) and publishes its load reports.
pub struct Publisher {
    pub bus: Bus,
    pub info: Arc<WorkerInfo>,
    pub kv_events_subject: String,
    pub load_subject: String,
    pub batch_interval: Duration,
    pub load_interval: Duration,
}

impl Publisher {
    pub async fn run(
        self,
        mut rx: mpsc::UnboundedReceiver<PubMsg>,
        mut shutdown: watch::Receiver<bool>,
    ) {
        let mut buf: Vec<KvEvent> = Vec::new();
        let mut to_drop: u64 = 0;
        let mut flush_at: Option<Instant> = None;
        let mut last_load = Instant::now();
        let mut load_tick = tokio::time::interval(self.load_interval);
        load_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                _ = stopped(&mut shutdown) => break,
                msg = rx.recv() => match msg {
                    None => break,
                    Some(PubMsg::Events(events)) => {
                        buf.extend(events);
                        flush_at.get_or_insert_with(|| Instant::now() + self.batch_interval);
                    }
                    Some(PubMsg::DropBatches(n)) => to_drop = to_drop.saturating_add(n),
                    Some(PubMsg::Flush(done)) => {
                        flush_at = None;
                        self.flush_events(&mut buf, &mut to_drop).await;
                        let _ = done.send(());
                    }
                },
                _ = self.info.load_changed() => {
                    flush_at.get_or_insert_with(|| Instant::now() + self.batch_interval);
                }
                _ = tokio::time::sleep_until(flush_at.unwrap_or_else(Instant::now)), if flush_at.is_some() => {
                    flush_at = None;
                    self.flush_events(&mut buf, &mut to_drop).await;
                    if self.info.load_dirty() {
                        self.publish_load().await;
                        last_load = Instant::now();
                    }
                }
                _ = load_tick.tick() => {
                    if self.info.load_dirty() || last_load.elapsed() >= LOAD_KEEPALIVE {
                        self.publish_load().await;
                        last_load = Instant::now();
                    }
                }
            }
        }
        // Whatever the ranks handed over before stopping goes out.
        while let Ok(msg) = rx.try_recv() {
            match msg {
                PubMsg::Events(events) => buf.extend(events),
                PubMsg::DropBatches(n) => to_drop = to_drop.saturating_add(n),
                PubMsg::Flush(done) => {
                    self.flush_events(&mut buf, &mut to_drop).await;
                    let _ = done.send(());
                }
            }
        }
        self.flush_events(&mut buf, &mut to_drop).await;
    }

    async fn flush_events(&self, buf: &mut Vec<KvEvent>, to_drop: &mut u64) {
        if buf.is_empty() {
            return;
        }
        let max_payload = self.bus.max_payload();
        let worker_id = self.info.worker_id;
        let instance_id = self.info.instance_id();
        let wrap = |events: Vec<KvEvent>| KvEventBatch {
            worker_id,
            instance_id,
            events,
        };
        let batches = encode_chunked(std::mem::take(buf), max_payload, &wrap, FORMAT_VERSION);
        for batch in batches {
            if *to_drop > 0 {
                *to_drop -= 1;
                tracing::info!(
                    worker_id,
                    "dropping a KV event batch (drop_events test hook)"
                );
                continue;
            }
            if let Err(e) = self.bus.publish(&self.kv_events_subject, batch).await {
                tracing::warn!(worker_id, error = %e, "cannot publish KV events; they are lost");
            }
        }
    }

    async fn publish_load(&self) {
        let report = self.info.take_load_report();
        publish_msg(&self.bus, &self.load_subject, &report).await;
    }
}

//! A worker's publisher task: batches its ranks' KV events and publishes its load reports.

use crate::info::WorkerInfo;
use crate::publish::{encode_chunked, publish_msg};
use crate::shutdown::stopped;
use kvrouter_bus::Bus;
use kvrouter_protocol::{
    DpRank, EventId, EventMarks, KvEvent, KvEventBatch, RankMark, FORMAT_VERSION,
};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

/// Without changes, a load report still goes out this often.
const LOAD_KEEPALIVE: Duration = Duration::from_secs(1);
/// Event marks go out this often (once the worker has any event).
const MARKS_EVERY: Duration = Duration::from_secs(1);

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
    pub event_marks_subject: String,
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
        let mut marks = Marks::default();
        let mut last_marks = Instant::now();
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
                        self.flush_events(&mut buf, &mut to_drop, &mut marks).await;
                        let _ = done.send(());
                    }
                },
                _ = self.info.load_changed() => {
                    flush_at.get_or_insert_with(|| Instant::now() + self.batch_interval);
                }
                _ = tokio::time::sleep_until(flush_at.unwrap_or_else(Instant::now)), if flush_at.is_some() => {
                    flush_at = None;
                    self.flush_events(&mut buf, &mut to_drop, &mut marks).await;
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
                    if last_marks.elapsed() >= MARKS_EVERY {
                        self.publish_marks(&marks).await;
                        last_marks = Instant::now();
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
                    self.flush_events(&mut buf, &mut to_drop, &mut marks).await;
                    let _ = done.send(());
                }
            }
        }
        self.flush_events(&mut buf, &mut to_drop, &mut marks).await;
    }

    async fn flush_events(&self, buf: &mut Vec<KvEvent>, to_drop: &mut u64, marks: &mut Marks) {
        if buf.is_empty() {
            return;
        }
        let max_payload = self.bus.max_payload();
        let worker_id = self.info.worker_id;
        let instance_id = self.info.instance_id();
        // Marked before publishing: events lost on the way (or dropped by the test hook) are
        // what marks reveal.
        marks.note(instance_id, buf);
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

    async fn publish_marks(&self, marks: &Marks) {
        let Some(marks) = marks.message(self.info.worker_id, self.info.instance_id()) else {
            return;
        };
        publish_msg(&self.bus, &self.event_marks_subject, &marks).await;
    }

    async fn publish_load(&self) {
        let report = self.info.take_load_report();
        publish_msg(&self.bus, &self.load_subject, &report).await;
    }
}

/// The last event id published (or meant to be) per rank, for one worker instance.
#[derive(Default)]
struct Marks {
    instance_id: Option<uuid::Uuid>,
    last: BTreeMap<DpRank, EventId>,
}

impl Marks {
    fn note(&mut self, instance_id: uuid::Uuid, events: &[KvEvent]) {
        if self.instance_id != Some(instance_id) {
            // Event ids are per instance: a new one starts over.
            self.instance_id = Some(instance_id);
            self.last.clear();
        }
        for e in events {
            let last = self.last.entry(e.key.dp_rank).or_insert(e.event_id);
            *last = (*last).max(e.event_id);
        }
    }

    /// The marks of `instance_id`, if it has any event.
    fn message(&self, worker_id: u64, instance_id: uuid::Uuid) -> Option<EventMarks> {
        if self.instance_id != Some(instance_id) || self.last.is_empty() {
            return None;
        }
        Some(EventMarks {
            worker_id,
            instance_id,
            ranks: self
                .last
                .iter()
                .map(|(&dp_rank, &last_event_id)| RankMark {
                    dp_rank,
                    last_event_id,
                })
                .collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrouter_protocol::{KvEventData, Tier, WorkerKey};

    fn ev(rank: DpRank, id: EventId) -> KvEvent {
        KvEvent {
            tier: Tier::Device,
            key: WorkerKey::new(7, rank),
            event_id: id,
            data: KvEventData::Cleared,
        }
    }

    #[test]
    fn marks_keep_each_ranks_last_event_of_the_current_instance() {
        let (a, b) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
        let mut m = Marks::default();
        assert_eq!(m.message(7, a), None, "no event, no marks");
        m.note(a, &[ev(0, 0), ev(1, 0), ev(0, 1)]);
        m.note(a, &[ev(0, 2)]);
        let marks = m.message(7, a).unwrap();
        assert_eq!(
            marks.ranks,
            vec![
                RankMark {
                    dp_rank: 0,
                    last_event_id: 2
                },
                RankMark {
                    dp_rank: 1,
                    last_event_id: 0
                },
            ]
        );
        assert_eq!(m.message(7, b), None, "not another instance's");
        m.note(b, &[ev(1, 0)]);
        assert_eq!(
            m.message(7, b).unwrap().ranks.len(),
            1,
            "a new instance starts over"
        );
    }
}

//! Where an ended span goes: the exporter's bounded queue, or dropped (and counted) when it
//! is full.

use crate::metrics::TraceMetrics;
use crate::proto;
use std::sync::Arc;
use tokio::sync::mpsc;

#[derive(Clone, Debug)]
pub(crate) struct Sink(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    queue: mpsc::Sender<proto::Span>,
    metrics: TraceMetrics,
}

impl Sink {
    pub(crate) fn new(queue: mpsc::Sender<proto::Span>, metrics: TraceMetrics) -> Self {
        Self(Arc::new(Inner { queue, metrics }))
    }

    pub(crate) fn push(&self, span: proto::Span) {
        if self.0.queue.try_send(span).is_err() {
            self.0.metrics.dropped.inc();
        }
    }
}

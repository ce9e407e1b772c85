//! The tracer a process holds: it starts spans, decides which are sampled, and hands ended
//! ones to the exporter's bounded queue. Off (no endpoint configured) it records nothing,
//! and its spans only pass the caller's trace context on.

use crate::metrics::TraceMetrics;
use crate::proto;
use crate::sink::Sink;
use crate::span::{new_span_id, new_trace_id, Recording, Span, SpanKind, SAMPLED};
use kvrouter_protocol::TraceContext;
use std::sync::Arc;
use tokio::sync::mpsc;

/// Starts spans. Cheap to clone; [`Tracer::off`] (the default) exports nothing.
#[derive(Clone, Debug, Default)]
pub struct Tracer {
    shared: Option<Arc<Shared>>,
}

#[derive(Debug)]
struct Shared {
    sink: Sink,
    sample_ratio: f64,
}

impl Tracer {
    /// A tracer that records nothing.
    pub fn off() -> Self {
        Self::default()
    }

    pub(crate) fn exporting(
        queue: mpsc::Sender<proto::Span>,
        sample_ratio: f64,
        metrics: TraceMetrics,
    ) -> Self {
        Self {
            shared: Some(Arc::new(Shared {
                sink: Sink::new(queue, metrics),
                sample_ratio,
            })),
        }
    }

    /// Whether spans may be exported.
    pub fn is_on(&self) -> bool {
        self.shared.is_some()
    }

    /// Starts a span under `parent` (the caller's span, from a `traceparent` or a bus
    /// message), or as the root of a new trace. A parent's sampled flag decides whether the
    /// span records; a new trace is sampled with the configured ratio. Off, the span only
    /// carries `parent` on.
    pub fn span(&self, name: &'static str, kind: SpanKind, parent: Option<TraceContext>) -> Span {
        let Some(shared) = &self.shared else {
            return Span::passthrough(parent);
        };
        let (trace_id, flags) = match parent {
            Some(p) => (p.trace_id, p.flags),
            None => {
                let sampled = shared.sample_ratio >= 1.0 || fastrand::f64() < shared.sample_ratio;
                (new_trace_id(), if sampled { SAMPLED } else { 0 })
            }
        };
        let context = TraceContext {
            trace_id,
            parent_id: new_span_id(),
            flags,
        };
        let recording = (flags & SAMPLED != 0).then(|| {
            (
                Recording::new(name, kind, context, parent),
                shared.sink.clone(),
            )
        });
        Span {
            context: Some(context),
            recording,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tracer(ratio: f64, capacity: usize) -> (Tracer, mpsc::Receiver<proto::Span>, TraceMetrics) {
        let (tx, rx) = mpsc::channel(capacity);
        let metrics = TraceMetrics::default();
        (Tracer::exporting(tx, ratio, metrics.clone()), rx, metrics)
    }

    fn parent(flags: u8) -> TraceContext {
        TraceContext {
            trace_id: [7; 16],
            parent_id: [9; 8],
            flags,
        }
    }

    #[test]
    fn an_off_tracer_passes_the_callers_context_on_and_records_nothing() {
        let t = Tracer::off();
        let mut s = t.span("x", SpanKind::Server, Some(parent(1)));
        s.set("k", 1u32);
        assert!(!s.is_recording());
        assert_eq!(s.context(), Some(parent(1)));
        assert_eq!(t.span("x", SpanKind::Server, None).context(), None);
    }

    #[test]
    fn a_child_joins_its_parents_trace_under_a_new_span_id() {
        let (t, mut rx, _) = tracer(1.0, 8);
        let mut s = t.span("route", SpanKind::Server, Some(parent(1)));
        s.set("kvrouter.worker_id", 3u64);
        let ctx = s.context().unwrap();
        assert_eq!((ctx.trace_id, ctx.flags), ([7; 16], 1));
        assert_ne!(ctx.parent_id, [9; 8]);
        s.end();
        let got = rx.try_recv().unwrap();
        assert_eq!(got.trace_id, vec![7; 16]);
        assert_eq!(got.span_id, ctx.parent_id.to_vec());
        assert_eq!(got.parent_span_id, vec![9; 8]);
        assert_eq!(got.kind, SpanKind::Server as i32);
        assert_eq!(
            got.flags,
            1 | proto::FLAG_HAS_IS_REMOTE | proto::FLAG_IS_REMOTE
        );
        assert!(got.end_time_unix_nano >= got.start_time_unix_nano);
        assert_eq!(got.attributes.len(), 1);
    }

    #[test]
    fn an_unsampled_parent_is_followed_and_a_root_is_sampled_by_ratio() {
        let (t, mut rx, _) = tracer(0.0, 8);
        let s = t.span("x", SpanKind::Server, Some(parent(0)));
        assert!(!s.is_recording());
        assert_eq!(s.context().unwrap().trace_id, [7; 16]);
        drop(s);
        let root = t.span("x", SpanKind::Server, None);
        assert!(!root.is_recording());
        assert_eq!(root.context().unwrap().flags & SAMPLED, 0);
        drop(root);
        assert!(rx.try_recv().is_err());

        let (t, mut rx, _) = tracer(1.0, 8);
        let root = t.span("x", SpanKind::Server, None);
        assert!(root.is_recording());
        drop(root);
        assert!(rx.try_recv().unwrap().parent_span_id.is_empty());
    }

    #[test]
    fn a_full_queue_drops_and_counts() {
        let (t, _rx, metrics) = tracer(1.0, 2);
        for _ in 0..5 {
            t.span("x", SpanKind::Internal, None).end();
        }
        assert_eq!(metrics.dropped.get(), 3);
    }
}

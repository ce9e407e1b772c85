//! The exporter against the test kit's receiver, which decodes with opentelemetry-proto's
//! own types: spans arrive whole and nested, a failing collector costs spans (counted), not
//! the process.

use kvrouter_otlp::{
    start, ExportOptions, OtlpEndpoint, ServiceInfo, SpanKind, TraceMetrics, Tracer,
};
use kvrouter_protocol::TraceContext;
use kvrouter_testkit::{free_port, OtlpReceiver};
use std::time::Duration;

fn service() -> ServiceInfo {
    ServiceInfo {
        name: "kvrouter-test".into(),
        instance_id: "t-1".into(),
    }
}

fn options() -> ExportOptions {
    ExportOptions {
        interval: Duration::from_millis(50),
        timeout: Duration::from_secs(2),
        ..ExportOptions::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_the_collector_nested_with_their_attributes() {
    let rx = OtlpReceiver::start().unwrap();
    let metrics = TraceMetrics::default();
    let endpoint = OtlpEndpoint::parse(&rx.endpoint()).unwrap();
    let (tracer, exporter) = start(endpoint, service(), options(), metrics.clone());

    let client =
        TraceContext::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
    let mut server = tracer.span("kvrouter.request", SpanKind::Server, Some(client));
    server.set("kvrouter.model", "llama");
    let mut call = tracer.span("kvrouter.route", SpanKind::Client, server.context());
    call.set("kvrouter.worker_id", 7u64);
    call.set("kvrouter.cost", 1.5);
    call.set("kvrouter.fallback", false);
    call.fail("engine refused");
    let call_ctx = call.context().unwrap();
    call.end();
    let server_ctx = server.context().unwrap();
    drop(server);
    // A new trace from a root span, spans after it in the same batch.
    let root = tracer.span("kvrouter.request", SpanKind::Server, None);
    let root_ctx = root.context().unwrap();
    drop(root);

    let spans = tokio::task::spawn_blocking(move || {
        let spans = rx.wait_for(Duration::from_secs(10), |s| s.len() >= 3);
        assert_eq!(rx.rejected(), 0);
        spans
    })
    .await
    .unwrap();
    assert_eq!(spans.len(), 3, "{spans:#?}");
    let by_id = |id: [u8; 8]| {
        let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
        spans.iter().find(|s| s.span_id == hex).cloned().unwrap()
    };
    let s = by_id(server_ctx.parent_id);
    assert_eq!(s.service, "kvrouter-test");
    assert_eq!(s.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
    assert_eq!(s.parent_span_id.as_deref(), Some("00f067aa0ba902b7"));
    assert_eq!((s.kind, s.attr("kvrouter.model")), (2, Some("llama")));
    assert_eq!(s.flags & 0x3ff, 0x301, "sampled, parent known to be remote");
    assert!(s.end_unix_nano >= s.start_unix_nano && s.start_unix_nano > 0);
    let c = by_id(call_ctx.parent_id);
    assert_eq!(c.parent_span_id, Some(s.span_id.clone()));
    assert_eq!(c.trace_id, s.trace_id);
    assert_eq!(c.kind, 3);
    assert_eq!(c.attr("kvrouter.worker_id"), Some("7"));
    assert_eq!(c.attr("kvrouter.cost"), Some("1.5"));
    assert_eq!(c.attr("kvrouter.fallback"), Some("false"));
    assert_eq!(c.status_code, 2);
    assert!(c.start_unix_nano >= s.start_unix_nano && c.end_unix_nano <= s.end_unix_nano);
    let r = by_id(root_ctx.parent_id);
    assert_eq!(r.parent_span_id, None);
    assert_ne!(r.trace_id, s.trace_id);
    assert_eq!(r.flags & 0x300, 0, "a root has no remote parent");

    exporter.shutdown(Duration::from_secs(5)).await;
    assert_eq!(metrics.exported.get(), 3);
    assert_eq!(metrics.dropped.get(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_sends_what_is_queued() {
    let rx = OtlpReceiver::start().unwrap();
    let metrics = TraceMetrics::default();
    let opts = ExportOptions {
        interval: Duration::from_secs(3600), // only shutdown flushes
        batch_spans: 4,
        ..options()
    };
    let (tracer, exporter) = start(
        OtlpEndpoint::parse(&rx.endpoint()).unwrap(),
        service(),
        opts,
        metrics.clone(),
    );
    for _ in 0..10 {
        tracer.span("x", SpanKind::Internal, None).end();
    }
    exporter.shutdown(Duration::from_secs(5)).await;
    assert_eq!(metrics.exported.get(), 10);
    assert_eq!(rx.spans().len(), 10);
    assert!(rx.requests() >= 3, "batches of at most 4");
    // Spans ended after shutdown go nowhere and are counted.
    tracer.span("late", SpanKind::Internal, None).end();
    assert_eq!(metrics.dropped.get(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_collector_costs_spans_not_the_process() {
    let rx = OtlpReceiver::start().unwrap();
    rx.answer_with(503);
    let metrics = TraceMetrics::default();
    let (tracer, exporter) = start(
        OtlpEndpoint::parse(&rx.endpoint()).unwrap(),
        service(),
        options(),
        metrics.clone(),
    );
    for _ in 0..5 {
        tracer.span("x", SpanKind::Internal, None).end();
    }
    exporter.shutdown(Duration::from_secs(5)).await;
    assert_eq!((metrics.exported.get(), metrics.dropped.get()), (0, 5));
    assert!(metrics.failed_exports.get() >= 1);

    // Nothing listening: the same, within the timeout.
    let metrics = TraceMetrics::default();
    let endpoint = OtlpEndpoint::parse(&format!("http://127.0.0.1:{}", free_port())).unwrap();
    let (tracer, exporter) = start(endpoint, service(), options(), metrics.clone());
    tracer.span("x", SpanKind::Internal, None).end();
    exporter.shutdown(Duration::from_secs(5)).await;
    assert_eq!((metrics.exported.get(), metrics.dropped.get()), (0, 1));
    assert_eq!(metrics.failed_exports.get(), 1);
}

#[test]
fn an_off_tracer_never_starts_a_trace() {
    let t = Tracer::off();
    assert!(!t.is_on());
    assert!(t.span("x", SpanKind::Server, None).context().is_none());
}

//! kvrouter's own trace spans, exported over OTLP/HTTP when an endpoint is configured and
//! not at all when not.
//!
//! A door's request, the replica's route and the engine call are spans of one distributed
//! trace: the W3C trace context travels on HTTP (`traceparent`) and on the bus
//! (`RouteRequest::trace`). [`Tracer`] starts spans; [`start`] runs the exporter that posts
//! them in batches to a collector. The OTLP messages are written here as prost structs
//! ([`proto`]); the test kit's receiver reads them with the `opentelemetry-proto` types.

mod config;
mod exporter;
mod metrics;
pub mod proto;
mod sink;
mod span;
mod tracer;

pub use config::TracesConfig;
pub use exporter::{
    export_request, sample_ratio, start, ExportOptions, Exporter, OtlpEndpoint, OtlpError,
    ServiceInfo,
};
pub use metrics::TraceMetrics;
pub use span::{AttrValue, Span, SpanKind, SAMPLED};
pub use tracer::Tracer;

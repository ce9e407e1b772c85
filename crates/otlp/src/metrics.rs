//! What the exporter counts, registered in the process's own registry.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Default)]
pub struct TraceMetrics {
    pub exported: Counter,
    pub dropped: Counter,
    pub failed_exports: Counter,
}

impl TraceMetrics {
    /// Registers `otlp_spans_exported`, `otlp_spans_dropped` and `otlp_export_failures`
    /// under the registry's prefix.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "otlp_spans_exported",
            "Spans the OTLP collector accepted",
            self.exported.clone(),
        );
        registry.register(
            "otlp_spans_dropped",
            "Spans lost: the export queue was full, or their batch failed to export",
            self.dropped.clone(),
        );
        registry.register(
            "otlp_export_failures",
            "Span batches the OTLP collector did not accept (unreachable, timed out, non-2xx)",
            self.failed_exports.clone(),
        );
    }
}

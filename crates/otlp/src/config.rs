//! What a process is told about traces: where to export (nothing when unset) and how many
//! new traces to sample.

use crate::exporter::{start, ExportOptions, Exporter, OtlpEndpoint, ServiceInfo};
use crate::metrics::TraceMetrics;
use crate::tracer::Tracer;

/// `--otlp-traces-endpoint` and `--otlp-traces-sample-ratio`.
#[derive(Clone, Debug, PartialEq)]
pub struct TracesConfig {
    /// `None`: no spans are recorded or sent; a caller's trace context is still passed on.
    pub endpoint: Option<OtlpEndpoint>,
    /// Share of new traces (requests that come without a `traceparent`) that are recorded;
    /// a caller's sampled flag decides for the rest.
    pub sample_ratio: f64,
}

impl Default for TracesConfig {
    fn default() -> Self {
        Self {
            endpoint: None,
            sample_ratio: 1.0,
        }
    }
}

impl TracesConfig {
    /// The process's tracer, and the exporter to shut down with it when there is an
    /// endpoint. Needs a tokio runtime when there is.
    pub fn start(&self, service: ServiceInfo, metrics: TraceMetrics) -> (Tracer, Option<Exporter>) {
        match &self.endpoint {
            None => (Tracer::off(), None),
            Some(endpoint) => {
                let options = ExportOptions {
                    sample_ratio: self.sample_ratio,
                    ..ExportOptions::default()
                };
                let (tracer, exporter) = start(endpoint.clone(), service, options, metrics);
                (tracer, Some(exporter))
            }
        }
    }
}

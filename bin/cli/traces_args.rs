//! Where a process sends its trace spans: `#[command(flatten)] traces: TracesArgs` in
//! `serve`, `frontend` and `epp`.

use clap::Args;
use kvrouter_otlp::{sample_ratio, OtlpEndpoint, TracesConfig};

#[derive(Args, Clone, Debug)]
pub struct TracesArgs {
    /// Export trace spans to this OTLP/HTTP collector (protobuf; http://host:4318, the path
    /// defaults to /v1/traces). Unset: no spans are recorded or sent, and a caller's
    /// traceparent is still passed on to the next hop.
    #[arg(long, env = "KVROUTER_OTLP_TRACES_ENDPOINT", value_name = "URL",
          value_parser = |s: &str| OtlpEndpoint::parse(s).map_err(|e| e.to_string()))]
    pub otlp_traces_endpoint: Option<OtlpEndpoint>,
    /// Share of new traces recorded (requests that come without a traceparent), 0 to 1; a
    /// caller's sampled flag decides for the others.
    #[arg(long, env = "KVROUTER_OTLP_TRACES_SAMPLE_RATIO", default_value_t = 1.0, value_name = "RATIO",
          value_parser = |s: &str| sample_ratio(s).map_err(|e| e.to_string()))]
    pub otlp_traces_sample_ratio: f64,
}

impl TracesArgs {
    pub fn config(&self) -> TracesConfig {
        TracesConfig {
            endpoint: self.otlp_traces_endpoint.clone(),
            sample_ratio: self.otlp_traces_sample_ratio,
        }
    }
}

//! The frontend's settings and the models it serves.

use std::time::Duration;

pub use kvrouter_openai::RankConvention;

#[derive(Clone, Debug)]
pub struct FrontendConfig {
    /// Requests answered at once; more get 503 with Retry-After.
    pub max_inflight: usize,
    /// Longest a request may take from arrival to its answer's end.
    pub request_timeout: Duration,
    /// Times a request is routed again around an engine that failed it before answering.
    pub route_retries: u32,
    /// Who may call (API keys, none: every caller) and what each caller may use.
    pub access: kvrouter_openai::Access,
    pub ranks: RankConvention,
    /// Largest request body read.
    pub max_body_bytes: usize,
    /// How long connecting to an engine may take.
    pub connect_timeout: Duration,
    /// Bounds on client connections: head, body and idle timeouts, connection cap.
    pub http_limits: kvrouter_admin::HttpLimits,
    /// Request body bytes held at once over all connections (read, not yet parsed); a
    /// body that finds them spent gets 503.
    pub max_buffered_body_bytes: usize,
    /// Where request spans go (`--otlp-traces-endpoint`; none: not recorded, a client's
    /// `traceparent` still passed on).
    pub traces: kvrouter_otlp::TracesConfig,
}

impl Default for FrontendConfig {
    fn default() -> Self {
        Self {
            max_inflight: 1024,
            request_timeout: Duration::from_secs(600),
            route_retries: 2,
            access: kvrouter_openai::Access::default(),
            ranks: RankConvention::Vllm,
            max_body_bytes: 32 << 20,
            connect_timeout: Duration::from_secs(2),
            http_limits: kvrouter_admin::HttpLimits::default(),
            max_buffered_body_bytes: 512 << 20,
            traces: kvrouter_otlp::TracesConfig::default(),
        }
    }
}

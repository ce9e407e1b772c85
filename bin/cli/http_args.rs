//! The HTTP client bounds: one group, flattened into every command that listens (`serve`,
//! `frontend`, `bridge`), so a slow or half-open client is cut the same way everywhere.

use clap::Args;
use kvrouter_admin::HttpLimits;
use std::time::Duration;

#[derive(Args, Clone, Debug)]
pub struct HttpArgs {
    /// Seconds a client may take from a request head's first byte to its end.
    #[arg(
        long,
        env = "KVROUTER_HTTP_HEADER_TIMEOUT_SECS",
        default_value_t = 10.0
    )]
    pub http_header_timeout_secs: f64,
    /// Seconds a client may take to send a request body once its head has come (408 after).
    #[arg(long, env = "KVROUTER_HTTP_BODY_TIMEOUT_SECS", default_value_t = 30.0)]
    pub http_body_timeout_secs: f64,
    /// Seconds a connection may sit with no request in flight before it is closed; also how
    /// long an answer may wait for a client that does not read it.
    #[arg(long, env = "KVROUTER_HTTP_IDLE_TIMEOUT_SECS", default_value_t = 60.0)]
    pub http_idle_timeout_secs: f64,
    /// Client connections open at once per listener; one more is answered 503 and closed.
    #[arg(long, env = "KVROUTER_HTTP_MAX_CONNECTIONS", default_value_t = 4096)]
    pub http_max_connections: usize,
    /// Largest request head (request line and headers) in bytes; a longer one gets 431.
    #[arg(long, env = "KVROUTER_HTTP_MAX_HEADER_BYTES", default_value_t = 64 << 10)]
    pub http_max_header_bytes: usize,
}

impl HttpArgs {
    pub fn limits(&self) -> anyhow::Result<HttpLimits> {
        let secs = |flag: &str, v: f64| -> anyhow::Result<Duration> {
            if !(v.is_finite() && v > 0.0 && v <= 86_400.0) {
                anyhow::bail!("--{flag} must be above 0 and at most 86400 seconds, not {v}");
            }
            Ok(Duration::from_secs_f64(v))
        };
        let limits = HttpLimits {
            header_timeout: secs("http-header-timeout-secs", self.http_header_timeout_secs)?,
            body_timeout: secs("http-body-timeout-secs", self.http_body_timeout_secs)?,
            idle_timeout: secs("http-idle-timeout-secs", self.http_idle_timeout_secs)?,
            max_connections: self.http_max_connections,
            max_header_bytes: self.http_max_header_bytes,
        };
        limits.validate().map_err(anyhow::Error::msg)?;
        Ok(limits)
    }
}

//! `kvrouter frontend`: an OpenAI-compatible HTTP server that tokenizes each request, asks
//! the router replicas where it should run and streams it from that engine.

use super::lifecycle::Lifecycle;
use super::nats_args::NatsArgs;
use super::openai_args::{AccessArgs, DoorArgs, ModelArgs};
use super::renamed_env;
use anyhow::Context;
use clap::Args;
use kvrouter_client::KvRouterClient;
use kvrouter_frontend::{Frontend, FrontendConfig, FrontendServer};
use std::net::SocketAddr;
use std::time::Duration;

#[derive(Args)]
pub struct FrontendArgs {
    #[command(flatten)]
    nats: NatsArgs,
    #[command(flatten)]
    http: super::http_args::HttpArgs,
    #[command(flatten)]
    traces: super::traces_args::TracesArgs,
    /// Where clients connect.
    #[arg(long, env = "KVROUTER_LISTEN", default_value = "0.0.0.0:8000")]
    listen: SocketAddr,
    #[command(flatten)]
    models: ModelArgs,
    /// Requests answered at once; more are refused with 503 and Retry-After.
    #[arg(long, env = "KVROUTER_MAX_INFLIGHT", default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..))]
    max_inflight: u64,
    /// Longest a request may take, arrival to the answer's last byte.
    #[arg(long, env = renamed_env::env("KVROUTER_ENGINE_TIMEOUT_SECS"), default_value_t = 600.0)]
    request_timeout_secs: f64,
    /// Times a request is routed again around an engine that failed it before answering.
    #[arg(long, env = "KVROUTER_ROUTE_RETRIES", default_value_t = 2)]
    route_retries: u32,
    #[command(flatten)]
    access: AccessArgs,
    #[command(flatten)]
    doors: DoorArgs,
    /// Request body bytes held at once over all client connections (read, not yet
    /// parsed); a body that finds them spent gets 503 with Retry-After.
    #[arg(long, env = "KVROUTER_MAX_BUFFERED_BODY_BYTES", default_value_t = 512 << 20)]
    max_buffered_body_bytes: usize,
    /// Seconds a shutdown may take: requests in flight finish within it.
    #[arg(long, env = "KVROUTER_DRAIN_TIMEOUT_SECS", default_value_t = 10.0)]
    drain_timeout_secs: f64,
}

impl FrontendArgs {
    fn config(&self) -> anyhow::Result<FrontendConfig> {
        Ok(FrontendConfig {
            max_inflight: self.max_inflight as usize,
            request_timeout: super::serve::secs("request-timeout-secs", self.request_timeout_secs)?,
            route_retries: self.route_retries,
            access: self.access.access()?,
            ranks: self.doors.engine.ranks(),
            max_body_bytes: self.doors.max_body_bytes,
            http_limits: self.http.limits()?,
            max_buffered_body_bytes: self.max_buffered_body_bytes,
            traces: self.traces.config(),
            ..FrontendConfig::default()
        })
    }
}

pub async fn run(args: FrontendArgs) -> anyhow::Result<()> {
    renamed_env::log_warnings();
    let config = args.config()?;
    let models = args.models.load_models()?;
    let loras = args.models.loras();
    let drain_timeout = super::serve::secs("drain-timeout-secs", args.drain_timeout_secs)?;
    let mut life = Lifecycle::install("frontend", drain_timeout)?;
    let server = life
        .startup(async {
            let bus = args.nats.connect("kvrouter-frontend").await?;
            let client = KvRouterClient::new(bus, &args.nats.namespace)?
                .with_timeout(Duration::from_millis(args.doors.route_timeout_ms.max(1)));
            let frontend =
                Frontend::new(models, loras, client, config).map_err(anyhow::Error::msg)?;
            FrontendServer::start(args.listen, frontend)
                .await
                .with_context(|| format!("cannot listen on {}", args.listen))
        })
        .await?;
    tracing::info!(listen = %server.addr, "frontend serving");
    {
        let line = serde_json::json!({ "listen": server.addr.to_string() });
        super::print_start_line(line)?;
    }
    life.wait().await;
    let drain_budget = life.drain_budget();
    life.shutdown(|| "finishing requests in flight".to_string(), async {
        server.shutdown_within(drain_budget).await;
        Ok(())
    })
    .await
}

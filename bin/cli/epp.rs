//! `kvrouter epp`: kvrouter as a Gateway API Inference Extension endpoint picker. A gateway
//! (Envoy and the Gateway API implementations built on it) asks it over ext_proc, per
//! request, which engine should serve; it answers with the engine the router replicas pick.

use super::lifecycle::Lifecycle;
use super::nats_args::NatsArgs;
use super::openai_args::{AccessArgs, DoorArgs, ModelArgs};
use anyhow::Context;
use clap::Args;
use kvrouter_admin::tls::{ServerTls, TlsFiles};
use kvrouter_client::{KvRouterClient, LeaseCounts};
use kvrouter_epp::{
    EppMetrics, EppServer, ExchangeLimits, ExtProcService, GrpcLimits, Listeners, Picker,
};
use kvrouter_openai::Models;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(Args)]
pub struct EppArgs {
    #[command(flatten)]
    nats: NatsArgs,
    #[command(flatten)]
    traces: super::traces_args::TracesArgs,
    /// Where the gateway's ext_proc filter connects (gRPC over HTTP/2; the Inference
    /// Extension's convention is 9002).
    #[arg(long, env = "KVROUTER_EPP_LISTEN", default_value = "0.0.0.0:9002")]
    listen: SocketAddr,
    /// The gRPC health service (`liveness`, `readiness`; the convention is 9003).
    #[arg(
        long,
        env = "KVROUTER_EPP_HEALTH_LISTEN",
        default_value = "0.0.0.0:9003"
    )]
    health_listen: SocketAddr,
    /// The admin listener: /metrics, /healthz, /readyz (the convention is 9090).
    #[arg(long, env = "KVROUTER_ADMIN_ADDR", default_value = "0.0.0.0:9090")]
    admin_addr: SocketAddr,
    /// The ext_proc listener's TLS certificate chain (PEM); the gateway connects over TLS
    /// (h2). Without it, --plaintext must be given.
    #[arg(
        long,
        env = "KVROUTER_EPP_TLS_CERT",
        requires = "tls_key",
        conflicts_with = "plaintext"
    )]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM: PKCS#8, PKCS#1 or SEC1).
    #[arg(long, env = "KVROUTER_EPP_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// With --tls-cert: the gateway must present a certificate this CA signed (mTLS).
    #[arg(long, env = "KVROUTER_EPP_TLS_CLIENT_CA", requires = "tls_cert")]
    tls_client_ca: Option<PathBuf>,
    /// Serve ext_proc without TLS (a gateway beside it on a trusted network, local use).
    #[arg(long, env = "KVROUTER_EPP_PLAINTEXT")]
    plaintext: bool,
    #[command(flatten)]
    models: ModelArgs,
    #[command(flatten)]
    access: AccessArgs,
    #[command(flatten)]
    doors: DoorArgs,
    /// Exchanges (requests) open at once over every gateway connection; more get 429.
    #[arg(long, env = "KVROUTER_MAX_INFLIGHT", default_value_t = 4096, value_parser = clap::value_parser!(u64).range(1..))]
    max_inflight: u64,
    /// Endpoints answered after the pick, the next best by cost, for the gateway to retry
    /// on when the pick fails (0: the pick alone; at most 8).
    #[arg(long, env = "KVROUTER_EPP_FALLBACKS", default_value_t = 2, value_parser = clap::value_parser!(u8).range(0..=8))]
    fallbacks: u8,
    /// Seconds from a request's start to its last body byte: a request read slower (a
    /// client dripping its body) is answered 408 and frees its place.
    #[arg(
        long,
        env = "KVROUTER_EPP_REQUEST_READ_TIMEOUT_SECS",
        default_value_t = 30.0
    )]
    request_read_timeout_secs: f64,
    /// Request body bytes held at once over every request (each holds its body until it is
    /// routed); a request past it is shed (429). Bounds memory whatever the gateway sends.
    #[arg(long, env = "KVROUTER_EPP_MAX_BUFFERED_BYTES", default_value_t = 1 << 30, value_parser = clap::value_parser!(u64).range(1..))]
    max_buffered_bytes: u64,
    /// Requests one gateway connection may have in flight.
    #[arg(long, env = "KVROUTER_EPP_MAX_STREAMS", default_value_t = 4096, value_parser = clap::value_parser!(u32).range(1..))]
    max_streams: u32,
    /// Seconds a shutdown may take: exchanges in flight finish within it.
    #[arg(long, env = "KVROUTER_DRAIN_TIMEOUT_SECS", default_value_t = 10.0)]
    drain_timeout_secs: f64,
}

pub async fn run(args: EppArgs) -> anyhow::Result<()> {
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(
            ServerTls::load_for(
                &TlsFiles {
                    cert: cert.clone(),
                    key: key.clone(),
                    client_ca: args.tls_client_ca.clone(),
                },
                &[b"h2"],
            )
            .context("cannot use the ext_proc listener's TLS files (--tls-cert, --tls-key)")?,
        ),
        _ if args.plaintext => None,
        _ => anyhow::bail!(
            "the ext_proc listener needs --tls-cert and --tls-key (KVROUTER_EPP_TLS_CERT, \
             KVROUTER_EPP_TLS_KEY), or --plaintext for a gateway on a trusted network"
        ),
    };
    let models = args.models.load_models()?;
    let probe_model = models[0].name().to_string();
    let models = Models::new(models, args.models.loras(), args.doors.max_body_bytes)
        .map_err(anyhow::Error::msg)?;
    let access = args.access.access()?;
    let drain_timeout = super::serve::secs("drain-timeout-secs", args.drain_timeout_secs)?;
    let read_timeout =
        super::serve::secs("request-read-timeout-secs", args.request_read_timeout_secs)?;
    let mut life = Lifecycle::install("epp", drain_timeout)?;
    let (server, admin, (admin_task, exporter)) = life
        .startup(async {
            let bus = args.nats.connect("kvrouter-epp").await?;
            let router = KvRouterClient::new(bus, &args.nats.namespace)?
                .with_timeout(Duration::from_millis(args.doors.route_timeout_ms.max(1)));
            // Workers by endpoint: the subset hint, fallbacks, the endpoint that served.
            let directory = kvrouter_epp::directory::follow_models(
                &router,
                models.names().into_iter().map(|(n, _)| n),
            )
            .await?;
            let leases = Arc::new(LeaseCounts::default());
            let metrics = Arc::new(EppMetrics::new(leases.clone()));
            let (tracer, exporter) = args.traces.config().start(
                kvrouter_otlp::ServiceInfo {
                    name: "kvrouter-epp".into(),
                    instance_id: kvrouter_client::new_request_id(),
                },
                metrics.traces.clone(),
            );
            let picker = Picker {
                tracer,
                directory,
                models,
                access,
                router: router.clone(),
                ranks: args.doors.engine.ranks(),
                leases,
                fallbacks: args.fallbacks,
            };
            let (admin, _, admin_task) = kvrouter_admin::serve(
                args.admin_addr,
                kvrouter_admin::HttpLimits::default(),
                metrics.clone(),
            )
            .await
            .with_context(|| format!("cannot listen on {} (--admin-addr)", args.admin_addr))?;
            let service = ExtProcService::new(
                Arc::new(picker),
                metrics.clone(),
                ExchangeLimits {
                    max_body_bytes: args.doors.max_body_bytes,
                    max_inflight: args.max_inflight as usize,
                    read_timeout,
                    max_buffered_bytes: usize::try_from(args.max_buffered_bytes)
                        .unwrap_or(usize::MAX),
                },
            );
            let limits = GrpcLimits {
                max_concurrent_streams: args.max_streams,
                ..GrpcLimits::default()
            };
            let at = Listeners {
                ext_proc: args.listen,
                health: args.health_listen,
                tls,
                limits,
            };
            let server = EppServer::start(at, service, router, probe_model, metrics)
                .await
                .with_context(|| {
                    format!(
                        "cannot listen on {} and {}",
                        args.listen, args.health_listen
                    )
                })?;
            anyhow::Ok((server, admin, (admin_task, exporter)))
        })
        .await?;
    tracing::info!(listen = %server.addr, health = %server.health_addr, admin = %admin, "endpoint picker serving");
    {
        let line = serde_json::json!({
            "listen": server.addr.to_string(),
            "health": server.health_addr.to_string(),
            "admin": admin.to_string(),
        });
        super::print_start_line(line)?;
    }
    life.wait().await;
    let drain_budget = life.drain_budget();
    life.shutdown(|| "finishing exchanges in flight".to_string(), async {
        server.shutdown_within(drain_budget).await;
        if let Some(e) = exporter {
            e.shutdown(Duration::from_secs(2)).await;
        }
        admin_task.abort();
        Ok(())
    })
    .await
}

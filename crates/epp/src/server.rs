//! The endpoint picker's listeners: ext_proc (gRPC, HTTP/2) for the gateway, and the
//! standard gRPC health service on a port of its own: `liveness` answers while the process
//! runs; `readiness` (and the empty name, and the ext_proc service's) while a router
//! replica answers for the model.

use crate::ext_proc::SERVICE_NAME;
use crate::metrics::EppMetrics;
use crate::service::{ExtProcServer, ExtProcService};
use crate::tls_incoming::tls_incoming;
use kvrouter_admin::tls::ServerTls;
use kvrouter_client::KvRouterClient;
use kvrouter_protocol::OverlapRequest;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::transport::server::TcpIncoming;
use tonic::transport::Server;
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

/// How often readiness asks the replicas.
const READINESS_EVERY: Duration = Duration::from_secs(1);

/// HTTP/2 flow-control windows of the ext_proc listener: 1 MiB a stream, 16 MiB a
/// connection (h2's default is 64 KiB for both).
const STREAM_WINDOW_BYTES: u32 = 1 << 20;
const CONNECTION_WINDOW_BYTES: u32 = 16 << 20;

/// Limits on what the gateway's connections may hold.
#[derive(Clone, Copy, Debug)]
pub struct GrpcLimits {
    /// Streams (requests in flight) one connection may have open.
    pub max_concurrent_streams: u32,
    /// Largest header block, in bytes.
    pub max_header_list_bytes: u32,
    /// HTTP/2 pings to find dead connections.
    pub keepalive: Duration,
}

impl Default for GrpcLimits {
    fn default() -> Self {
        Self {
            max_concurrent_streams: 4096,
            max_header_list_bytes: 64 << 10,
            keepalive: Duration::from_secs(20),
        }
    }
}

pub struct EppServer {
    pub addr: SocketAddr,
    pub health_addr: SocketAddr,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    service: ExtProcService,
    metrics: Arc<EppMetrics>,
}

/// Where and how the picker listens.
pub struct Listeners {
    /// ext_proc, for the gateway.
    pub ext_proc: SocketAddr,
    /// The gRPC health service.
    pub health: SocketAddr,
    /// ext_proc over TLS (h2); `None`: plaintext.
    pub tls: Option<ServerTls>,
    pub limits: GrpcLimits,
}

impl EppServer {
    /// Binds both listeners (port 0 picks one) and serves until
    /// [`EppServer::shutdown_within`]. Readiness asks `router` for an overlap of
    /// `probe_model` every second.
    pub async fn start(
        at: Listeners,
        service: ExtProcService,
        router: KvRouterClient,
        probe_model: String,
        metrics: Arc<EppMetrics>,
    ) -> std::io::Result<Self> {
        let Listeners {
            ext_proc: listen,
            health,
            tls,
            limits,
        } = at;
        let listener = std::net::TcpListener::bind(listen)?;
        listener.set_nonblocking(true)?;
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let addr = listener.local_addr()?;
        let health_incoming = TcpIncoming::bind(health)?;
        let health_addr = health_incoming.local_addr()?;
        let (reporter, health_service) = tonic_health::server::health_reporter();
        reporter
            .set_service_status("liveness", ServingStatus::Serving)
            .await;
        set_ready(&reporter, false).await;
        let (stop, stopped) = watch::channel(false);
        let until = |mut rx: watch::Receiver<bool>| async move {
            let _ = rx.wait_for(|s| *s).await;
        };
        let mut tasks = Vec::new();
        let builder = Server::builder()
            .max_concurrent_streams(limits.max_concurrent_streams)
            .http2_max_header_list_size(limits.max_header_list_bytes)
            .http2_keepalive_interval(Some(limits.keepalive))
            .http2_keepalive_timeout(Some(limits.keepalive))
            // A request body (an 8k-token prompt is about 60 KB) fits one stream's window, so
            // Envoy need not wait for a window update mid-body; the connection's window
            // bounds what all its streams may have in flight.
            .initial_stream_window_size(Some(STREAM_WINDOW_BYTES))
            .initial_connection_window_size(Some(CONNECTION_WINDOW_BYTES));
        let svc = ExtProcServer(service.clone());
        let stop_serving = until(stopped.clone());
        tasks.push(match tls {
            Some(tls) => tokio::spawn(async move {
                let incoming = tls_incoming(listener, tls);
                if let Err(e) = builder
                    .serve_with_incoming_shutdown(svc, incoming, stop_serving)
                    .await
                {
                    tracing::error!(error = %e, "the ext_proc listener failed");
                }
            }),
            None => tokio::spawn(async move {
                let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
                if let Err(e) = builder
                    .serve_with_incoming_shutdown(svc, incoming, stop_serving)
                    .await
                {
                    tracing::error!(error = %e, "the ext_proc listener failed");
                }
            }),
        });
        let health_server = Server::builder().serve_with_incoming_shutdown(
            health_service,
            health_incoming,
            until(stopped.clone()),
        );
        tasks.push(tokio::spawn(async move {
            if let Err(e) = health_server.await {
                tracing::error!(error = %e, "the gRPC health listener failed");
            }
        }));
        let mut stopping = stopped;
        let probe_metrics = metrics.clone();
        tasks.push(tokio::spawn(async move {
            let metrics = probe_metrics;
            let mut ready = false;
            loop {
                let probe = OverlapRequest {
                    model: probe_model.clone(),
                    tokens: vec![0],
                    lora: None,
                };
                let now = router.overlap_scores(&probe).await.is_ok();
                metrics.ready.store(now, Ordering::Relaxed);
                if now != ready {
                    ready = now;
                    set_ready(&reporter, ready).await;
                    tracing::info!(
                        ready,
                        "endpoint picker readiness (a router replica answers)"
                    );
                }
                let woke = tokio::select! {
                    r = stopping.changed() => r.is_err() || *stopping.borrow(),
                    _ = tokio::time::sleep(READINESS_EVERY) => false,
                };
                if woke {
                    metrics.ready.store(false, Ordering::Relaxed);
                    set_ready(&reporter, false).await;
                    return;
                }
            }
        }));
        Ok(Self {
            addr,
            health_addr,
            stop,
            tasks,
            service,
            metrics,
        })
    }

    /// Stops taking exchanges; those open get half of `within` to end by themselves, then
    /// are ended, each freeing its booking before the rest of `within` runs out.
    pub async fn shutdown_within(self, within: Duration) {
        let deadline = tokio::time::Instant::now() + within;
        let _ = self.stop.send(true);
        let patience = tokio::time::Instant::now() + within / 2;
        while self.metrics.open.get() > 0 && tokio::time::Instant::now() < patience {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let open = self.metrics.open.get();
        if open > 0 {
            tracing::info!(
                open,
                "ending the exchanges still open; their bookings are freed"
            );
        }
        self.service.end_all();
        while self.metrics.open.get() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let all = futures_util::future::join_all(self.tasks);
        if tokio::time::timeout_at(deadline, all).await.is_err() {
            tracing::warn!(?within, "listeners still open at the end of the drain");
        }
    }
}

async fn set_ready(reporter: &HealthReporter, ready: bool) {
    let status = if ready {
        ServingStatus::Serving
    } else {
        ServingStatus::NotServing
    };
    for name in ["", "readiness", SERVICE_NAME] {
        reporter.set_service_status(name, status).await;
    }
}

//! The exporter: a task that takes ended spans from a bounded queue and posts them in
//! batches to an OTLP/HTTP collector (`POST /v1/traces`, protobuf). A span that finds the
//! queue full, or whose batch the collector does not take, is dropped and counted: tracing
//! never holds a request up or grows without bound.

use crate::metrics::TraceMetrics;
use crate::proto::{self, KeyValue, Value};
use crate::tracer::Tracer;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::Uri;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use prost::Message;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

/// Why traces cannot be exported as configured.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum OtlpError {
    #[error("OTLP traces endpoint {0:?} is not a URL")]
    NotAUrl(String),
    #[error("OTLP traces endpoint {0:?}: only http:// is supported (run a collector in the pod or cluster and point kvrouter at its OTLP/HTTP port, usually 4318)")]
    Scheme(String),
    #[error("OTLP traces endpoint {0:?} names no host")]
    NoHost(String),
    #[error("trace sample ratio {0} is not between 0 and 1")]
    SampleRatio(String),
}

/// Where spans go: an OTLP/HTTP collector's traces URL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OtlpEndpoint(Uri);

impl OtlpEndpoint {
    /// `http://host:port/path`, used as given; a URL without a path gets OTLP's
    /// `/v1/traces`.
    pub fn parse(s: &str) -> Result<Self, OtlpError> {
        let uri: Uri = s.trim().parse().map_err(|_| OtlpError::NotAUrl(s.into()))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some(_) => return Err(OtlpError::Scheme(s.into())),
            None => return Err(OtlpError::NotAUrl(s.into())),
        }
        if uri.host().is_none_or(str::is_empty) {
            return Err(OtlpError::NoHost(s.into()));
        }
        if matches!(uri.path(), "" | "/") && uri.query().is_none() {
            let with_path = format!("http://{}/v1/traces", uri.authority().expect("has a host"));
            return Ok(Self(with_path.parse().expect("a valid URL")));
        }
        Ok(Self(uri))
    }

    pub fn uri(&self) -> &Uri {
        &self.0
    }
}

impl std::fmt::Display for OtlpEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// Checks a sample ratio (0 to 1).
pub fn sample_ratio(s: &str) -> Result<f64, OtlpError> {
    match s.trim().parse::<f64>() {
        Ok(r) if (0.0..=1.0).contains(&r) => Ok(r),
        _ => Err(OtlpError::SampleRatio(s.into())),
    }
}

/// Who exports: the process's `service.name` (`kvrouter-frontend`, `kvrouter-replica`,
/// ...) and `service.instance.id` (the replica or door id).
#[derive(Clone, Debug)]
pub struct ServiceInfo {
    pub name: String,
    pub instance_id: String,
}

/// How the exporter batches.
#[derive(Clone, Debug)]
pub struct ExportOptions {
    pub sample_ratio: f64,
    /// Ended spans held for export at most; more are dropped.
    pub queue_spans: usize,
    /// Spans per request at most.
    pub batch_spans: usize,
    /// How long an ended span waits at most for its batch to fill.
    pub interval: Duration,
    /// A collector that has not answered a batch in this time has failed it.
    pub timeout: Duration,
}

impl Default for ExportOptions {
    fn default() -> Self {
        Self {
            sample_ratio: 1.0,
            queue_spans: 4096,
            batch_spans: 512,
            interval: Duration::from_millis(500),
            timeout: Duration::from_secs(5),
        }
    }
}

/// The request body for `spans`, as the collector reads it.
pub fn export_request(service: &ServiceInfo, spans: Vec<proto::Span>) -> Vec<u8> {
    let resource = proto::Resource {
        attributes: vec![
            KeyValue::new("service.name", Value::String(service.name.clone())),
            KeyValue::new(
                "service.instance.id",
                Value::String(service.instance_id.clone()),
            ),
            KeyValue::new(
                "service.version",
                Value::String(env!("CARGO_PKG_VERSION").into()),
            ),
        ],
    };
    proto::ExportTraceServiceRequest {
        resource_spans: vec![proto::ResourceSpans {
            resource: Some(resource),
            scope_spans: vec![proto::ScopeSpans {
                scope: Some(proto::InstrumentationScope {
                    name: "kvrouter".into(),
                    version: env!("CARGO_PKG_VERSION").into(),
                }),
                spans,
            }],
        }],
    }
    .encode_to_vec()
}

/// The running exporter. [`Exporter::shutdown`] sends what is queued before the process
/// exits.
pub struct Exporter {
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

/// Starts the exporter task on the current tokio runtime; the tracer feeds it.
pub fn start(
    endpoint: OtlpEndpoint,
    service: ServiceInfo,
    options: ExportOptions,
    metrics: TraceMetrics,
) -> (Tracer, Exporter) {
    let (tx, rx) = mpsc::channel(options.queue_spans.max(1));
    let (stop, stopped) = oneshot::channel();
    let tracer = Tracer::exporting(tx, options.sample_ratio, metrics.clone());
    tracing::info!(%endpoint, service = %service.name, ratio = options.sample_ratio, "exporting traces over OTLP/HTTP");
    let post = Poster::new(endpoint, service, options.timeout, metrics);
    let task = tokio::spawn(run(rx, stopped, post, options));
    (tracer, Exporter { stop, task })
}

impl Exporter {
    /// Sends the spans already ended, waiting at most `timeout`.
    pub async fn shutdown(self, timeout: Duration) {
        let _ = self.stop.send(());
        if tokio::time::timeout(timeout, self.task).await.is_err() {
            tracing::warn!("OTLP exporter did not finish sending spans in time; the rest are lost");
        }
    }
}

async fn run(
    mut rx: mpsc::Receiver<proto::Span>,
    mut stopped: oneshot::Receiver<()>,
    mut post: Poster,
    options: ExportOptions,
) {
    let max = options.batch_spans.max(1);
    let mut batch: Vec<proto::Span> = Vec::with_capacity(max);
    let mut tick = tokio::time::interval(options.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let room = max - batch.len();
        tokio::select! {
            biased;
            _ = &mut stopped => break,
            n = rx.recv_many(&mut batch, room) => {
                if n == 0 {
                    break; // every tracer is gone
                }
                if batch.len() >= max {
                    post.send(std::mem::take(&mut batch)).await;
                }
            }
            _ = tick.tick() => {
                if !batch.is_empty() {
                    post.send(std::mem::take(&mut batch)).await;
                }
            }
        }
    }
    // What is queued now goes out, in batches; spans that end later find no one and drop.
    rx.close();
    while let Some(span) = rx.recv().await {
        batch.push(span);
        if batch.len() >= max {
            post.send(std::mem::take(&mut batch)).await;
        }
    }
    if !batch.is_empty() {
        post.send(batch).await;
    }
}

/// Posts batches, one at a time.
struct Poster {
    client: Client<HttpConnector, Full<Bytes>>,
    endpoint: OtlpEndpoint,
    service: ServiceInfo,
    timeout: Duration,
    metrics: TraceMetrics,
    failing: bool,
}

impl Poster {
    fn new(
        endpoint: OtlpEndpoint,
        service: ServiceInfo,
        timeout: Duration,
        metrics: TraceMetrics,
    ) -> Self {
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        http.set_connect_timeout(Some(timeout));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .pool_max_idle_per_host(1)
            .build(http);
        Self {
            client,
            endpoint,
            service,
            timeout,
            metrics,
            failing: false,
        }
    }

    async fn send(&mut self, spans: Vec<proto::Span>) {
        let n = spans.len() as u64;
        let body = export_request(&self.service, spans);
        match tokio::time::timeout(self.timeout, self.post(body)).await {
            Ok(Ok(())) => {
                self.metrics.exported.inc_by(n);
                if std::mem::take(&mut self.failing) {
                    tracing::info!(endpoint = %self.endpoint, "OTLP collector takes spans again");
                }
            }
            outcome => {
                let why = match outcome {
                    Ok(Err(e)) => e,
                    _ => format!("no answer within {:?}", self.timeout),
                };
                self.metrics.failed_exports.inc();
                self.metrics.dropped.inc_by(n);
                // Once per outage at warn: a down collector must not flood the logs.
                if !std::mem::replace(&mut self.failing, true) {
                    tracing::warn!(endpoint = %self.endpoint, error = %why, spans = n, "OTLP collector did not take spans; dropping them until it does (kvrouter_*_otlp_spans_dropped_total counts)");
                } else {
                    tracing::debug!(endpoint = %self.endpoint, error = %why, spans = n, "OTLP export failed");
                }
            }
        }
    }

    async fn post(&self, body: Vec<u8>) -> Result<(), String> {
        let req = hyper::Request::post(self.endpoint.uri().clone())
            .header(hyper::header::CONTENT_TYPE, "application/x-protobuf")
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| e.to_string())?;
        let resp = self.client.request(req).await.map_err(|e| e.to_string())?;
        let status = resp.status();
        // Read the (small) answer so the connection is reused; a huge one is not held.
        let _ = Limited::new(resp.into_body(), 64 << 10).collect().await;
        if status.is_success() {
            Ok(())
        } else {
            Err(format!("HTTP {status}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_checked_and_get_the_traces_path() {
        let e = OtlpEndpoint::parse("http://collector:4318").unwrap();
        assert_eq!(e.to_string(), "http://collector:4318/v1/traces");
        let e = OtlpEndpoint::parse("http://10.0.0.1:4318/").unwrap();
        assert_eq!(e.to_string(), "http://10.0.0.1:4318/v1/traces");
        let e = OtlpEndpoint::parse("http://c:9/custom/path").unwrap();
        assert_eq!(e.uri().path(), "/custom/path");
        assert!(matches!(
            OtlpEndpoint::parse("https://c:4318"),
            Err(OtlpError::Scheme(_))
        ));
        assert!(matches!(
            OtlpEndpoint::parse("grpc://c:4317"),
            Err(OtlpError::Scheme(_))
        ));
        assert!(OtlpEndpoint::parse("collector:4318").is_err());
        assert!(OtlpEndpoint::parse("not a url").is_err());
        assert!(OtlpEndpoint::parse("").is_err());
    }

    #[test]
    fn sample_ratios_are_between_zero_and_one() {
        assert_eq!(sample_ratio("0.25"), Ok(0.25));
        assert_eq!(sample_ratio("1"), Ok(1.0));
        for bad in ["-0.1", "1.5", "NaN", "x", ""] {
            assert!(sample_ratio(bad).is_err(), "{bad}");
        }
    }
}

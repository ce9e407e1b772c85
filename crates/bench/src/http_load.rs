//! Open-loop HTTP load for the benches that measure what a door adds (`bench frontend`,
//! `bench epp`): an engine stand-in with fixed timing ([`StubEngine`]) registered by a real
//! bridge ([`BridgedStub`]), streaming `/v1/completions` bodies with token-id prompts, and
//! runs paced by intended send time ([`open_loop`]), each latency measured from that time so
//! a stalled door shows in the tail, not as a slower sender.

use crate::route_latency::{intended_send_time, scheduled_count, us, LatencySummary, PromptSource};
use crate::stats::Spread;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use kvrouter_bridge::{Bridge, BridgeConfig};
use kvrouter_bus::{Bus, NatsOptions};
use kvrouter_protocol::EngineKind;
use kvrouter_replica::{Replica, ReplicaConfig};
use serde::Serialize;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The model name the benches serve.
pub const MODEL: &str = "bench";

/// Why a door bench (`bench frontend`, `bench epp`) could not run.
#[derive(Debug, thiserror::Error)]
pub enum DoorBenchError {
    #[error("{0}")]
    Config(String),
    #[error("cannot load the model directory: {0}")]
    Model(String),
    #[error("cannot start the {what}: {message}")]
    Start { what: &'static str, message: String },
    #[error("the {0} did not see every engine within 20 s")]
    NotReady(&'static str),
    #[error("warm-up request through the {path} failed: {message}")]
    WarmUp { path: &'static str, message: String },
}

/// A [`DoorBenchError::Start`] of `what`, from a message.
pub fn start_err(what: &'static str) -> impl Fn(String) -> DoorBenchError {
    move |message| DoorBenchError::Start { what, message }
}

/// The load a door bench sends, and where its parts talk.
#[derive(Clone, Debug)]
pub struct LoadConfig {
    /// Requests per second of each measured pair of runs.
    pub rates: Vec<f64>,
    /// Pairs of runs at each rate (the baseline path, then the measured one).
    pub runs: usize,
    pub duration: Duration,
    /// Token ids per prompt.
    pub prompt_tokens: usize,
    /// Chunks each answer streams.
    pub output_tokens: usize,
    /// The engine stand-ins' time between chunks.
    pub engine_itl: Duration,
    /// NATS to route over; `None` for the in-process bus.
    pub nats: Option<NatsOptions>,
    pub seed: u64,
}

impl LoadConfig {
    pub fn validate(&self) -> Result<(), DoorBenchError> {
        let bad = |m: &str| Err(DoorBenchError::Config(m.to_string()));
        if self.rates.is_empty() || self.rates.iter().any(|r| !(r.is_finite() && *r > 0.0)) {
            return bad("every rate must be a positive number of requests per second");
        }
        if self.runs == 0 || self.duration.is_zero() {
            return bad("--runs must be at least 1 and --duration above 0");
        }
        if self.prompt_tokens == 0 || self.output_tokens == 0 {
            return bad("--prompt-tokens and --output-tokens must be at least 1");
        }
        Ok(())
    }

    /// `nats` or `in-process`, for reports.
    pub fn bus_name(&self) -> &'static str {
        if self.nats.is_some() {
            "nats"
        } else {
            "in-process"
        }
    }

    /// A connection for one component: its own to NATS, or a handle on `local`.
    pub async fn connect(&self, local: &Bus, name: &'static str) -> Result<Bus, DoorBenchError> {
        bus(&self.nats, local, name)
            .await
            .map_err(start_err("NATS connection"))
    }

    /// The request bodies of every run.
    pub fn bodies(&self) -> Arc<Vec<Bytes>> {
        Arc::new(completion_bodies(
            self.prompt_tokens,
            self.output_tokens,
            self.seed,
        ))
    }

    /// Every rate's pairs of runs, `baseline` then `measured`.
    pub async fn paired_runs(
        &self,
        client: &HttpClient,
        paths: (&str, &str),
        bodies: &Arc<Vec<Bytes>>,
    ) -> Vec<RateReport> {
        paired_runs(client, paths, bodies, &self.rates, self.runs, self.duration).await
    }
}

/// One open-loop run on one path.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PathRun {
    pub sent: u64,
    pub ok: u64,
    pub failed: u64,
    /// Intended send time to the answer's first body bytes.
    pub ttft: LatencySummary,
    /// Intended send time to the answer's end.
    pub end: LatencySummary,
    /// Answers ended per second over the run.
    pub achieved_rate: f64,
    /// This process's CPU time over the run's wall time, in cores (2.0 = both of a 2-core
    /// machine's), everything included: client, frontend, replica, bridge, engine.
    pub cpu_cores: Option<f64>,
}

/// An engine stand-in: `/health` and `/metrics` answer 200; `POST /v1/completions` reads
/// the body, then streams `chunks` completion chunks `itl` apart, a usage chunk and
/// `[DONE]`.
pub struct StubEngine {
    pub addr: std::net::SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl StubEngine {
    pub async fn start(chunks: usize, itl: Duration) -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let _ = stream.set_nodelay(true);
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| async move {
                        Ok::<_, Infallible>(stub_answer(req, chunks, itl).await)
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Ok(Self { addr, task })
    }

    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for StubEngine {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type StubBody = http_body_util::combinators::BoxBody<Bytes, Infallible>;

async fn stub_answer(req: Request<Incoming>, chunks: usize, itl: Duration) -> Response<StubBody> {
    let plain = |status: u16, body: &'static str| {
        let mut r = Response::new(Full::new(Bytes::from_static(body.as_bytes())).boxed());
        *r.status_mut() = hyper::StatusCode::from_u16(status).expect("a valid status");
        r
    };
    if req.uri().path() != "/v1/completions" {
        return plain(200, "");
    }
    // Read the whole prompt, as an engine must before it can start.
    if req.into_body().collect().await.is_err() {
        return plain(400, "unreadable body");
    }
    let stream = futures_util::stream::unfold(0usize, move |i| async move {
        let data = match i {
            _ if i > chunks + 1 => return None,
            _ if i == chunks + 1 => Bytes::from_static(b"data: [DONE]\n\n"),
            _ if i == chunks => Bytes::from(format!(
                "data: {{\"id\":\"cmpl-stub\",\"object\":\"text_completion\",\"created\":0,\"model\":\"{MODEL}\",\"choices\":[],\"usage\":{{\"prompt_tokens\":0,\"completion_tokens\":{chunks},\"total_tokens\":{chunks}}}}}\n\n"
            )),
            _ => {
                if i > 0 {
                    tokio::time::sleep(itl).await;
                }
                let finish = if i + 1 == chunks {
                    "\"length\""
                } else {
                    "null"
                };
                Bytes::from(format!(
                    "data: {{\"id\":\"cmpl-stub\",\"object\":\"text_completion\",\"created\":0,\"model\":\"{MODEL}\",\"choices\":[{{\"index\":0,\"text\":\" tok\",\"logprobs\":null,\"finish_reason\":{finish}}}]}}\n\n"
                ))
            }
        };
        Some((Ok::<_, Infallible>(Frame::data(data)), i + 1))
    });
    let mut r = Response::new(BodyExt::boxed(StreamBody::new(stream)));
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/event-stream"),
    );
    r
}

/// What one request measured, from its intended send time.
struct Sample {
    ok: bool,
    ttft_us: u64,
    end_us: u64,
    done: Instant,
}

pub type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

/// Sends one request and reads its answer to the end; `(first bytes, end)` instants, or
/// `None` for a failure (a non-200, a broken stream, no `[DONE]`).
pub async fn one_request(
    client: &HttpClient,
    url: &str,
    body: Bytes,
) -> Option<(Instant, Instant)> {
    let req = Request::post(url)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(body))
        .ok()?;
    let res = client.request(req).await.ok()?;
    if !res.status().is_success() {
        return None;
    }
    let mut body = res.into_body();
    let mut first = None;
    let mut tail = Vec::new();
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.ok()?.into_data() else {
            continue;
        };
        first.get_or_insert_with(Instant::now);
        // Keep the last bytes only: enough to see `[DONE]`.
        tail.extend_from_slice(&data);
        if tail.len() > 64 {
            tail.drain(..tail.len() - 64);
        }
    }
    let end = Instant::now();
    let done = tail.windows(6).any(|w| w == b"[DONE]");
    done.then_some((first?, end))
}

/// This process's user + system CPU time (Linux `/proc/self/stat`, 100 ticks a second).
pub fn cpu_time() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which may hold spaces) start at the state, field 3.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(Duration::from_millis((utime + stime) * 10))
}

/// One open-loop run: `bodies` cycled at `rate` to `url` for `duration`.
pub async fn open_loop(
    client: &HttpClient,
    url: &str,
    bodies: &Arc<Vec<Bytes>>,
    rate: f64,
    duration: Duration,
) -> PathRun {
    let total = scheduled_count(rate, duration);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Sample>();
    let handle = tokio::runtime::Handle::current();
    let start = Instant::now() + Duration::from_millis(20);
    let cpu_before = cpu_time();
    let pacer = {
        let (client, url, bodies) = (client.clone(), url.to_string(), bodies.clone());
        std::thread::Builder::new()
            .name("bench-pacer".into())
            .spawn(move || {
                for i in 0..total {
                    let intended = intended_send_time(start, rate, i);
                    let now = Instant::now();
                    if intended > now {
                        std::thread::sleep(intended - now);
                    }
                    let body = bodies[i as usize % bodies.len()].clone();
                    let (client, url, tx) = (client.clone(), url.clone(), tx.clone());
                    handle.spawn(async move {
                        let r = one_request(&client, &url, body).await;
                        let done = Instant::now();
                        let (ttft, end) = r.unwrap_or((done, done));
                        let _ = tx.send(Sample {
                            ok: r.is_some(),
                            ttft_us: us(ttft.saturating_duration_since(intended)),
                            end_us: us(end.saturating_duration_since(intended)),
                            done,
                        });
                    });
                }
            })
            .expect("a pacing thread starts")
    };
    let mut ttft = Vec::new();
    let mut end = Vec::new();
    let (mut failed, mut last) = (0, start);
    while let Some(s) = rx.recv().await {
        last = last.max(s.done);
        if s.ok {
            ttft.push(s.ttft_us);
            end.push(s.end_us);
        } else {
            failed += 1;
        }
    }
    let _ = tokio::task::spawn_blocking(move || pacer.join()).await;
    let wall = last.saturating_duration_since(start);
    let cpu_cores = match (cpu_before, cpu_time()) {
        (Some(a), Some(b)) if !wall.is_zero() => {
            Some(b.saturating_sub(a).as_secs_f64() / wall.as_secs_f64())
        }
        _ => None,
    };
    PathRun {
        sent: total,
        ok: ttft.len() as u64,
        failed,
        ttft: LatencySummary::from_samples(&mut ttft),
        end: LatencySummary::from_samples(&mut end),
        achieved_rate: (total as f64) / wall.as_secs_f64().max(1e-9),
        cpu_cores,
    }
}

/// A baseline run and a measured run at one rate, and what the measured path added.
#[derive(Clone, Debug, Serialize)]
pub struct PairRun {
    pub baseline: PathRun,
    pub measured: PathRun,
    /// Measured percentile minus baseline percentile, in µs (negative when noise wins).
    pub added_ttft_p50_us: i64,
    pub added_ttft_p99_us: i64,
    pub added_end_p99_us: i64,
}

/// Every pair of runs at one rate, and the spread of what the measured path added.
#[derive(Clone, Debug, Serialize)]
pub struct RateReport {
    pub rate: f64,
    pub runs: Vec<PairRun>,
    pub added_ttft_p50_us: Spread,
    pub added_ttft_p99_us: Spread,
    pub added_end_p99_us: Spread,
}

/// At each rate, `runs` pairs of open-loop runs of `duration`: one to `baseline`, then one
/// to `measured` (interleaved, so drift on the machine hits both alike).
pub async fn paired_runs(
    client: &HttpClient,
    (baseline, measured): (&str, &str),
    bodies: &Arc<Vec<Bytes>>,
    rates: &[f64],
    runs: usize,
    duration: Duration,
) -> Vec<RateReport> {
    let mut out = Vec::new();
    for &rate in rates {
        let mut pairs = Vec::new();
        for _ in 0..runs {
            let b = open_loop(client, baseline, bodies, rate, duration).await;
            let m = open_loop(client, measured, bodies, rate, duration).await;
            let diff = |m: u64, b: u64| m as i64 - b as i64;
            pairs.push(PairRun {
                added_ttft_p50_us: diff(m.ttft.p50_us, b.ttft.p50_us),
                added_ttft_p99_us: diff(m.ttft.p99_us, b.ttft.p99_us),
                added_end_p99_us: diff(m.end.p99_us, b.end.p99_us),
                baseline: b,
                measured: m,
            });
        }
        let spread = |f: fn(&PairRun) -> i64| {
            Spread::of(pairs.iter().map(|r| f(r) as f64)).unwrap_or_default()
        };
        out.push(RateReport {
            rate,
            added_ttft_p50_us: spread(|r| r.added_ttft_p50_us),
            added_ttft_p99_us: spread(|r| r.added_ttft_p99_us),
            added_end_p99_us: spread(|r| r.added_end_p99_us),
            runs: pairs,
        });
    }
    out
}

/// Sends each of the first 16 bodies to `url`; `Err` names the first that did not stream
/// to `[DONE]`.
pub async fn warm_up(client: &HttpClient, url: &str, bodies: &[Bytes]) -> Result<(), String> {
    for body in bodies.iter().take(16) {
        if one_request(client, url, body.clone()).await.is_none() {
            return Err(format!("POST {url} did not stream to [DONE]"));
        }
    }
    Ok(())
}

/// An HTTP/1.1 client with a deep pool and no Nagle delay.
pub fn http_client() -> HttpClient {
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(4096)
        .build({
            let mut c = hyper_util::client::legacy::connect::HttpConnector::new();
            c.set_nodelay(true);
            c
        })
}

/// 64 request bodies: `/v1/completions` with `prompt_tokens` token ids (half shared across
/// prompts in 8 groups), `output_tokens` to stream.
pub fn completion_bodies(prompt_tokens: usize, output_tokens: usize, seed: u64) -> Vec<Bytes> {
    let mut prompts = PromptSource::new(prompt_tokens, 0.5, 8, seed);
    (0..64)
        .map(|_| {
            let body = serde_json::json!({
                "model": MODEL,
                "prompt": prompts.next_prompt(),
                "max_tokens": output_tokens,
                "stream": true,
            });
            Bytes::from(body.to_string())
        })
        .collect()
}

/// A connection for one component: its own to NATS, or a handle on the one in-process bus.
pub async fn bus(nats: &Option<NatsOptions>, local: &Bus, name: &str) -> Result<Bus, String> {
    match nats {
        None => Ok(local.clone()),
        Some(opts) => {
            let mut opts = opts.clone();
            opts.name = Some(name.to_string());
            Bus::connect(&opts).await.map_err(|e| e.to_string())
        }
    }
}

/// A [`StubEngine`] and the bridge that registers it (as a vLLM engine of one rank) as
/// `worker_id` of [`MODEL`] in `namespace`.
pub struct BridgedStub {
    pub engine: StubEngine,
    _publisher: zeromq::PubSocket,
    pub bridge: Bridge,
}

impl BridgedStub {
    pub async fn start(
        namespace: &str,
        worker_id: u64,
        chunks: usize,
        itl: Duration,
        bus: Bus,
    ) -> Result<Self, String> {
        use zeromq::Socket;
        let engine = StubEngine::start(chunks, itl)
            .await
            .map_err(|e| format!("engine stand-in: {e}"))?;
        // The bridge wants a publisher; this engine publishes no KV events.
        let mut publisher = zeromq::PubSocket::new();
        let endpoint = publisher
            .bind("tcp://127.0.0.1:0")
            .await
            .map_err(|e| format!("ZMQ publisher: {e}"))?
            .to_string();
        let mut bc = BridgeConfig::new(EngineKind::Vllm, MODEL, endpoint, engine.base_url());
        bc.namespace = namespace.to_string();
        bc.worker_id = Some(worker_id);
        bc.capacity_blocks = 1 << 16;
        let bridge = Bridge::start(bc, bus)
            .await
            .map_err(|e| format!("bridge: {e}"))?;
        Ok(Self {
            engine,
            _publisher: publisher,
            bridge,
        })
    }

    pub async fn shutdown(self) {
        let _ = self.bridge.shutdown_within(Duration::from_secs(2)).await;
    }
}

/// A replica serving [`MODEL`] in `namespace`, once it is ready and sees `ranks` ranks
/// (`None` when it does not within 20 s).
pub async fn ready_replica(
    namespace: &str,
    bus: Bus,
    ranks: usize,
) -> Result<Option<Replica>, String> {
    let replica = Replica::start(
        ReplicaConfig {
            namespace: namespace.to_string(),
            replica_id: Some("bench".into()),
            models: vec![MODEL.into()],
            discovery_window: Duration::from_millis(100),
            ..ReplicaConfig::default()
        },
        bus,
    )
    .await
    .map_err(|e| e.to_string())?;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let seen = &replica.shared().models[MODEL].status.ranks;
        if replica.is_ready() && seen.load(std::sync::atomic::Ordering::Relaxed) == ranks {
            return Ok(Some(replica));
        }
        if Instant::now() > deadline {
            replica.shutdown().await;
            return Ok(None);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_stub_engine_streams_every_chunk_then_done() {
        let engine = StubEngine::start(3, Duration::from_millis(1))
            .await
            .unwrap();
        let client: HttpClient = Client::builder(TokioExecutor::new())
            .build(hyper_util::client::legacy::connect::HttpConnector::new());
        let url = format!("{}/v1/completions", engine.base_url());
        let req = Request::post(&url)
            .body(Full::new(Bytes::from_static(b"{\"prompt\":[1,2,3]}")))
            .unwrap();
        let body = client.request(req).await.unwrap().into_body();
        let text = String::from_utf8(body.collect().await.unwrap().to_bytes().to_vec()).unwrap();
        let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
        assert_eq!(events.len(), 5, "3 chunks, usage, [DONE]: {text}");
        assert_eq!(events.iter().filter(|e| e.contains("\" tok\"")).count(), 3);
        assert!(events[2].contains("\"finish_reason\":\"length\""));
        assert!(events[3].contains("\"completion_tokens\":3"));
        assert_eq!(events[4], "data: [DONE]");
        assert!(one_request(&client, &url, Bytes::from_static(b"{}"))
            .await
            .is_some());
    }
}

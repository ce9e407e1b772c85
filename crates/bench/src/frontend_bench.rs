//! What the frontend adds (`kvrouter bench frontend`): the same open-loop streaming requests
//! sent straight to an engine and through `kvrouter frontend` (tokens in, routed by a real
//! replica, relayed from the engine), with time to first chunk and to the end measured on
//! both paths; and the tokenizer's time per 1,000 tokens of text.
//!
//! The engine is a stand-in with fixed timing ([`StubEngine`]): a first chunk as soon as the
//! request is read, then one chunk per interval. Whatever it costs is paid on both paths, so
//! the difference of the two paths' percentiles is the frontend's (parsing, routing over
//! the bus, the second HTTP hop, reshaping the stream). A bridge registers it, so the
//! replica routes to it as it would to a vLLM engine.
//!
//! Requests are sent by intended send time from a pacing thread (as in
//! [`crate::route_latency`]) and each latency runs from that time: a stalled frontend shows
//! in the tail, not as a slower sender.

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
use kvrouter_client::KvRouterClient;
use kvrouter_frontend::{Frontend, FrontendConfig, FrontendServer};
use kvrouter_openai::ModelFiles;
use kvrouter_protocol::EngineKind;
use kvrouter_replica::{Replica, ReplicaConfig};
use serde::Serialize;
use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The model name the bench serves.
const MODEL: &str = "bench";

#[derive(Debug, thiserror::Error)]
pub enum FrontendBenchError {
    #[error("{0}")]
    Config(String),
    #[error("cannot load the model directory: {0}")]
    Model(String),
    #[error("cannot start the {what}: {message}")]
    Start { what: &'static str, message: String },
    #[error("the replica did not see the engine within {0:?}")]
    NotReady(Duration),
    #[error("warm-up request through the {path} failed: {message}")]
    WarmUp { path: &'static str, message: String },
}

fn start_err(what: &'static str) -> impl Fn(String) -> FrontendBenchError {
    move |message| FrontendBenchError::Start { what, message }
}

/// What to measure.
#[derive(Clone, Debug)]
pub struct FrontendBenchConfig {
    /// A Hugging Face model directory (tokenizer.json at least).
    pub model_dir: PathBuf,
    /// Requests per second of each measured pair of runs.
    pub rates: Vec<f64>,
    /// Runs at each rate (each a direct run, then one through the frontend).
    pub runs: usize,
    pub duration: Duration,
    /// Token ids per prompt.
    pub prompt_tokens: usize,
    /// Chunks each answer streams.
    pub output_tokens: usize,
    /// The engine's time between chunks.
    pub engine_itl: Duration,
    /// NATS to route over; `None` for the in-process bus.
    pub nats: Option<NatsOptions>,
    /// Texts tokenized per size for the tokenizer figure.
    pub tokenize_runs: usize,
    pub seed: u64,
}

impl FrontendBenchConfig {
    pub fn validate(&self) -> Result<(), FrontendBenchError> {
        let bad = |m: &str| Err(FrontendBenchError::Config(m.to_string()));
        if self.rates.is_empty() || self.rates.iter().any(|r| !(r.is_finite() && *r > 0.0)) {
            return bad("every rate must be a positive number of requests per second");
        }
        if self.runs == 0 || self.tokenize_runs == 0 {
            return bad("--runs and --tokenize-runs must be at least 1");
        }
        if self.duration.is_zero() {
            return bad("--duration must be above 0");
        }
        if self.prompt_tokens == 0 || self.output_tokens == 0 {
            return bad("--prompt-tokens and --output-tokens must be at least 1");
        }
        Ok(())
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

/// A direct run and a frontend run at one rate, and what the frontend added.
#[derive(Clone, Debug, Serialize)]
pub struct PairRun {
    pub direct: PathRun,
    pub frontend: PathRun,
    /// Frontend percentile minus direct percentile, in µs (negative when noise wins).
    pub added_ttft_p50_us: i64,
    pub added_ttft_p99_us: i64,
    pub added_end_p99_us: i64,
}

#[derive(Clone, Debug, Serialize)]
pub struct RateReport {
    pub rate: f64,
    pub runs: Vec<PairRun>,
    pub added_ttft_p50_us: Spread,
    pub added_ttft_p99_us: Spread,
    pub added_end_p99_us: Spread,
}

/// The tokenizer's time per 1,000 tokens, for texts of about `tokens` tokens.
#[derive(Clone, Debug, Serialize)]
pub struct TokenizeReport {
    pub tokens: usize,
    pub bytes: usize,
    pub us_per_1k_tokens: Spread,
}

#[derive(Clone, Debug, Serialize)]
pub struct FrontendBenchReport {
    pub bus: &'static str,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    pub engine_itl_us: u64,
    pub duration_s: f64,
    pub rates: Vec<RateReport>,
    pub vocab_size: usize,
    pub tokenize: Vec<TokenizeReport>,
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

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

/// Sends one request and reads its answer to the end; `(first bytes, end)` instants, or
/// `None` for a failure (a non-200, a broken stream, no `[DONE]`).
async fn one_request(client: &HttpClient, url: &str, body: Bytes) -> Option<(Instant, Instant)> {
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
fn cpu_time() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which may hold spaces) start at the state, field 3.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(Duration::from_millis((utime + stime) * 10))
}

/// One open-loop run: `bodies` cycled at `rate` to `url` for `duration`.
async fn open_loop(
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
            .name("frontend-bench-pacer".into())
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

/// The request bodies: `/v1/completions` with token-id prompts, streaming.
fn bodies(config: &FrontendBenchConfig) -> Vec<Bytes> {
    let mut prompts = PromptSource::new(config.prompt_tokens, 0.5, 8, config.seed);
    (0..64)
        .map(|_| {
            let body = serde_json::json!({
                "model": MODEL,
                "prompt": prompts.next_prompt(),
                "max_tokens": config.output_tokens,
                "stream": true,
            });
            Bytes::from(body.to_string())
        })
        .collect()
}

/// A connection for one component: its own to NATS, or a handle on the one in-process bus.
async fn bus(
    nats: &Option<NatsOptions>,
    local: &Bus,
    name: &str,
) -> Result<Bus, FrontendBenchError> {
    match nats {
        None => Ok(local.clone()),
        Some(opts) => {
            let mut opts = opts.clone();
            opts.name = Some(name.to_string());
            Bus::connect(&opts)
                .await
                .map_err(|e| start_err("NATS connection")(e.to_string()))
        }
    }
}

/// Everything under test: the engine stand-in, its bridge, a replica and the frontend.
struct Stack {
    engine: StubEngine,
    _publisher: zeromq::PubSocket,
    bridge: Bridge,
    replica: Replica,
    frontend: FrontendServer,
}

async fn start_stack(
    config: &FrontendBenchConfig,
    model: ModelFiles,
) -> Result<Stack, FrontendBenchError> {
    use zeromq::Socket;
    // A fresh namespace: a shared NATS may carry other fleets.
    let namespace = format!("kvbench{}", std::process::id());
    let local = Bus::local();
    let engine = StubEngine::start(config.output_tokens, config.engine_itl)
        .await
        .map_err(|e| start_err("engine stand-in")(e.to_string()))?;
    // The bridge wants a publisher; this engine publishes no KV events.
    let mut publisher = zeromq::PubSocket::new();
    let endpoint = publisher
        .bind("tcp://127.0.0.1:0")
        .await
        .map_err(|e| start_err("ZMQ publisher")(e.to_string()))?
        .to_string();
    let mut bc = BridgeConfig::new(EngineKind::Vllm, MODEL, endpoint, engine.base_url());
    bc.namespace = namespace.clone();
    bc.worker_id = Some(1);
    bc.capacity_blocks = 1 << 16;
    let bridge = Bridge::start(
        bc,
        bus(&config.nats, &local, "kvrouter-bench-bridge").await?,
    )
    .await
    .map_err(|e| start_err("bridge")(e.to_string()))?;
    let replica = Replica::start(
        ReplicaConfig {
            namespace: namespace.clone(),
            replica_id: Some("bench".into()),
            models: vec![MODEL.into()],
            discovery_window: Duration::from_millis(100),
            ..ReplicaConfig::default()
        },
        bus(&config.nats, &local, "kvrouter-bench-replica").await?,
    )
    .await
    .map_err(|e| start_err("replica")(e.to_string()))?;
    let ready_within = Duration::from_secs(20);
    let deadline = Instant::now() + ready_within;
    loop {
        let ranks = &replica.shared().models[MODEL].status.ranks;
        if replica.is_ready() && ranks.load(std::sync::atomic::Ordering::Relaxed) == 1 {
            break;
        }
        if Instant::now() > deadline {
            return Err(FrontendBenchError::NotReady(ready_within));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let client = KvRouterClient::new(
        bus(&config.nats, &local, "kvrouter-bench-frontend").await?,
        &namespace,
    )
    .map_err(|e| start_err("router client")(e.to_string()))?;
    let frontend = Frontend::new(
        vec![model],
        Default::default(),
        client,
        FrontendConfig::default(),
    )
    .map_err(start_err("frontend"))?;
    let frontend = FrontendServer::start("127.0.0.1:0".parse().expect("an address"), frontend)
        .await
        .map_err(|e| start_err("frontend")(e.to_string()))?;
    Ok(Stack {
        engine,
        _publisher: publisher,
        bridge,
        replica,
        frontend,
    })
}

/// Words the tokenizer texts are made of: common English, some punctuation and digits.
#[rustfmt::skip]
const WORDS: &[&str] = &[
    "the", "router", "sends", "each", "request", "where", "its", "prefix", "is", "cached",
    "and", "load", "is", "low", "a", "worker", "keeps", "blocks", "of", "tokens", "in",
    "memory", "so", "prefill", "can", "be", "skipped", "when", "conversation", "grows", "by",
    "one", "turn", "we", "measure", "latency", "at", "p99", "under", "1,000", "requests", "per",
    "second", "with", "8k", "prompts", "engine", "stream", "answer", "chunks", "tokenizer",
    "template", "chat", "system", "user", "assistant", "Please", "summarise", "following",
    "document:", "It", "was", "2026-11-26,", "and", "(roughly)", "42%", "of", "GPUs", "were",
    "idle.", "Why?", "Because", "scheduling", "ignored", "cache", "hits!",
];

/// About `tokens` tokens of text (four bytes a token, as for English text).
fn text(tokens: usize, rng: &mut fastrand::Rng) -> String {
    let mut s = String::with_capacity(tokens * 5);
    while s.len() < tokens * 4 {
        if !s.is_empty() {
            s.push(if rng.u8(..16) == 0 { '\n' } else { ' ' });
        }
        s.push_str(WORDS[rng.usize(..WORDS.len())]);
    }
    s
}

/// The tokenizer's µs per 1,000 tokens on texts of about 1k and 8k tokens.
pub fn tokenize_figures(model: &ModelFiles, runs: usize, seed: u64) -> Vec<TokenizeReport> {
    let mut rng = fastrand::Rng::with_seed(seed);
    [1_000, 8_000]
        .into_iter()
        .map(|size| {
            let texts: Vec<String> = (0..runs).map(|_| text(size, &mut rng)).collect();
            // One untimed pass (the tokenizer's caches, page faults).
            let _ = model.tokenizer().encode(&texts[0], true);
            let mut tokens = 0;
            let per_1k: Vec<f64> = texts
                .iter()
                .map(|t| {
                    let started = Instant::now();
                    let n = model.tokenizer().encode(t, true).map_or(0, |ids| ids.len());
                    let took = started.elapsed();
                    tokens += n;
                    took.as_secs_f64() * 1e6 * 1000.0 / n.max(1) as f64
                })
                .collect();
            TokenizeReport {
                tokens: tokens / runs,
                bytes: texts.iter().map(String::len).sum::<usize>() / runs,
                us_per_1k_tokens: Spread::of(per_1k).unwrap_or_default(),
            }
        })
        .collect()
}

/// Runs the whole bench. Must run inside a multi-threaded tokio runtime.
pub async fn run_frontend_bench(
    config: &FrontendBenchConfig,
) -> Result<FrontendBenchReport, FrontendBenchError> {
    config.validate()?;
    let limit = Some(config.prompt_tokens + 1024);
    let load = || ModelFiles::load(MODEL, &config.model_dir, None, limit);
    let model = load().map_err(|e| FrontendBenchError::Model(e.to_string()))?;
    let tokenize = tokenize_figures(&model, config.tokenize_runs, config.seed);
    let vocab_size = model.tokenizer().vocab_size();
    let stack = start_stack(
        config,
        load().map_err(|e| FrontendBenchError::Model(e.to_string()))?,
    )
    .await?;
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(4096)
        .build({
            let mut c = hyper_util::client::legacy::connect::HttpConnector::new();
            c.set_nodelay(true);
            c
        });
    let direct = format!("{}/v1/completions", stack.engine.base_url());
    let through = format!("http://{}/v1/completions", stack.frontend.addr);
    let bodies = Arc::new(bodies(config));
    for (path, url) in [("engine", &direct), ("frontend", &through)] {
        for body in bodies.iter().take(16) {
            if one_request(&client, url, body.clone()).await.is_none() {
                return Err(FrontendBenchError::WarmUp {
                    path,
                    message: format!("POST {url} did not stream to [DONE]"),
                });
            }
        }
    }
    let mut rates = Vec::new();
    for &rate in &config.rates {
        let mut runs = Vec::new();
        for _ in 0..config.runs {
            let direct = open_loop(&client, &direct, &bodies, rate, config.duration).await;
            let frontend = open_loop(&client, &through, &bodies, rate, config.duration).await;
            let diff = |f: u64, d: u64| f as i64 - d as i64;
            runs.push(PairRun {
                added_ttft_p50_us: diff(frontend.ttft.p50_us, direct.ttft.p50_us),
                added_ttft_p99_us: diff(frontend.ttft.p99_us, direct.ttft.p99_us),
                added_end_p99_us: diff(frontend.end.p99_us, direct.end.p99_us),
                direct,
                frontend,
            });
        }
        let spread = |f: fn(&PairRun) -> i64| {
            Spread::of(runs.iter().map(|r| f(r) as f64)).unwrap_or_default()
        };
        rates.push(RateReport {
            rate,
            added_ttft_p50_us: spread(|r| r.added_ttft_p50_us),
            added_ttft_p99_us: spread(|r| r.added_ttft_p99_us),
            added_end_p99_us: spread(|r| r.added_end_p99_us),
            runs,
        });
    }
    let Stack {
        engine,
        _publisher,
        bridge,
        replica,
        frontend,
    } = stack;
    frontend.shutdown_within(Duration::from_secs(2)).await;
    replica.shutdown().await;
    let _ = bridge.shutdown_within(Duration::from_secs(2)).await;
    drop(engine);
    Ok(FrontendBenchReport {
        bus: if config.nats.is_some() {
            "nats"
        } else {
            "in-process"
        },
        prompt_tokens: config.prompt_tokens,
        output_tokens: config.output_tokens,
        engine_itl_us: us(config.engine_itl),
        duration_s: config.duration.as_secs_f64(),
        rates,
        vocab_size,
        tokenize,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn texts_are_about_the_size_asked() {
        let mut rng = fastrand::Rng::with_seed(1);
        let t = text(1000, &mut rng);
        assert!((4000..4100).contains(&t.len()), "{}", t.len());
        assert_ne!(t, text(1000, &mut rng), "each text differs");
    }

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

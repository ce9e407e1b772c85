//! Traffic of a chaos run: client tasks generating requests with shared prefixes through the
//! replicas, retrying failed ones a bounded number of times, and a gate that pauses them for
//! checkpoints. A request goes either to the mocker workers (route, then generate on the
//! chosen worker over the bus) or to the bridged engines, as a frontend sends it: route with
//! the load booked, `POST {base_url}/v1/completions` naming the chosen rank the engine's way,
//! then `mark_prefill` and `free` to the replica that decided.

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::header::{HeaderName, HeaderValue};
use kvrouter_client::{route_request, Booking, ClientError, GenerateParams, KvRouterClient};
use kvrouter_frontend::upstream::{Upstream, UpstreamError};
use kvrouter_protocol::{Pin, WorkerId};
use parking_lot::Mutex;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

/// What the traffic did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RouteFigures {
    /// Requests started (each tried up to 1 + max retries times).
    pub requests: u64,
    /// Route + generate attempts, retries included.
    pub attempted: u64,
    /// Attempts that were retries.
    pub retried: u64,
    /// Requests that failed every attempt.
    pub failed: u64,
    /// Requests that succeeded.
    pub succeeded: u64,
    /// Of the requests, those sent to the bridged engines (over HTTP), and how many of them
    /// succeeded.
    pub engine_requests: u64,
    pub engine_succeeded: u64,
    /// Failed attempts by error kind.
    pub errors: BTreeMap<String, u64>,
}

/// The prompt shapes.
#[derive(Clone, Debug)]
pub struct TrafficConfig {
    pub model: String,
    pub block_size: usize,
    /// Client tasks sending one request at a time.
    pub concurrency: usize,
    pub prefix_pool: usize,
    pub prefix_blocks: usize,
    pub max_suffix_blocks: usize,
    pub max_tokens: u32,
    pub max_retries: u32,
    /// Pause of each task between requests.
    pub think: Duration,
    pub seed: u64,
    /// The mocker workers (generate over the bus).
    pub mocker_workers: Vec<WorkerId>,
    /// The bridged engines' workers (generate over HTTP at the decision's base URL).
    pub engines: Vec<EngineTarget>,
    /// The share of requests sent to the engines (when there are any).
    pub engine_share: f64,
    /// How long an engine's answer may take.
    pub engine_timeout: Duration,
}

/// A bridged engine's worker, and how its engine takes the chosen rank.
#[derive(Clone, Debug)]
pub struct EngineTarget {
    pub worker_id: WorkerId,
    /// SGLang: the body's `routed_dp_rank` (vLLM: the `X-data-parallel-rank` header; both
    /// are sent to either).
    pub sglang: bool,
}

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    attempted: AtomicU64,
    retried: AtomicU64,
    failed: AtomicU64,
    succeeded: AtomicU64,
    engine_requests: AtomicU64,
    engine_succeeded: AtomicU64,
    errors: Mutex<BTreeMap<String, u64>>,
}

/// Why an engine request failed.
enum EngineFailure {
    Route(ClientError),
    Upstream(UpstreamError),
    /// The answer's body broke off.
    Body(String),
}

impl EngineFailure {
    fn label(&self) -> &'static str {
        match self {
            Self::Route(e) => e.kind_label(),
            Self::Upstream(UpstreamError::BadUrl(_)) => "engine_bad_url",
            Self::Upstream(UpstreamError::Connect { .. }) => "engine_connect",
            Self::Upstream(UpstreamError::Broken { .. }) => "engine_broken",
            Self::Upstream(UpstreamError::Timeout { .. }) => "engine_timeout",
            Self::Upstream(UpstreamError::Status { .. }) => "engine_status",
            Self::Body(_) => "engine_body",
        }
    }
}

impl std::fmt::Display for EngineFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Route(e) => write!(f, "{e}"),
            Self::Upstream(e) => write!(f, "{e}"),
            Self::Body(e) => write!(f, "the engine's answer broke off: {e}"),
        }
    }
}

/// Shared between the runner and the client tasks.
pub struct Traffic {
    client: KvRouterClient,
    upstream: Upstream,
    cfg: TrafficConfig,
    prefixes: Vec<Vec<u32>>,
    paused: AtomicBool,
    stopped: AtomicBool,
    in_flight: AtomicUsize,
    counters: Counters,
    fresh: AtomicU64,
}

impl Traffic {
    pub fn new(client: KvRouterClient, cfg: TrafficConfig) -> Arc<Self> {
        let mut rng = fastrand::Rng::with_seed(cfg.seed ^ 0x5eed);
        let prefixes = (0..cfg.prefix_pool.max(1))
            .map(|_| {
                (0..cfg.prefix_blocks * cfg.block_size)
                    .map(|_| rng.u32(1..50_000))
                    .collect()
            })
            .collect();
        Arc::new(Self {
            client,
            upstream: Upstream::new(Duration::from_secs(1)),
            cfg,
            prefixes,
            paused: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            counters: Counters::default(),
            fresh: AtomicU64::new(0),
        })
    }

    /// Starts the client tasks.
    pub fn spawn(self: &Arc<Self>) -> Vec<tokio::task::JoinHandle<()>> {
        (0..self.cfg.concurrency.max(1))
            .map(|i| {
                let t = self.clone();
                tokio::spawn(async move { t.task(i as u64).await })
            })
            .collect()
    }

    async fn task(self: Arc<Self>, i: u64) {
        let mut rng = fastrand::Rng::with_seed(self.cfg.seed.wrapping_mul(1000).wrapping_add(i));
        while !self.stopped.load(SeqCst) {
            // Count in before looking at the gate, so a checkpoint that closed it and saw
            // nothing in flight sees nothing start.
            self.in_flight.fetch_add(1, SeqCst);
            if self.paused.load(SeqCst) {
                self.in_flight.fetch_sub(1, SeqCst);
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
            let p = &self.prefixes[rng.usize(0..self.prefixes.len())];
            let mut tokens = p.clone();
            let suffix = rng.usize(1..=self.cfg.max_suffix_blocks.max(1)) * self.cfg.block_size;
            tokens.extend((0..suffix).map(|_| rng.u32(1..50_000)));
            let mut params = GenerateParams::new(
                self.cfg.model.clone(),
                tokens,
                rng.u32(1..=self.cfg.max_tokens.max(1)),
            );
            let to_engines = !self.cfg.engines.is_empty() && rng.f64() < self.cfg.engine_share;
            if to_engines {
                params.allowed_workers =
                    Some(self.cfg.engines.iter().map(|e| e.worker_id).collect());
            } else if !self.cfg.mocker_workers.is_empty() {
                params.allowed_workers = Some(self.cfg.mocker_workers.clone());
            }
            self.run(&params, to_engines).await;
            self.in_flight.fetch_sub(1, SeqCst);
            tokio::time::sleep(self.cfg.think).await;
        }
    }

    /// One request with its retries (on the engines over HTTP, or on the mocker workers
    /// over the bus); true when it succeeded.
    async fn run(&self, params: &GenerateParams, on_engines: bool) -> bool {
        let c = &self.counters;
        c.requests.fetch_add(1, SeqCst);
        if on_engines {
            c.engine_requests.fetch_add(1, SeqCst);
        }
        for attempt in 0..=self.cfg.max_retries {
            if attempt > 0 {
                c.retried.fetch_add(1, SeqCst);
                tokio::time::sleep(Duration::from_millis(100 * u64::from(attempt))).await;
            }
            c.attempted.fetch_add(1, SeqCst);
            let failed = if on_engines {
                self.on_engine(params)
                    .await
                    .err()
                    .map(|e| (e.label(), e.to_string()))
            } else {
                self.client
                    .generate(params)
                    .await
                    .err()
                    .map(|e| (e.kind_label(), e.to_string()))
            };
            match failed {
                None => {
                    c.succeeded.fetch_add(1, SeqCst);
                    if on_engines {
                        c.engine_succeeded.fetch_add(1, SeqCst);
                    }
                    return true;
                }
                Some((label, e)) => {
                    *c.errors.lock().entry(label.to_string()).or_default() += 1;
                    tracing::debug!(error = %e, attempt, "chaos request failed");
                }
            }
        }
        c.failed.fetch_add(1, SeqCst);
        false
    }

    /// What a frontend does with a request for a bridged engine: route (booking the load),
    /// post it to the chosen engine naming the rank, `mark_prefill` once the answer starts,
    /// and `free` whatever happened.
    async fn on_engine(&self, params: &GenerateParams) -> Result<(), EngineFailure> {
        let req = route_request(params.model.clone(), params.tokens.clone())
            .with_allowed_workers(params.allowed_workers.clone())
            .with_pin(params.pin);
        let d = self
            .client
            .route(&req)
            .await
            .map_err(EngineFailure::Route)?;
        let sglang = self
            .cfg
            .engines
            .iter()
            .any(|e| e.worker_id == d.worker_id && e.sglang);
        let mut body = serde_json::json!({
            "model": params.model,
            "prompt": params.tokens,
            "max_tokens": params.max_tokens,
        });
        if sglang {
            body["routed_dp_rank"] = d.dp_rank.into();
        }
        let headers = [(
            HeaderName::from_static("x-data-parallel-rank"),
            HeaderValue::from(d.dp_rank),
        )];
        let booking = Booking::new(&d, &params.model, &req.request_id);
        let answer = async {
            let res = self
                .upstream
                .completions(
                    &d.base_url,
                    &headers,
                    Bytes::from(body.to_string()),
                    self.cfg.engine_timeout,
                )
                .await
                .map_err(EngineFailure::Upstream)?;
            // A frontend marks the prefill done at the first token; the whole answer comes
            // at once here.
            let _ = self.client.mark_prefill(&booking).await;
            tokio::time::timeout(self.cfg.engine_timeout, res.into_body().collect())
                .await
                .map_err(|_| EngineFailure::Body("timed out".into()))?
                .map_err(|e| EngineFailure::Body(e.to_string()))?;
            Ok(())
        }
        .await;
        // In the background, as the frontend frees its routes.
        let client = self.client.clone();
        tokio::spawn(async move {
            if let Err(e) = client.free_until_delivered(&booking).await {
                tracing::debug!(error = %e, replica = %booking.replica_id, "free failed");
            }
        });
        answer
    }

    /// `rounds` rounds of fresh prompts pinned to each rank of a worker, one after another
    /// (so the replicas see new events from every rank after some were dropped).
    pub async fn poke_worker(&self, worker_id: u64, ranks: std::ops::Range<u32>, rounds: u64) {
        self.in_flight.fetch_add(1, SeqCst);
        for _ in 0..rounds {
            for r in ranks.clone() {
                let n = self.fresh.fetch_add(1, SeqCst);
                let mut rng = fastrand::Rng::with_seed(self.cfg.seed ^ (n << 20) ^ 0xd7097);
                let tokens = (0..2 * self.cfg.block_size)
                    .map(|_| rng.u32(50_000..100_000))
                    .collect();
                let mut params = GenerateParams::new(self.cfg.model.clone(), tokens, 2);
                params.pin = Some(Pin {
                    worker_id,
                    dp_rank: Some(r),
                });
                let on_engines = self.cfg.engines.iter().any(|e| e.worker_id == worker_id);
                self.run(&params, on_engines).await;
                tokio::time::sleep(Duration::from_millis(30)).await;
            }
        }
        self.in_flight.fetch_sub(1, SeqCst);
    }

    pub fn pause(&self) {
        self.paused.store(true, SeqCst);
    }

    pub fn resume(&self) {
        self.paused.store(false, SeqCst);
    }

    pub fn stop(&self) {
        self.stopped.store(true, SeqCst);
        self.paused.store(true, SeqCst);
    }

    /// Waits until nothing is in flight; false after `timeout`.
    pub async fn drained(&self, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        while self.in_flight.load(SeqCst) > 0 {
            if tokio::time::Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        true
    }

    pub fn figures(&self) -> RouteFigures {
        let c = &self.counters;
        RouteFigures {
            requests: c.requests.load(SeqCst),
            attempted: c.attempted.load(SeqCst),
            retried: c.retried.load(SeqCst),
            failed: c.failed.load(SeqCst),
            succeeded: c.succeeded.load(SeqCst),
            engine_requests: c.engine_requests.load(SeqCst),
            engine_succeeded: c.engine_succeeded.load(SeqCst),
            errors: c.errors.lock().clone(),
        }
    }
}

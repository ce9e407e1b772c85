//! Traffic of a chaos run: client tasks generating requests with shared prefixes through the
//! replicas (route, then generate on the chosen worker), retrying failed ones a bounded
//! number of times, and a gate that pauses them for checkpoints.

use kvrouter_client::{GenerateParams, KvRouterClient};
use kvrouter_protocol::Pin;
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
}

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    attempted: AtomicU64,
    retried: AtomicU64,
    failed: AtomicU64,
    succeeded: AtomicU64,
    errors: Mutex<BTreeMap<String, u64>>,
}

/// Shared between the runner and the client tasks.
pub struct Traffic {
    client: KvRouterClient,
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
            let params = GenerateParams::new(
                self.cfg.model.clone(),
                tokens,
                rng.u32(1..=self.cfg.max_tokens.max(1)),
            );
            self.run(&params).await;
            self.in_flight.fetch_sub(1, SeqCst);
            tokio::time::sleep(self.cfg.think).await;
        }
    }

    /// One request with its retries; true when it succeeded.
    async fn run(&self, params: &GenerateParams) -> bool {
        let c = &self.counters;
        c.requests.fetch_add(1, SeqCst);
        for attempt in 0..=self.cfg.max_retries {
            if attempt > 0 {
                c.retried.fetch_add(1, SeqCst);
                tokio::time::sleep(Duration::from_millis(100 * u64::from(attempt))).await;
            }
            c.attempted.fetch_add(1, SeqCst);
            match self.client.generate(params).await {
                Ok(_) => {
                    c.succeeded.fetch_add(1, SeqCst);
                    return true;
                }
                Err(e) => {
                    *c.errors
                        .lock()
                        .entry(e.kind_label().to_string())
                        .or_default() += 1;
                    tracing::debug!(error = %e, attempt, "chaos request failed");
                }
            }
        }
        c.failed.fetch_add(1, SeqCst);
        false
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
                self.run(&params).await;
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
            errors: c.errors.lock().clone(),
        }
    }
}

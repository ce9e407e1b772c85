//! What the frontend adds (`kvrouter bench frontend`): the same open-loop streaming requests
//! sent straight to an engine and through `kvrouter frontend` (tokens in, routed by a real
//! replica, relayed from the engine), with time to first chunk and to the end measured on
//! both paths; and the tokenizer's time per 1,000 tokens of text.
//!
//! The engine is a stand-in with fixed timing ([`crate::http_load::StubEngine`]): a first chunk as soon as the
//! request is read, then one chunk per interval. Whatever it costs is paid on both paths, so
//! the difference of the two paths' percentiles is the frontend's (parsing, routing over
//! the bus, the second HTTP hop, reshaping the stream). A bridge registers it, so the
//! replica routes to it as it would to a vLLM engine.
//!
//! Requests are sent open-loop by intended send time ([`crate::http_load`]).

use crate::http_load::{
    bus, completion_bodies, http_client, paired_runs, ready_replica, warm_up, BridgedStub,
    RateReport, MODEL,
};
use crate::route_latency::us;
use crate::stats::Spread;
use kvrouter_bus::{Bus, NatsOptions};
use kvrouter_client::KvRouterClient;
use kvrouter_frontend::{Frontend, FrontendConfig, FrontendServer};
use kvrouter_openai::ModelFiles;
use kvrouter_replica::Replica;
use serde::Serialize;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    /// Per rate: `baseline` straight to the engine, `measured` through the frontend.
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    pub engine_itl_us: u64,
    pub duration_s: f64,
    pub rates: Vec<RateReport>,
    pub vocab_size: usize,
    pub tokenize: Vec<TokenizeReport>,
}

/// Everything under test: the engine stand-in, its bridge, a replica and the frontend.
struct Stack {
    engine: BridgedStub,
    replica: Replica,
    frontend: FrontendServer,
}

async fn start_stack(
    config: &FrontendBenchConfig,
    model: ModelFiles,
) -> Result<Stack, FrontendBenchError> {
    // A fresh namespace: a shared NATS may carry other fleets.
    let namespace = format!("kvbench{}", std::process::id());
    let local = Bus::local();
    let connect = |name: &'static str| {
        let (nats, local) = (config.nats.clone(), local.clone());
        async move {
            bus(&nats, &local, name)
                .await
                .map_err(start_err("NATS connection"))
        }
    };
    let engine = BridgedStub::start(
        &namespace,
        1,
        config.output_tokens,
        config.engine_itl,
        connect("kvrouter-bench-bridge").await?,
    )
    .await
    .map_err(start_err("engine and bridge"))?;
    let ready_within = Duration::from_secs(20);
    let replica = ready_replica(&namespace, connect("kvrouter-bench-replica").await?, 1)
        .await
        .map_err(start_err("replica"))?
        .ok_or(FrontendBenchError::NotReady(ready_within))?;
    let client = KvRouterClient::new(connect("kvrouter-bench-frontend").await?, &namespace)
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
    let client = http_client();
    let direct = format!("{}/v1/completions", stack.engine.engine.base_url());
    let through = format!("http://{}/v1/completions", stack.frontend.addr);
    let bodies = Arc::new(completion_bodies(
        config.prompt_tokens,
        config.output_tokens,
        config.seed,
    ));
    for (path, url) in [("engine", &direct), ("frontend", &through)] {
        warm_up(&client, url, &bodies)
            .await
            .map_err(|message| FrontendBenchError::WarmUp { path, message })?;
    }
    let rates = paired_runs(
        &client,
        (&direct, &through),
        &bodies,
        &config.rates,
        config.runs,
        config.duration,
    )
    .await;
    let Stack {
        engine,
        replica,
        frontend,
    } = stack;
    frontend.shutdown_within(Duration::from_secs(2)).await;
    replica.shutdown().await;
    engine.shutdown().await;
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
}

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
    http_client, ready_replica, start_err, warm_up, BridgedStub, DoorBenchError, LoadConfig,
    RateReport, MODEL,
};
use crate::route_latency::us;
use crate::stats::Spread;
use kvrouter_bus::Bus;
use kvrouter_client::KvRouterClient;
use kvrouter_frontend::{Frontend, FrontendConfig, FrontendServer};
use kvrouter_openai::ModelFiles;
use kvrouter_replica::Replica;
use serde::Serialize;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// What to measure.
#[derive(Clone, Debug)]
pub struct FrontendBenchConfig {
    /// A Hugging Face model directory (tokenizer.json at least).
    pub model_dir: PathBuf,
    pub load: LoadConfig,
    /// Texts tokenized per size for the tokenizer figure.
    pub tokenize_runs: usize,
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
) -> Result<Stack, DoorBenchError> {
    // A fresh namespace: a shared NATS may carry other fleets.
    let namespace = format!("kvbench{}", std::process::id());
    let local = Bus::local();
    let load = &config.load;
    let engine = BridgedStub::start(
        &namespace,
        1,
        load.output_tokens,
        load.engine_itl,
        load.connect(&local, "kvrouter-bench-bridge").await?,
    )
    .await
    .map_err(start_err("engine and bridge"))?;
    let replica = ready_replica(
        &namespace,
        load.connect(&local, "kvrouter-bench-replica").await?,
        1,
    )
    .await
    .map_err(start_err("replica"))?
    .ok_or(DoorBenchError::NotReady("replica"))?;
    let client = KvRouterClient::new(
        load.connect(&local, "kvrouter-bench-frontend").await?,
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
) -> Result<FrontendBenchReport, DoorBenchError> {
    let load = &config.load;
    load.validate()?;
    if config.tokenize_runs == 0 {
        return Err(DoorBenchError::Config(
            "--tokenize-runs must be at least 1".into(),
        ));
    }
    let limit = Some(load.prompt_tokens + 1024);
    let model_files = || {
        ModelFiles::load(MODEL, &config.model_dir, None, limit)
            .map_err(|e| DoorBenchError::Model(e.to_string()))
    };
    let model = model_files()?;
    let tokenize = tokenize_figures(&model, config.tokenize_runs, load.seed);
    let vocab_size = model.tokenizer().vocab_size();
    let stack = start_stack(config, model_files()?).await?;
    let client = http_client();
    let direct = format!("{}/v1/completions", stack.engine.engine.base_url());
    let through = format!("http://{}/v1/completions", stack.frontend.addr);
    let bodies = load.bodies();
    for (path, url) in [("engine", &direct), ("frontend", &through)] {
        warm_up(&client, url, &bodies)
            .await
            .map_err(|message| DoorBenchError::WarmUp { path, message })?;
    }
    let rates = load
        .paired_runs(&client, (&direct, &through), &bodies)
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
        bus: load.bus_name(),
        prompt_tokens: load.prompt_tokens,
        output_tokens: load.output_tokens,
        engine_itl_us: us(load.engine_itl),
        duration_s: load.duration.as_secs_f64(),
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

//! `kvrouter generate`: route one request and run it on the chosen worker, as a frontend does.

use super::nats_args::NatsArgs;
use super::route::{json_line, parse_pin, parse_tokens, RouteHints, TokenList};
use anyhow::Context;
use clap::Args;
use kvrouter_client::{GenerateParams, KvRouterClient};
use kvrouter_protocol::Pin;
use serde_json::Value;
use std::time::Duration;

#[derive(Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub nats: NatsArgs,
    /// Model name, as the workers register it.
    #[arg(long, env = "KVROUTER_MODEL")]
    pub model: String,
    /// Prompt token ids, comma-separated (e.g. 1,2,3).
    #[arg(long, env = "KVROUTER_TOKENS", value_parser = parse_tokens)]
    pub tokens: TokenList,
    /// Request id (default: a fresh uuid).
    #[arg(long, env = "KVROUTER_REQUEST_ID")]
    pub request_id: Option<String>,
    /// Tokens to generate.
    #[arg(long, env = "KVROUTER_MAX_TOKENS", default_value_t = 16)]
    pub max_tokens: u32,
    /// LoRA adapter name.
    #[arg(long, env = "KVROUTER_LORA")]
    pub lora: Option<String>,
    /// Only these worker ids may be chosen (comma-separated).
    #[arg(long, env = "KVROUTER_ALLOWED_WORKERS", value_delimiter = ',', value_parser = super::parse_u64)]
    pub allowed_workers: Option<Vec<u64>>,
    /// Pin to a worker (WORKER) or to one rank of it (WORKER:RANK).
    #[arg(long, env = "KVROUTER_PIN", value_parser = parse_pin)]
    pub pin: Option<Pin>,
    #[command(flatten)]
    pub hints: RouteHints,
    /// How long to wait for a router endpoint's answer, in milliseconds.
    #[arg(long, env = "KVROUTER_TIMEOUT_MS", default_value_t = 2000)]
    pub timeout_ms: u64,
    /// How long the worker's event stream may stay silent, in milliseconds.
    #[arg(
        long,
        env = "KVROUTER_GENERATE_IDLE_TIMEOUT_MS",
        default_value_t = 30_000
    )]
    pub idle_timeout_ms: u64,
    /// Disaggregated: prefill on a prefill worker rank, then decode on a decode worker rank.
    #[arg(long, env = "KVROUTER_DISAGG", conflicts_with = "pin")]
    pub disagg: bool,
}

pub async fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let bus = args.nats.connect("kvrouter-generate").await?;
    let client = KvRouterClient::new(bus, &args.nats.namespace)
        .context("bad --namespace")?
        .with_timeout(Duration::from_millis(args.timeout_ms.max(1)))
        .with_generate_idle_timeout(Duration::from_millis(args.idle_timeout_ms.max(1)));
    let params = GenerateParams {
        model: args.model,
        tokens: args.tokens.0,
        request_id: args.request_id,
        max_tokens: args.max_tokens,
        lora: args.lora.filter(|l| !l.is_empty()),
        allowed_workers: args.allowed_workers,
        pin: args.pin,
        priority_jump: args.hints.priority_jump,
        expected_output_tokens: args.hints.expected_output_tokens,
    };
    if args.disagg {
        return run_disagg(&client, &params).await;
    }
    let out = client.generate(&params).await?;
    for e in &out.bookkeeping_errors {
        eprintln!("warning: {e}");
    }
    let d = &out.decision;
    println!(
        "{}",
        json_line(&[
            ("request_id", out.request_id.clone().into()),
            ("worker_id", d.worker_id.into()),
            ("dp_rank", d.dp_rank.into()),
            ("overlap_blocks", d.overlap_blocks.into()),
            ("replica_id", d.replica_id.clone().into()),
            ("ttft_us", out.ttft_us.into()),
            ("cached_blocks", out.cached_blocks.into()),
            ("prompt_blocks", out.prompt_blocks.into()),
            ("output_tokens", out.output_tokens.into()),
            (
                "itl_us",
                out.mean_itl_us().map(Value::from).unwrap_or(Value::Null)
            ),
            ("e2e_us", out.e2e_us.into()),
            ("route_wall_us", out.route_wall_us.into()),
            ("e2e_wall_us", out.e2e_wall_us.into()),
        ])
    );
    Ok(())
}

async fn run_disagg(client: &KvRouterClient, params: &GenerateParams) -> anyhow::Result<()> {
    let out = client.generate_disagg(params).await?;
    for e in &out.bookkeeping_errors {
        eprintln!("warning: {e}");
    }
    let d = &out.decision;
    let stage = |k: &kvrouter_protocol::RouteDecision, s: &kvrouter_client::StageOutcome| {
        serde_json::json!({
            "worker_id": k.worker_id,
            "dp_rank": k.dp_rank,
            "overlap_blocks": k.overlap_blocks,
            "ttft_us": s.ttft_us,
            "cached_blocks": s.cached_blocks,
            "output_tokens": s.output_tokens,
            "e2e_us": s.e2e_us,
        })
    };
    let mean_itl = (!out.decode.itl_us.is_empty()).then(|| {
        out.decode.itl_us.iter().map(|&v| f64::from(v)).sum::<f64>()
            / out.decode.itl_us.len() as f64
    });
    println!(
        "{}",
        json_line(&[
            ("request_id", out.request_id.clone().into()),
            ("prefill", stage(&d.prefill, &out.prefill)),
            ("decode", stage(&d.decode, &out.decode)),
            ("replica_id", d.replica_id.clone().into()),
            ("output_tokens", out.decode.output_tokens.into()),
            ("itl_us", mean_itl.map(Value::from).unwrap_or(Value::Null)),
            ("route_wall_us", out.route_wall_us.into()),
            ("e2e_wall_us", out.e2e_wall_us.into()),
        ])
    );
    Ok(())
}

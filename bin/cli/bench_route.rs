//! `kvrouter bench route-latency`: open-loop route latency against running replicas.
//! The measurement lives in `kvrouter_client::latency`.

use super::nats_args::NatsArgs;
use anyhow::{bail, Context};
use clap::Args;
use kvrouter_client::latency::{
    run_route_latency, LatencySummary, RouteLatencyConfig, RouteLatencyReport,
};
use kvrouter_client::KvRouterClient;
use std::time::Duration;

#[derive(Args)]
pub struct RouteLatencyArgs {
    #[command(flatten)]
    pub nats: NatsArgs,
    /// Model name, as the workers register it.
    #[arg(long, env = "KVROUTER_MODEL")]
    pub model: String,
    /// Route requests per second, sent on schedule whatever the replies do (open loop).
    #[arg(long, env = "KVROUTER_RATE")]
    pub rate: f64,
    /// Tokens per prompt.
    #[arg(long, env = "KVROUTER_PROMPT_TOKENS")]
    pub prompt_tokens: usize,
    /// How long to send, in seconds.
    #[arg(long, env = "KVROUTER_DURATION")]
    pub duration: f64,
    /// Fraction of each prompt drawn from a small pool of shared prefixes.
    #[arg(long, env = "KVROUTER_PREFIX_SHARE", default_value_t = 0.5)]
    pub prefix_share: f64,
    /// Shared prefixes in the pool.
    #[arg(long, env = "KVROUTER_PREFIX_POOL", default_value_t = 8)]
    pub prefix_pool: usize,
    /// Seed of the prompt generator.
    #[arg(long, env = "KVROUTER_SEED", default_value_t = 1)]
    pub seed: u64,
    /// Skip running the shared prefixes through the fleet first (by default they are
    /// generated once, so the workers cache them and the index holds them).
    #[arg(long, env = "KVROUTER_NO_WARM_UP")]
    pub no_warm_up: bool,
    /// Per-request timeout, in milliseconds.
    #[arg(long, env = "KVROUTER_TIMEOUT_MS", default_value_t = 2000)]
    pub timeout_ms: u64,
    /// Print one JSON object.
    #[arg(long, env = "KVROUTER_JSON")]
    pub json: bool,
}

pub async fn run(args: RouteLatencyArgs) -> anyhow::Result<()> {
    if !(args.duration.is_finite() && args.duration > 0.0) {
        bail!("--duration must be a positive number of seconds");
    }
    let config = RouteLatencyConfig {
        prefix_share: args.prefix_share,
        prefix_pool: args.prefix_pool,
        seed: args.seed,
        warm_up: !args.no_warm_up,
        ..RouteLatencyConfig::new(
            args.model.clone(),
            args.rate,
            args.prompt_tokens,
            Duration::from_secs_f64(args.duration),
        )
    };
    config.validate().map_err(anyhow::Error::msg)?;
    let bus = args.nats.connect("kvrouter-bench-route").await?;
    let client = KvRouterClient::new(bus, &args.nats.namespace)
        .context("bad --namespace")?
        .with_timeout(Duration::from_millis(args.timeout_ms.max(1)));
    let report = run_route_latency(&client, &config)
        .await
        .map_err(anyhow::Error::msg)?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_table(&report);
    }
    if report.ok == 0 {
        bail!(
            "no route request succeeded (errors by kind: {:?})",
            report.errors
        );
    }
    Ok(())
}

fn print_table(report: &RouteLatencyReport) {
    println!(
        "kvrouter bench route-latency: {} at {} req/s, {} tokens/prompt (prefix share {}), {} s",
        report.model,
        report.target_rate,
        report.prompt_tokens,
        report.prefix_share,
        report.duration_s
    );
    println!(
        "  requests  {} sent ({:.1}/s), {} ok, achieved {:.1} replies/s",
        report.sent, report.send_rate, report.ok, report.achieved_rate
    );
    println!(
        "  {:<24} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "µs", "p50", "p99", "p99.9", "max", "mean"
    );
    let row = |name: &str, s: &LatencySummary| {
        println!(
            "  {name:<24} {:>9} {:>9} {:>9} {:>9} {:>9.1}",
            s.p50_us, s.p99_us, s.p999_us, s.max_us, s.mean_us
        )
    };
    row("latency (from schedule)", &report.latency);
    row("service (from send)", &report.service);
    row("sender lag", &report.send_lag);
    if report.errors.is_empty() {
        println!("  errors    none");
    } else {
        let list: Vec<String> = report
            .errors
            .iter()
            .map(|(k, n)| format!("{k} {n}"))
            .collect();
        println!("  errors    {}", list.join(", "));
    }
}

//! `kvrouter bench route-latency`: open-loop route latency against running replicas.
//! The measurement lives in `kvrouter_bench::route_latency`.

use super::nats_args::NatsArgs;
use anyhow::{bail, Context};
use clap::Args;
use kvrouter_bench::phase_ab::PhaseAb;
use kvrouter_bench::route_latency::{
    run_route_latency, LatencySummary, RouteLatencyConfig, RouteLatencyReport,
};
use kvrouter_client::KvRouterClient;
use kvrouter_replay::requests::{build_requests, load_trace};
use std::sync::Arc;
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
    /// Tokens per prompt (random prompts around shared prefixes).
    #[arg(
        long,
        env = "KVROUTER_PROMPT_TOKENS",
        required_unless_present = "trace"
    )]
    pub prompt_tokens: Option<usize>,
    /// Send a Mooncake trace's prompts instead (each hash id stands for 512 tokens), cycled
    /// in order; the warm-up runs the first --prefix-pool of them through the fleet.
    #[arg(long, env = "KVROUTER_TRACE", conflicts_with = "prompt_tokens")]
    pub trace: Option<std::path::PathBuf>,
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
    /// Measure what the replicas' phase timing costs in this run: their phase timing is
    /// switched off and on every --ab-period-ms through these admin URLs
    /// (`http://HOST:PORT`, comma-separated), and the service time of each half is reported.
    #[arg(long, env = "KVROUTER_PHASE_TIMING_AB", value_delimiter = ',')]
    pub phase_timing_ab: Vec<String>,
    /// With --phase-timing-ab: how long each half-period lasts, in milliseconds.
    #[arg(long, env = "KVROUTER_AB_PERIOD_MS", default_value_t = 500)]
    pub ab_period_ms: u64,
    /// With --phase-timing-ab: a file holding a bearer token with the `debug` scope, when
    /// the admin endpoints are guarded.
    #[arg(long, env = "KVROUTER_ADMIN_TOKEN_FILE")]
    pub admin_token_file: Option<std::path::PathBuf>,
    /// Print one JSON object.
    #[arg(long, env = "KVROUTER_JSON")]
    pub json: bool,
}

pub async fn run(args: RouteLatencyArgs) -> anyhow::Result<()> {
    if !(args.duration.is_finite() && args.duration > 0.0) {
        bail!("--duration must be a positive number of seconds");
    }
    let prompts = match &args.trace {
        Some(path) => {
            let trace = load_trace(path, None)?;
            let requests = build_requests(&trace, 1.0)?;
            Some(Arc::new(requests.into_iter().map(|r| r.tokens).collect()))
        }
        None => None,
    };
    let phase_ab = match args.phase_timing_ab.is_empty() {
        true => None,
        false => Some(PhaseAb {
            admin_urls: args.phase_timing_ab.clone(),
            token: match &args.admin_token_file {
                Some(path) => {
                    let bytes = kvrouter_admin::secret::read_file(path, 4096)
                        .with_context(|| format!("cannot read {}", path.display()))?;
                    Some(String::from_utf8_lossy(&bytes).trim().to_string())
                }
                None => None,
            },
            period: Duration::from_millis(args.ab_period_ms),
        }),
    };
    let config = RouteLatencyConfig {
        phase_ab,
        prefix_share: args.prefix_share,
        prefix_pool: args.prefix_pool,
        seed: args.seed,
        warm_up: !args.no_warm_up,
        prompts,
        ..RouteLatencyConfig::new(
            args.model.clone(),
            args.rate,
            args.prompt_tokens.unwrap_or(0),
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
        print_table(&report, args.trace.as_deref());
    }
    if report.ok == 0 {
        bail!(
            "no route request succeeded (errors by kind: {:?})",
            report.errors
        );
    }
    Ok(())
}

fn print_table(report: &RouteLatencyReport, trace: Option<&std::path::Path>) {
    let prompts = match trace {
        Some(t) => format!(
            "{}'s prompts ({} tokens mean)",
            t.display(),
            report.prompt_tokens
        ),
        None => format!(
            "{} tokens/prompt (prefix share {})",
            report.prompt_tokens, report.prefix_share
        ),
    };
    println!(
        "kvrouter bench route-latency: {} at {} req/s, {prompts}, {} s",
        report.model, report.target_rate, report.duration_s
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
    if let Some(ab) = &report.phase_ab {
        row("service, timing on", &ab.on);
        row("service, timing off", &ab.off);
        println!(
            "  phase timing adds {:+.1}% to the median service time ({} and {} requests)",
            ab.p50_overhead_pct, ab.on.count, ab.off.count
        );
    }
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

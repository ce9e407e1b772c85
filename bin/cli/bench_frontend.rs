//! `kvrouter bench frontend`: the measurement lives in `kvrouter_bench::frontend_bench`.

use clap::Args;
use kvrouter_bench::frontend_bench::{
    run_frontend_bench, FrontendBenchConfig, FrontendBenchReport,
};
use kvrouter_bench::http_load::RateReport;
use kvrouter_bus::NatsOptions;
use std::path::PathBuf;

#[derive(Args)]
pub struct FrontendBenchArgs {
    /// A Hugging Face model directory (tokenizer.json): its tokenizer is timed, and the
    /// frontend serves it (prompts are token ids, so it does not change the latency).
    #[arg(long, env = "KVROUTER_MODEL_DIR")]
    model_dir: PathBuf,
    /// Requests per second, one measured pair of runs (direct, frontend) per rate.
    #[arg(
        long,
        env = "KVROUTER_RATES",
        value_delimiter = ',',
        default_value = "200,1000"
    )]
    rates: Vec<f64>,
    /// Pairs of runs per rate; min, median and max of the added latency are reported.
    #[arg(long, env = "KVROUTER_RUNS", default_value_t = 3)]
    runs: usize,
    /// Seconds of each run.
    #[arg(long, env = "KVROUTER_DURATION", default_value_t = 10.0)]
    duration: f64,
    /// Token ids per prompt.
    #[arg(long, env = "KVROUTER_PROMPT_TOKENS", default_value_t = 8192)]
    prompt_tokens: usize,
    /// Chunks each answer streams.
    #[arg(long, env = "KVROUTER_OUTPUT_TOKENS", default_value_t = 16)]
    output_tokens: usize,
    /// The engine stand-in's time between chunks, in milliseconds.
    #[arg(long, env = "KVROUTER_ENGINE_ITL_MS", default_value_t = 2.0)]
    engine_itl_ms: f64,
    /// Route over this NATS (the frontend, the replica and the bridge each connect);
    /// without it, over the in-process bus.
    #[arg(long = "nats", env = "KVROUTER_NATS", value_name = "URL")]
    nats: Option<String>,
    /// Texts tokenized per size for the tokenizer figure.
    #[arg(long, env = "KVROUTER_TOKENIZE_RUNS", default_value_t = 50)]
    tokenize_runs: usize,
    /// Print one JSON object.
    #[arg(long, env = "KVROUTER_JSON")]
    json: bool,
}

pub async fn run(args: FrontendBenchArgs) -> anyhow::Result<()> {
    let config = FrontendBenchConfig {
        model_dir: args.model_dir,
        rates: args.rates,
        runs: args.runs,
        duration: super::serve::secs("duration", args.duration)?,
        prompt_tokens: args.prompt_tokens,
        output_tokens: args.output_tokens,
        engine_itl: super::serve::millis("engine-itl-ms", args.engine_itl_ms)?,
        nats: args.nats.map(|url| NatsOptions {
            url,
            ..NatsOptions::default()
        }),
        tokenize_runs: args.tokenize_runs,
        seed: 1,
    };
    let report = run_frontend_bench(&config).await?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_report(&report);
    }
    Ok(())
}

fn print_report(r: &FrontendBenchReport) {
    println!(
        "{}-token token-id prompts, {} chunks {} us apart, {} s runs, routed over the {} bus",
        r.prompt_tokens, r.output_tokens, r.engine_itl_us, r.duration_s, r.bus
    );
    print_rates(&r.rates, ("engine  ", "frontend"), "the frontend");
    for t in &r.tokenize {
        println!(
            "tokenizer (vocabulary {}), texts of {} tokens ({} bytes): {:.0} / {:.0} / {:.0} us per 1k tokens (min / median / max)",
            r.vocab_size, t.tokens, t.bytes, t.us_per_1k_tokens.min, t.us_per_1k_tokens.median, t.us_per_1k_tokens.max
        );
    }
}

/// Each rate's runs (the baseline path, then the measured one) and what the measured path
/// added: `names` label the two paths, `what` the measured one.
pub(super) fn print_rates(rates: &[RateReport], names: (&str, &str), what: &str) {
    for rate in rates {
        println!("at {} requests/s:", rate.rate);
        for (i, run) in rate.runs.iter().enumerate() {
            for (path, p) in [(names.0, &run.baseline), (names.1, &run.measured)] {
                println!(
                    "  run {} {path}: first bytes p50 {} us p99 {} us max {} us; end p99 {} us; {} ok {} failed; {:.0}/s; cpu {}",
                    i + 1,
                    p.ttft.p50_us,
                    p.ttft.p99_us,
                    p.ttft.max_us,
                    p.end.p99_us,
                    p.ok,
                    p.failed,
                    p.achieved_rate,
                    p.cpu_cores.map_or("?".into(), |c| format!("{c:.2} cores")),
                );
            }
        }
        let s = |x: &kvrouter_bench::stats::Spread| {
            format!("{:.0} / {:.0} / {:.0}", x.min, x.median, x.max)
        };
        println!(
            "  added by {what} (min / median / max us): first bytes p50 {}, p99 {}; end p99 {}",
            s(&rate.added_ttft_p50_us),
            s(&rate.added_ttft_p99_us),
            s(&rate.added_end_p99_us)
        );
    }
}

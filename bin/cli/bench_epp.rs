//! `kvrouter bench epp`: the measurement lives in `kvrouter_bench::epp_bench`.

use clap::Args;
use kvrouter_bench::epp_bench::{run_epp_bench, EppBenchConfig, EppBenchReport};
use kvrouter_bus::NatsOptions;
use std::path::PathBuf;

#[derive(Args)]
pub struct EppBenchArgs {
    /// A Hugging Face model directory (tokenizer.json): the picker serves it (prompts are
    /// token ids, so it does not change the latency).
    #[arg(long, env = "KVROUTER_MODEL_DIR")]
    model_dir: PathBuf,
    /// Requests per second, one measured pair of runs (round robin, picker) per rate.
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
    /// The engine stand-ins' time between chunks, in milliseconds.
    #[arg(long, env = "KVROUTER_ENGINE_ITL_MS", default_value_t = 2.0)]
    engine_itl_ms: f64,
    /// Engine stand-ins behind the gateway.
    #[arg(long, env = "KVROUTER_ENGINES", default_value_t = 2)]
    engines: usize,
    /// Route over this NATS (the picker, the replica and the bridges each connect); without
    /// it, over the in-process bus.
    #[arg(long = "nats", env = "KVROUTER_NATS", value_name = "URL")]
    nats: Option<String>,
    /// Print one JSON object.
    #[arg(long, env = "KVROUTER_JSON")]
    json: bool,
}

pub async fn run(args: EppBenchArgs) -> anyhow::Result<()> {
    let config = EppBenchConfig {
        model_dir: args.model_dir,
        rates: args.rates,
        runs: args.runs,
        duration: super::serve::secs("duration", args.duration)?,
        prompt_tokens: args.prompt_tokens,
        output_tokens: args.output_tokens,
        engine_itl: super::serve::millis("engine-itl-ms", args.engine_itl_ms)?,
        engines: args.engines,
        nats: args.nats.map(|url| NatsOptions {
            url,
            ..NatsOptions::default()
        }),
        seed: 1,
    };
    let report = run_epp_bench(&config).await?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_report(&report);
    }
    Ok(())
}

fn print_report(r: &EppBenchReport) {
    println!(
        "{}-token token-id prompts, {} chunks {} us apart, {} engines, {} s runs, one Envoy (--concurrency 1), routed over the {} bus",
        r.prompt_tokens, r.output_tokens, r.engine_itl_us, r.engines, r.duration_s, r.bus
    );
    super::bench_frontend::print_rates(&r.rates, ("round robin", "picker     "), "the picker");
}

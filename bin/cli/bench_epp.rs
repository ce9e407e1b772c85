//! `kvrouter bench epp`: the measurement lives in `kvrouter_bench::epp_bench`.

use super::bench_load::{print_rates, LoadArgs};
use clap::Args;
use kvrouter_bench::epp_bench::{run_epp_bench, EppBenchConfig, EppBenchReport};
use std::path::PathBuf;

#[derive(Args)]
pub struct EppBenchArgs {
    /// A Hugging Face model directory (tokenizer.json): the picker serves it (prompts are
    /// token ids, so it does not change the latency).
    #[arg(long, env = "KVROUTER_MODEL_DIR")]
    model_dir: PathBuf,
    #[command(flatten)]
    load: LoadArgs,
    /// Engine stand-ins behind the gateway.
    #[arg(long, env = "KVROUTER_ENGINES", default_value_t = 2)]
    engines: usize,
}

pub async fn run(args: EppBenchArgs) -> anyhow::Result<()> {
    let config = EppBenchConfig {
        model_dir: args.model_dir,
        load: args.load.config()?,
        engines: args.engines,
    };
    let report = run_epp_bench(&config).await?;
    if args.load.json {
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
    print_rates(&r.rates, ("round robin", "picker     "), "the picker");
}

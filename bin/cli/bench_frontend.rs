//! `kvrouter bench frontend`: the measurement lives in `kvrouter_bench::frontend_bench`.

use super::bench_load::{print_rates, LoadArgs};
use clap::Args;
use kvrouter_bench::frontend_bench::{
    run_frontend_bench, FrontendBenchConfig, FrontendBenchReport,
};
use std::path::PathBuf;

#[derive(Args)]
pub struct FrontendBenchArgs {
    /// A Hugging Face model directory (tokenizer.json): its tokenizer is timed, and the
    /// frontend serves it (prompts are token ids, so it does not change the latency).
    #[arg(long, env = "KVROUTER_MODEL_DIR")]
    model_dir: PathBuf,
    #[command(flatten)]
    load: LoadArgs,
    /// Texts tokenized per size for the tokenizer figure.
    #[arg(long, env = "KVROUTER_TOKENIZE_RUNS", default_value_t = 50)]
    tokenize_runs: usize,
}

pub async fn run(args: FrontendBenchArgs) -> anyhow::Result<()> {
    let config = FrontendBenchConfig {
        model_dir: args.model_dir,
        load: args.load.config()?,
        tokenize_runs: args.tokenize_runs,
    };
    let report = run_frontend_bench(&config).await?;
    if args.load.json {
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

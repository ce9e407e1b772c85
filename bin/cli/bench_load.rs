//! What `bench frontend` and `bench epp` share: the load's flags and the report of paired
//! runs.

use clap::Args;
use kvrouter_bench::http_load::{LoadConfig, RateReport};
use kvrouter_bus::NatsOptions;

/// The open-loop load a door bench sends.
#[derive(Args)]
pub struct LoadArgs {
    /// Requests per second, one measured pair of runs (baseline, measured) per rate.
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
    /// Route over this NATS (every part connects on its own); without it, over the
    /// in-process bus.
    #[arg(long = "nats", env = "KVROUTER_NATS", value_name = "URL")]
    nats: Option<String>,
    /// Print one JSON object.
    #[arg(long, env = "KVROUTER_JSON")]
    pub json: bool,
}

impl LoadArgs {
    pub fn config(&self) -> anyhow::Result<LoadConfig> {
        Ok(LoadConfig {
            rates: self.rates.clone(),
            runs: self.runs,
            duration: super::serve::secs("duration", self.duration)?,
            prompt_tokens: self.prompt_tokens,
            output_tokens: self.output_tokens,
            engine_itl: super::serve::millis("engine-itl-ms", self.engine_itl_ms)?,
            nats: self.nats.clone().map(|url| NatsOptions {
                url,
                ..NatsOptions::default()
            }),
            seed: 1,
        })
    }
}

/// Each rate's runs (the baseline path, then the measured one) and what the measured path
/// added: `names` label the two paths, `what` the measured one.
pub fn print_rates(rates: &[RateReport], names: (&str, &str), what: &str) {
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

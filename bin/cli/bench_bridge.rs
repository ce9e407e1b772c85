//! `kvrouter bench bridge`: the measurement lives in `kvrouter_bench::bridge_bench`.

use anyhow::bail;
use clap::Args;
use kvrouter_bench::bridge_bench::{latency_run, record_stream, throughput_run, StreamShape};
use serde_json::json;

#[derive(Args)]
pub struct BridgeBenchArgs {
    /// Blocks in the recorded stream of the throughput runs.
    #[arg(long, env = "KVROUTER_BLOCKS", default_value_t = 2_000_000)]
    blocks: usize,
    /// Throughput runs; min, median and max are reported.
    #[arg(long, env = "KVROUTER_RUNS", default_value_t = 5)]
    runs: usize,
    /// Engine publish rate of the latency run, in blocks per second.
    #[arg(long, env = super::renamed_env::env("KVROUTER_BLOCK_RATE"), default_value_t = 50_000.0)]
    rate: f64,
    /// Length of the latency run, in seconds.
    #[arg(long, env = "KVROUTER_DURATION", default_value_t = 5.0)]
    duration: f64,
    #[arg(long, env = "KVROUTER_BLOCK_SIZE", default_value_t = 16)]
    block_size: u32,
    /// Print one JSON object.
    #[arg(long, env = "KVROUTER_JSON")]
    json: bool,
}

pub async fn run(args: BridgeBenchArgs) -> anyhow::Result<()> {
    super::renamed_env::log_warnings();
    if args.runs == 0 || args.blocks == 0 {
        bail!("--runs and --blocks must be at least 1");
    }
    if !(args.rate > 0.0 && args.duration > 0.0) {
        bail!("--rate and --duration must be above 0");
    }
    let shape = StreamShape {
        block_size: args.block_size,
        ..StreamShape::default()
    };
    let per_batch = shape.blocks_per_event * shape.events_per_batch;
    let (stream, stored) = record_stream(&shape, args.blocks.div_ceil(per_batch));
    let bytes: usize = stream.iter().map(Vec::len).sum();
    let mut rates: Vec<f64> = (0..args.runs)
        .map(|_| {
            let (blocks, took) = throughput_run(&stream, &shape);
            assert_eq!(blocks, stored, "every stored block is forwarded");
            blocks as f64 / took.as_secs_f64()
        })
        .collect();
    rates.sort_by(f64::total_cmp);
    let (min, med, max) = (rates[0], rates[rates.len() / 2], rates[rates.len() - 1]);

    let batches = ((args.rate * args.duration) as usize)
        .div_ceil(per_batch)
        .max(1);
    let (live, _) = record_stream(
        &StreamShape {
            seed: 2,
            ..shape.clone()
        },
        batches,
    );
    let lat = latency_run(&live, &shape, args.rate).await?;
    if args.json {
        println!(
            "{}",
            json!({
                "stream": {"blocks": stored, "bytes": bytes, "batches": stream.len()},
                "throughput_blocks_per_s": {"min": min, "median": med, "max": max, "runs": args.runs},
                "latency_us": {"rate_blocks_per_s": args.rate, "batches": lat.count,
                    "p50": lat.p50_us, "p99": lat.p99_us, "max": lat.max_us, "mean": lat.mean_us},
            })
        );
    } else {
        println!(
            "stream: {stored} blocks in {} batches, {:.1} MB of msgpack",
            stream.len(),
            bytes as f64 / 1e6
        );
        println!(
            "decode + mirror + translate, one core: min {:.2} M / median {:.2} M / max {:.2} M blocks/s over {} runs",
            min / 1e6,
            med / 1e6,
            max / 1e6,
            args.runs
        );
        println!(
            "engine publish -> index at {:.0} blocks/s ({} batches): p50 {} us, p99 {} us, max {} us",
            args.rate, lat.count, lat.p50_us, lat.p99_us, lat.max_us
        );
    }
    Ok(())
}

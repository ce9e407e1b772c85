//! Subcommand implementations: argument parsing and output only; the work lives in crates/.

pub mod bench;
pub mod bench_route;
pub mod generate;
pub mod hash;
pub mod lifecycle;
pub mod mocker;
pub mod nats_args;
pub mod replay;
pub mod route;
pub mod serve;
pub mod subjects;

use anyhow::Context;

/// Logs go to stderr; `KVROUTER_LOG` (or `RUST_LOG`) sets the filter, else `default`.
pub fn init_tracing(default: &str) {
    let filter = std::env::var("KVROUTER_LOG")
        .or_else(|_| std::env::var("RUST_LOG"))
        .unwrap_or_else(|_| default.into());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        .try_init();
}

pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")
}

/// Runs `fut` on a fresh runtime. Stopping the runtime afterwards is bounded too: a blocking
/// task (a DNS lookup towards a NATS that is gone) must not hold up the exit.
pub fn block_on<T>(fut: impl std::future::Future<Output = anyhow::Result<T>>) -> anyhow::Result<T> {
    let rt = runtime()?;
    let result = rt.block_on(fut);
    rt.shutdown_timeout(std::time::Duration::from_millis(500));
    result
}

/// Parses a u64 written in decimal or as 0x-prefixed hex.
pub fn parse_u64(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let parsed = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => s.parse(),
    };
    parsed.map_err(|e| format!("{s:?} is not a u64 (decimal or 0x hex): {e}"))
}

//! The kvrouter binary: one subcommand per process kind.

use clap::{Parser, Subcommand};
use mimalloc::MiMalloc;

mod cli;

#[global_allocator]
static GLOBAL: MiMalloc = MiMalloc;

#[derive(Parser)]
#[command(
    name = "kvrouter",
    version,
    about = "KV-cache-aware router for LLM inference fleets"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the local and sequence block hashes of a token list.
    Hash(cli::hash::HashArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(cli::bench::BenchCommand),
}

fn main() -> std::process::ExitCode {
    cli::init_tracing();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Hash(args) => cli::hash::run(args),
        Command::Bench(cmd) => cli::runtime().and_then(|rt| rt.block_on(cli::bench::run(cmd))),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

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
    /// More logs on stderr: -v info, -vv kvrouter debug, -vvv trace. Client commands show only
    /// warnings by default, serve and mocker kvrouter's own info lines. KVROUTER_LOG (or
    /// RUST_LOG), a tracing filter such as "info,kvrouter_replica=debug", overrides it.
    #[arg(short, long, global = true, action = clap::ArgAction::Count, env = "KVROUTER_VERBOSE")]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the local and sequence block hashes of a token list.
    Hash(cli::hash::HashArgs),
    /// Run a router replica.
    Serve(Box<cli::serve::ServeArgs>),
    /// Run a fleet of simulated engine workers (no GPU) on the bus.
    Mocker(cli::mocker::MockerArgs),
    /// Speak for one vLLM or SGLang engine on the bus: its KV events from ZeroMQ, its
    /// health and load over HTTP (a sidecar beside the engine).
    Bridge(cli::bridge::BridgeArgs),
    /// An OpenAI-compatible HTTP server in front of the fleet: tokenizes, routes through the
    /// replicas, streams from the chosen engine.
    Frontend(cli::frontend::FrontendArgs),
    /// A Gateway API Inference Extension endpoint picker: a gateway's ext_proc filter asks
    /// it per request which engine should serve (Envoy's external processing, gRPC).
    Epp(cli::epp::EppArgs),
    /// Replay a Mooncake trace that ships in the repo through two router replicas and a
    /// simulated fleet, kv routing against round robin, and print what kv bought.
    Demo(cli::replay::DemoArgs),
    /// Benchmarks.
    #[cfg(feature = "bench")]
    #[command(subcommand)]
    Bench(cli::bench::BenchCommand),
    /// Ask the router replicas for one routing decision; prints it as JSON.
    Route(cli::route::RouteArgs),
    /// Route one request and run it on the chosen worker, as a frontend does; prints JSON.
    Generate(cli::generate::GenerateArgs),
    /// Print every bus subject of a model's fleet (no NATS needed).
    Subjects(cli::subjects::SubjectsArgs),
    /// Make one NATS identity per replica, frontend, bridge and peer router: nkey seeds, the
    /// nats-server users they are confined by, and Kubernetes Secrets (no NATS needed).
    Creds(cli::creds::CredsArgs),
}

/// The index's hash tables come from the system allocator (everything else from mimalloc).
/// A fixed mmap threshold makes every large table its own mapping, returned to the OS as soon
/// as a resize frees it; glibc's default threshold drifts up and keeps such memory instead.
fn tune_system_allocator() {
    // SAFETY: mallopt only adjusts glibc's allocator parameters.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 64 << 10);
    }
}

fn main() -> std::process::ExitCode {
    tune_system_allocator();
    let cli = Cli::parse();
    let long_running = matches!(
        cli.command,
        Command::Serve(_)
            | Command::Mocker(_)
            | Command::Bridge(_)
            | Command::Frontend(_)
            | Command::Epp(_)
    );
    cli::init_tracing(
        if long_running {
            cli::LogDefault::Service
        } else {
            cli::LogDefault::Quiet
        },
        cli.verbose,
    );
    let result = match cli.command {
        Command::Hash(args) => cli::hash::run(args),
        Command::Serve(args) => cli::block_on(cli::serve::run(*args)),
        Command::Mocker(args) => cli::block_on(cli::mocker::run(args)),
        Command::Bridge(args) => cli::block_on(cli::bridge::run(args)),
        Command::Frontend(args) => cli::block_on(cli::frontend::run(args)),
        Command::Epp(args) => cli::block_on(cli::epp::run(args)),
        #[cfg(feature = "bench")]
        Command::Bench(cmd) => cli::bench::run(cmd),
        Command::Demo(args) => cli::replay::run_demo(args),
        Command::Route(args) => cli::block_on(cli::route::run(args)),
        Command::Generate(args) => cli::block_on(cli::generate::run(args)),
        Command::Subjects(args) => cli::subjects::run(args),
        Command::Creds(args) => cli::creds::run(args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", cli::error_chain(&e));
            std::process::ExitCode::FAILURE
        }
    }
}

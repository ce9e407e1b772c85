//! `kvrouter bench hostile`: the real fleet under honest traffic, alone and then beside each
//! adversary; exits non-zero when a process died, honest success fell, memory passed its
//! ceiling or a process did not exit on SIGTERM within its drain timeout. The run lives in
//! `kvrouter_bench::hostile`.

use anyhow::{bail, Context};
use clap::Args;
use kvrouter_bench::hostile::{run_hostile, Attack, HostileConfig};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Args)]
pub struct HostileArgs {
    /// The frontend's model directory (tokenizer.json, tokenizer_config.json, config.json).
    #[arg(long, env = "KVROUTER_HOSTILE_MODEL_DIR")]
    pub model_dir: PathBuf,
    /// Seconds of each phase (clean, then one per attack).
    #[arg(long, env = "KVROUTER_HOSTILE_PHASE_SECS", default_value_t = 10.0)]
    pub phase_secs: f64,
    /// Seed of the attacks and the honest traffic.
    #[arg(long, env = "KVROUTER_HOSTILE_SEED", default_value_t = 1)]
    pub seed: u64,
    /// The attacks, in order (comma-separated): slowloris, bodies, labels, allowed_workers,
    /// request_ids, lease_theft, forged_worker, frontend_impostor, reply_reader,
    /// poison_frames.
    #[arg(
        long,
        env = "KVROUTER_HOSTILE_ATTACKS",
        default_value = "slowloris,bodies,labels,allowed_workers,request_ids,lease_theft,forged_worker,frontend_impostor,reply_reader,poison_frames",
        value_delimiter = ','
    )]
    pub attacks: Vec<String>,
    /// Slow or half-open connections per HTTP listener in the slowloris phase.
    #[arg(
        long,
        env = "KVROUTER_HOSTILE_SLOW_CONNECTIONS",
        default_value_t = 1100
    )]
    pub slow_connections: usize,
    /// Honest completion clients (through the frontend), each one request at a time.
    #[arg(long, env = "KVROUTER_HOSTILE_COMPLETION_CLIENTS", default_value_t = 2)]
    pub completion_clients: usize,
    /// Honest route clients (a replica's JSON API), each one request at a time.
    #[arg(long, env = "KVROUTER_HOSTILE_ROUTE_CLIENTS", default_value_t = 1)]
    pub route_clients: usize,
    /// After each phase, the longest wait for the fleet to serve a completion and a route
    /// again before the next phase starts anyway.
    #[arg(
        long,
        env = "KVROUTER_HOSTILE_RECOVERY_TIMEOUT_SECS",
        default_value_t = 30.0
    )]
    pub recovery_timeout_secs: f64,
    /// Every process's --drain-timeout-secs: each must exit on SIGTERM within it.
    #[arg(
        long,
        env = "KVROUTER_HOSTILE_DRAIN_TIMEOUT_SECS",
        default_value_t = 5.0
    )]
    pub drain_timeout_secs: f64,
    /// The least honest success rate (0..=1) accepted in any phase.
    #[arg(long, env = "KVROUTER_HOSTILE_MIN_SUCCESS", default_value_t = 0.99)]
    pub min_success: f64,
    /// The most resident memory (MiB) any process may reach: generous, as a frontend
    /// parsing several large bodies at once holds their JSON trees (many times the bytes);
    /// what it catches is growth without bound.
    #[arg(long, env = "KVROUTER_HOSTILE_MAX_RSS_MIB", default_value_t = 2048.0)]
    pub max_rss_mib: f64,
    /// A process past this many MiB resident is SIGKILLed (and counts as dead), so that a
    /// runaway does not take the machine with it.
    #[arg(long, env = "KVROUTER_HOSTILE_KILL_RSS_MIB", default_value_t = 4096.0)]
    pub kill_rss_mib: f64,
    /// The control run: nats-server without the generated users file (everyone may say and
    /// read anything on the bus). The bus attacks then take effect and the run fails: it
    /// shows what the locked bus stops, and that the bench would notice.
    #[arg(long, env = "KVROUTER_HOSTILE_OPEN_BUS")]
    pub open_bus: bool,
    /// Write each child process's stderr to DIR/NAME.log.
    #[arg(long, env = "KVROUTER_HOSTILE_LOG_DIR")]
    pub log_dir: Option<PathBuf>,
    /// Print one JSON object.
    #[arg(long, env = "KVROUTER_HOSTILE_JSON")]
    pub json: bool,
}

pub async fn run(args: HostileArgs) -> anyhow::Result<()> {
    if !(args.phase_secs.is_finite() && args.phase_secs > 0.0) {
        bail!("--phase-secs must be a positive number of seconds");
    }
    if !(args.drain_timeout_secs.is_finite() && args.drain_timeout_secs > 0.0) {
        bail!("--drain-timeout-secs must be a positive number of seconds");
    }
    if !(args.recovery_timeout_secs.is_finite() && args.recovery_timeout_secs >= 0.0) {
        bail!("--recovery-timeout-secs must be a number of seconds");
    }
    if !(0.0..=1.0).contains(&args.min_success) {
        bail!("--min-success is a rate, 0..=1");
    }
    let mut attacks = Vec::new();
    for name in args
        .attacks
        .iter()
        .map(|a| a.trim())
        .filter(|a| !a.is_empty())
    {
        match Attack::named(name) {
            Some(a) => attacks.push(a),
            None => {
                let known: Vec<&str> = Attack::ALL.iter().map(|a| a.as_str()).collect();
                bail!("--attacks takes {}, not {name:?}", known.join(", "))
            }
        }
    }
    let exe = std::env::current_exe().context("cannot find the kvrouter executable")?;
    let mut cfg = HostileConfig::new(
        exe,
        args.model_dir,
        Duration::from_secs_f64(args.phase_secs),
        args.seed,
    );
    cfg.attacks = attacks;
    cfg.slow_connections = args.slow_connections;
    cfg.completion_clients = args.completion_clients;
    cfg.route_clients = args.route_clients;
    cfg.drain_timeout = Duration::from_secs_f64(args.drain_timeout_secs);
    cfg.recovery_timeout = Duration::from_secs_f64(args.recovery_timeout_secs);
    cfg.thresholds.min_success = args.min_success;
    cfg.thresholds.max_rss_mib = args.max_rss_mib;
    cfg.kill_rss_mib = args.kill_rss_mib;
    cfg.open_bus = args.open_bus;
    cfg.log_dir = args.log_dir;
    let report = run_hostile(cfg).await?;
    super::bench::print_report(
        args.json,
        serde_json::to_value(&report)?,
        report.passed(),
        || report.render(),
    )?;
    if !report.passed() {
        bail!(
            "the fleet did not absorb the attacks: {}",
            report.failures.join("; ")
        );
    }
    Ok(())
}

//! Subcommand implementations: argument parsing and output only; the work lives in crates/.

#[cfg(feature = "bench")]
pub mod bench;
#[cfg(feature = "bench")]
pub mod bench_bridge;
#[cfg(feature = "bench")]
pub mod bench_chaos;
#[cfg(feature = "bench")]
pub mod bench_epp;
#[cfg(feature = "bench")]
pub mod bench_frontend;
#[cfg(feature = "bench")]
pub mod bench_hostile;
#[cfg(feature = "bench")]
pub mod bench_load;
#[cfg(feature = "bench")]
pub mod bench_route;
pub mod bridge;
pub mod cost_args;
pub mod creds;
pub mod epp;
pub mod frontend;
pub mod generate;
pub mod hash;
pub mod http_args;
pub mod lifecycle;
pub mod mocker;
pub mod nats_args;
pub mod openai_args;
pub mod renamed_env;
pub mod replay;
pub mod route;
pub mod serve;
pub mod subjects;
pub mod traces_args;

use anyhow::Context;
use std::io::IsTerminal;

/// Which logs a command shows unless `-v` or `KVROUTER_LOG` says otherwise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogDefault {
    /// Client commands: their output is the answer; only warnings and errors beside it.
    Quiet,
    /// Long-running commands: kvrouter's own info lines, dependencies' warnings only.
    Service,
}

/// The log filter: `KVROUTER_LOG`, else `RUST_LOG`, else the default for the command raised
/// by `-v` (info), `-vv` (kvrouter debug), `-vvv` (kvrouter trace, the rest debug).
pub fn log_filter(
    default: LogDefault,
    verbose: u8,
    env: impl Fn(&str) -> Option<String>,
) -> String {
    if let Some(f) = env("KVROUTER_LOG").or_else(|| env("RUST_LOG")) {
        return f;
    }
    match (verbose, default) {
        (0, LogDefault::Quiet) => "warn",
        // A directive's target matches by prefix: `kvrouter` covers every kvrouter_* crate.
        (0, LogDefault::Service) => "warn,kvrouter=info",
        (1, _) => "info",
        (2, _) => "info,kvrouter=debug",
        _ => "debug,kvrouter=trace",
    }
    .to_string()
}

/// Colours only for a terminal, and not when `NO_COLOR` is set to anything (no-color.org).
pub fn log_colors(stderr_is_terminal: bool, no_color: Option<String>) -> bool {
    stderr_is_terminal && no_color.is_none_or(|v| v.is_empty())
}

/// Logs go to stderr, filtered by [`log_filter`], coloured as [`log_colors`] says.
pub fn init_tracing(default: LogDefault, verbose: u8) {
    let env = |k: &str| std::env::var(k).ok();
    let filter = log_filter(default, verbose, env);
    let ansi = log_colors(std::io::stderr().is_terminal(), env("NO_COLOR"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_ansi(ansi)
        .with_writer(std::io::stderr)
        .try_init();
}

/// The error and its causes joined by ": ", leaving out a cause whose text is already in
/// what is printed: library errors often put their source in their own message too, and the
/// operator should read each cause once.
pub fn error_chain(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
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
/// The start line a long-running command prints on stdout once it serves (addresses and
/// ids, one JSON value), flushed at once: scripts and tests wait for it.
pub fn print_start_line(line: impl std::fmt::Display) -> anyhow::Result<()> {
    use anyhow::Context;
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}").context("cannot write to stdout")?;
    out.flush().context("cannot write to stdout")
}

pub fn parse_u64(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let parsed = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => s.parse(),
    };
    parsed.map_err(|e| format!("{s:?} is not a u64 (decimal or 0x hex): {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn log_filter_defaults_verbosity_and_overrides() {
        use LogDefault::*;
        assert_eq!(log_filter(Quiet, 0, env(&[])), "warn");
        assert_eq!(log_filter(Service, 0, env(&[])), "warn,kvrouter=info");
        assert_eq!(log_filter(Quiet, 1, env(&[])), "info");
        assert_eq!(log_filter(Service, 2, env(&[])), "info,kvrouter=debug");
        assert_eq!(log_filter(Quiet, 3, env(&[])), "debug,kvrouter=trace");
        assert_eq!(log_filter(Quiet, 9, env(&[])), "debug,kvrouter=trace");
        let both = [("RUST_LOG", "error"), ("KVROUTER_LOG", "trace")];
        assert_eq!(log_filter(Quiet, 2, env(&both)), "trace");
        assert_eq!(log_filter(Service, 0, env(&both[..1])), "error");
    }

    #[test]
    fn service_default_filter_keeps_kvrouter_info_and_drops_dependency_info() {
        use tracing_subscriber::layer::SubscriberExt;
        let filter =
            tracing_subscriber::EnvFilter::new(log_filter(LogDefault::Service, 0, env(&[])));
        let subscriber = tracing_subscriber::registry().with(filter);
        tracing::subscriber::with_default(subscriber, || {
            use tracing::{enabled, Level};
            assert!(enabled!(target: "kvrouter_replica::replica", Level::INFO));
            assert!(enabled!(target: "kvrouter::cli::serve", Level::INFO));
            assert!(!enabled!(target: "kvrouter_bus", Level::DEBUG));
            assert!(!enabled!(target: "async_nats::connector", Level::INFO));
            assert!(enabled!(target: "async_nats::connector", Level::WARN));
        });
    }

    #[test]
    fn colors_only_on_a_terminal_without_no_color() {
        assert!(log_colors(true, None));
        assert!(log_colors(true, Some(String::new())));
        assert!(!log_colors(true, Some("1".into())));
        assert!(!log_colors(false, None));
    }

    #[derive(Debug)]
    struct Io;
    impl std::fmt::Display for Io {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("Address already in use (os error 98)")
        }
    }
    impl std::error::Error for Io {}

    /// Like a thiserror `#[error("... {source}")]` with `#[source]`.
    #[derive(Debug)]
    struct Bind(Io);
    impl std::fmt::Display for Bind {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "cannot bind the admin address 127.0.0.1:1: {}", self.0)
        }
    }
    impl std::error::Error for Bind {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn error_chain_prints_each_cause_once() {
        let e = anyhow::Error::new(Bind(Io)).context("cannot start the replica");
        assert_eq!(
            format!("{e:#}"),
            "cannot start the replica: cannot bind the admin address 127.0.0.1:1: Address \
             already in use (os error 98): Address already in use (os error 98)"
        );
        assert_eq!(
            error_chain(&e),
            "cannot start the replica: cannot bind the admin address 127.0.0.1:1: Address \
             already in use (os error 98)"
        );
        // Causes not already shown are all kept, in order.
        let e = anyhow::Error::new(Io).context("b").context("a");
        assert_eq!(
            error_chain(&e),
            "a: b: Address already in use (os error 98)"
        );
    }
}

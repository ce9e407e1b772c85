//! The lifecycle of a long-running command (`serve`, `mocker`, and any later one):
//!
//! 1. [`Lifecycle::install`] takes over SIGTERM and SIGINT before anything starts;
//! 2. [`Lifecycle::startup`] runs the start-up; a signal meanwhile exits at once;
//! 3. [`Lifecycle::wait`] waits for the first signal;
//! 4. [`Lifecycle::shutdown`] runs the graceful shutdown, bounded by the drain timeout
//!    whatever the bus does (the command's own draining gets [`Lifecycle::drain_budget`], the
//!    last [`SHUTDOWN_MARGIN`] is kept for the final bus work): past it the command logs what
//!    was left undone and fails (exit 1). A second SIGTERM or SIGINT meanwhile exits at once with
//!    128 + the signal number (143 for SIGTERM, 130 for SIGINT), as a shell reports a process
//!    killed by that signal.

use std::future::Future;
use std::time::Duration;

/// The end of the drain timeout kept for the final bus work (a bounded flush,
/// [`kvrouter_bus::SHUTDOWN_FLUSH_TIMEOUT`]) and stopping the actors; also the least time a
/// shutdown gets.
pub const SHUTDOWN_MARGIN: Duration = Duration::from_secs(2);

/// A stop signal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopSignal {
    Term,
    Int,
}

impl StopSignal {
    pub fn name(self) -> &'static str {
        match self {
            StopSignal::Term => "SIGTERM",
            StopSignal::Int => "SIGINT",
        }
    }

    /// 128 + the signal number: what a shell shows for a process the signal killed.
    pub fn exit_code(self) -> i32 {
        match self {
            StopSignal::Term => 128 + 15,
            StopSignal::Int => 128 + 2,
        }
    }
}

#[cfg(unix)]
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

#[cfg(unix)]
impl Signals {
    fn install() -> anyhow::Result<Self> {
        use anyhow::Context;
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Self {
            term: signal(SignalKind::terminate()).context("cannot handle SIGTERM")?,
            int: signal(SignalKind::interrupt()).context("cannot handle SIGINT")?,
        })
    }

    async fn next(&mut self) -> StopSignal {
        tokio::select! {
            _ = self.term.recv() => StopSignal::Term,
            _ = self.int.recv() => StopSignal::Int,
        }
    }
}

#[cfg(not(unix))]
struct Signals;

#[cfg(not(unix))]
impl Signals {
    fn install() -> anyhow::Result<Self> {
        Ok(Self)
    }

    async fn next(&mut self) -> StopSignal {
        let _ = tokio::signal::ctrl_c().await;
        StopSignal::Int
    }
}

/// Signal handling and the shutdown bound of one long-running command.
pub struct Lifecycle {
    command: &'static str,
    drain_timeout: Duration,
    signals: Signals,
}

impl Lifecycle {
    /// Takes over SIGTERM and SIGINT (call it from inside the runtime, before the start-up).
    pub fn install(command: &'static str, drain_timeout: Duration) -> anyhow::Result<Self> {
        Ok(Self {
            command,
            drain_timeout,
            signals: Signals::install()?,
        })
    }

    /// The most the shutdown may take: the drain timeout (at least [`SHUTDOWN_MARGIN`]).
    pub fn budget(&self) -> Duration {
        self.drain_timeout.max(SHUTDOWN_MARGIN)
    }

    /// How long the command's own draining (in-flight requests, tasks) may take, so that the
    /// final bus work still fits in [`Lifecycle::budget`].
    pub fn drain_budget(&self) -> Duration {
        self.budget().saturating_sub(SHUTDOWN_MARGIN)
    }

    /// Runs the start-up; a stop signal before it is done exits the process at once (there is
    /// nothing to drain yet).
    pub async fn startup<T>(
        &mut self,
        start: impl Future<Output = anyhow::Result<T>>,
    ) -> anyhow::Result<T> {
        tokio::select! {
            started = start => started,
            sig = self.signals.next() => {
                tracing::warn!("{} during start-up: exiting", sig.name());
                std::process::exit(sig.exit_code());
            }
        }
    }

    /// Waits for the first SIGTERM or SIGINT.
    pub async fn wait(&mut self) -> StopSignal {
        let sig = self.signals.next().await;
        tracing::info!(
            "{} received: {} shutting down (at most {:?}; a second SIGTERM or SIGINT exits at once)",
            sig.name(),
            self.command,
            self.budget()
        );
        sig
    }

    /// Runs the graceful `shutdown`, bounded by [`Lifecycle::budget`]; `what` says what it
    /// was doing (asked when it is cut short, so it can tell the state then). A second signal
    /// exits at once.
    pub async fn shutdown(
        &mut self,
        what: impl Fn() -> String,
        shutdown: impl Future<Output = anyhow::Result<()>>,
    ) -> anyhow::Result<()> {
        let budget = self.budget();
        tokio::select! {
            done = tokio::time::timeout(budget, shutdown) => match done {
                Ok(result) => result,
                Err(_) => {
                    let what = what();
                    tracing::warn!(
                        "{} shutdown did not finish within {budget:?} (--drain-timeout-secs); \
                         left undone: {what}",
                        self.command
                    );
                    anyhow::bail!(
                        "{} shutdown did not finish within {budget:?}; left undone: {what}",
                        self.command
                    )
                }
            },
            sig = self.signals.next() => {
                let what = what();
                tracing::warn!(
                    "second signal ({}) during the shutdown: exiting at once, left undone: {what}",
                    sig.name()
                );
                std::process::exit(sig.exit_code());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_are_128_plus_the_signal() {
        assert_eq!(StopSignal::Term.exit_code(), 128 + libc::SIGTERM);
        assert_eq!(StopSignal::Int.exit_code(), 128 + libc::SIGINT);
    }

    #[tokio::test(start_paused = true)]
    async fn a_shutdown_that_runs_over_fails_naming_what_was_left() {
        let mut life = Lifecycle::install("test", Duration::from_secs(5)).unwrap();
        assert_eq!(life.budget(), Duration::from_secs(5));
        assert_eq!(life.drain_budget(), Duration::from_secs(3));
        let started = tokio::time::Instant::now();
        let e = life
            .shutdown(|| "the stuck part".into(), std::future::pending())
            .await
            .unwrap_err()
            .to_string();
        assert_eq!(started.elapsed(), Duration::from_secs(5));
        assert!(
            e.contains("within 5s") && e.contains("the stuck part"),
            "{e}"
        );

        let done = life.shutdown(|| unreachable!(), async { Ok(()) }).await;
        assert!(done.is_ok());
    }
}

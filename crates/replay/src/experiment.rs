//! An experiment: one trace, several routing policies at several arrival rates, and the
//! goodput objective (given, or derived from round robin's unloaded TTFT with one more run),
//! ending in a [`ReplayReport`]. The command line only parses flags and prints.

use crate::ideal::ideal_hit_rates;
use crate::report::{derived_slo_ttft_ms, summarize, ReplayReport, ReportSettings, SloBase};
use crate::requests::{build_requests, count_truncated, ReplayError};
use crate::runner::{run_policy, virtual_runtime, ReplayConfig, RunError};
use crate::trace::TraceRequest;
use crate::RunOutcome;
use kvrouter_scheduler::RoutingPolicy;
use std::time::{Duration, Instant};
use thiserror::Error;

/// The goodput objective: the highest rate whose p90 TTFT meets it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Slo {
    /// A p90 TTFT objective, ms.
    Fixed { ttft_ms: f64 },
    /// `factor` × round robin's p90 TTFT at `base_rate_scale` (an extra run).
    Derived { factor: f64, base_rate_scale: f64 },
}

impl Default for Slo {
    fn default() -> Self {
        Self::Derived {
            factor: 3.0,
            base_rate_scale: 0.1,
        }
    }
}

/// One line of progress: `done` of `total` requests of the run named `label`, `elapsed`
/// wall time into it.
#[derive(Clone, Copy, Debug)]
pub struct Progress<'a> {
    pub label: &'a str,
    pub done: usize,
    pub total: usize,
    pub elapsed: Duration,
}

#[derive(Debug, Error)]
pub enum ExperimentError {
    #[error("give at least one policy and one rate scale")]
    NothingToRun,
    #[error("{0}")]
    Settings(String),
    #[error(transparent)]
    Requests(#[from] ReplayError),
    #[error("cannot start the tokio runtime: {0}")]
    Runtime(std::io::Error),
    #[error("replay with policy {policy} at rate x{rate} failed: {source}")]
    Run {
        policy: RoutingPolicy,
        rate: f64,
        #[source]
        source: RunError,
    },
    #[error("the SLO base run ({policy} at x{rate}) failed: {source}")]
    SloBaseRun {
        policy: RoutingPolicy,
        rate: f64,
        #[source]
        source: RunError,
    },
    #[error(
        "over 10% of the SLO base run's requests ({policy} at x{rate}) failed: give a fixed \
         SLO (--slo-ttft-ms)"
    )]
    SloBaseFailed { policy: RoutingPolicy, rate: f64 },
}

/// A trace, the runs to make of it, and the fleet to make them on.
#[derive(Clone, Debug)]
pub struct Experiment {
    /// How the report names the trace (its path).
    pub trace_name: String,
    pub trace: Vec<TraceRequest>,
    pub policies: Vec<RoutingPolicy>,
    pub rates: Vec<f64>,
    pub config: ReplayConfig,
    pub slo: Slo,
}

impl Experiment {
    /// Checks the settings without running anything.
    pub fn validate(&self) -> Result<(), ExperimentError> {
        if self.policies.is_empty() || self.rates.is_empty() {
            return Err(ExperimentError::NothingToRun);
        }
        if let Some(&r) = self.rates.iter().find(|r| !(r.is_finite() && **r > 0.0)) {
            return Err(ReplayError::InvalidRateScale(r).into());
        }
        self.config
            .validate()
            .map_err(|e| ExperimentError::Settings(e.to_string()))?;
        let positive = |name: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(ExperimentError::Settings(format!(
                    "{name} must be a number above 0, got {v}"
                )))
            }
        };
        match self.slo {
            Slo::Fixed { ttft_ms } => positive("the SLO (--slo-ttft-ms)", ttft_ms),
            Slo::Derived {
                factor,
                base_rate_scale,
            } => {
                positive("the SLO factor (--slo-factor)", factor)?;
                positive(
                    "the SLO base rate scale (--slo-base-rate-scale)",
                    base_rate_scale,
                )
            }
        }
    }

    /// Every (rate, policy) run in order, then the SLO base run if the SLO is derived;
    /// `progress` hears of each finished request.
    pub fn run(
        &self,
        progress: &(dyn Fn(Progress) + Sync),
    ) -> Result<(ReplayReport, Vec<RunOutcome>), ExperimentError> {
        self.validate()?;
        let mut outcomes = Vec::new();
        let mut ideals = None;
        for &rate in &self.rates {
            let requests = build_requests(&self.trace, rate)?;
            if ideals.is_none() {
                ideals = Some(ideal_hit_rates(
                    &requests,
                    self.config.block_size,
                    self.config.fleet_capacity_blocks(),
                ));
            }
            for &policy in &self.policies {
                let outcome = self
                    .run_one(
                        policy,
                        rate,
                        &requests,
                        &format!("{policy} x{rate}"),
                        progress,
                    )?
                    .map_err(|source| ExperimentError::Run {
                        policy,
                        rate,
                        source,
                    })?;
                outcomes.push(outcome);
            }
        }
        let (slo_ttft_ms, slo_base) = match self.slo {
            Slo::Fixed { ttft_ms } => (ttft_ms, None),
            Slo::Derived {
                factor,
                base_rate_scale,
            } => {
                let base = self.slo_base(factor, base_rate_scale, progress)?;
                (base.slo_ttft_ms(), Some(base))
            }
        };
        let report = ReplayReport::from_outcomes(
            self.trace_name.clone(),
            self.settings(slo_ttft_ms, slo_base),
            ideals.unwrap_or_default(),
            &outcomes,
        );
        Ok((report, outcomes))
    }

    /// Round robin's p90 TTFT unloaded, on this trace, times `factor`.
    fn slo_base(
        &self,
        factor: f64,
        rate: f64,
        progress: &(dyn Fn(Progress) + Sync),
    ) -> Result<SloBase, ExperimentError> {
        let policy = RoutingPolicy::RoundRobin;
        let requests = build_requests(&self.trace, rate)?;
        let label = format!("slo base: {policy} x{rate}");
        let outcome = self
            .run_one(policy, rate, &requests, &label, progress)?
            .map_err(|source| ExperimentError::SloBaseRun {
                policy,
                rate,
                source,
            })?;
        let summary = summarize(&outcome, self.config.block_size);
        derived_slo_ttft_ms(&summary, factor).ok_or(ExperimentError::SloBaseFailed { policy, rate })
    }

    /// One run on its own runtime: a paused clock in-process, the real one over NATS.
    fn run_one(
        &self,
        policy: RoutingPolicy,
        rate: f64,
        requests: &[crate::requests::ReplayRequest],
        label: &str,
        progress: &(dyn Fn(Progress) + Sync),
    ) -> Result<Result<RunOutcome, RunError>, ExperimentError> {
        let runtime = match self.config.nats {
            None => virtual_runtime(),
            Some(_) => tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build(),
        }
        .map_err(ExperimentError::Runtime)?;
        let started = Instant::now();
        let total = requests.len();
        let on_done = |done: usize| {
            progress(Progress {
                label,
                done,
                total,
                elapsed: started.elapsed(),
            })
        };
        Ok(runtime.block_on(run_policy(&self.config, policy, rate, requests, &on_done)))
    }

    fn settings(&self, slo_ttft_ms: f64, slo_base: Option<SloBase>) -> ReportSettings {
        let c = &self.config;
        let over_nats = c.nats.is_some();
        ReportSettings {
            workers: c.workers as usize,
            dp_size: c.dp_size,
            block_size: c.block_size,
            capacity_blocks: c.capacity_blocks as u64,
            host_capacity_blocks: c.host_capacity_blocks as u64,
            disk_capacity_blocks: c.disk_capacity_blocks as u64,
            replicas: c.replicas,
            speedup: if over_nats { c.speedup } else { 0.0 },
            slo_ttft_ms,
            slo_base,
            expected_output: c.expected_output,
            bus: if over_nats { "nats" } else { "in-process" }.to_string(),
            requests: self.trace.len(),
            seed: c.seed,
            truncated_requests: count_truncated(&self.trace),
            serving_indexers: c.serving_indexers(),
            replica_sync: c.replica_sync,
            no_kv_events: c.approximate(),
        }
    }
}

//! What a chaos run found: faults by kind, routes, convergence times and divergence, as JSON
//! and as a table for an operator.

use super::config::ChaosConfig;
use super::traffic::RouteFigures;
use crate::stats::Spread;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::time::Duration;

/// One checkpoint: after a fault, at startup or at the end.
#[derive(Clone, Debug, Serialize)]
pub struct FaultResult {
    /// The fault's number in the schedule (none for startup and end).
    pub index: Option<usize>,
    pub kind: Option<String>,
    pub target: String,
    pub converged: bool,
    /// From the fault's end (a restart, a resume, the drop's follow-up traffic) to every
    /// replica equal to the truth.
    pub convergence_ms: Option<f64>,
    /// Differences found by the comparison a moment after convergence (must be 0).
    pub divergence_after_convergence: usize,
    /// Differences left when the checkpoint gave up waiting (0 when it converged).
    pub unconverged_divergence: usize,
    /// What differed (at the second comparison, or when giving up).
    pub detail: String,
    pub notes: Vec<String>,
    /// The workers' prefixes compared with the indexes at convergence (or when giving up),
    /// summed over the indexing replicas.
    pub prefixes_checked: usize,
    /// Of them, the bridged engines' (compared with the engines' own caches).
    pub engine_prefixes_checked: usize,
    /// What differed at the checkpoint's first comparison ("none" when nothing did).
    pub initial_detail: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct ChaosReport {
    pub seed: u64,
    pub duration_s: f64,
    pub elapsed_s: f64,
    pub fleet: serde_json::Value,
    /// Faults injected, by kind.
    pub faults_injected: BTreeMap<String, usize>,
    pub routes: RouteFigures,
    /// Convergence time of every converged fault, and by kind.
    pub convergence_ms: Option<Spread>,
    pub convergence_ms_by_kind: BTreeMap<String, Spread>,
    pub faults_converged: usize,
    pub faults_unconverged: usize,
    /// Summed over every checkpoint (faults and the end): must be 0.
    pub divergence_after_convergence: usize,
    pub startup: FaultResult,
    pub faults: Vec<FaultResult>,
    #[serde(rename = "final")]
    pub end: FaultResult,
}

impl ChaosReport {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cfg: &ChaosConfig,
        elapsed: Duration,
        routes: RouteFigures,
        startup: FaultResult,
        faults: Vec<FaultResult>,
        end: FaultResult,
        replicas: Vec<String>,
        ranks: u32,
    ) -> Self {
        let mut faults_injected = BTreeMap::new();
        let mut by_kind: BTreeMap<String, Vec<f64>> = BTreeMap::new();
        let mut all = Vec::new();
        for f in &faults {
            let kind = f.kind.clone().unwrap_or_default();
            *faults_injected.entry(kind.clone()).or_insert(0) += 1;
            if let Some(ms) = f.convergence_ms {
                by_kind.entry(kind).or_default().push(ms);
                all.push(ms);
            }
        }
        let converged = faults.iter().filter(|f| f.converged).count();
        let divergence = faults
            .iter()
            .chain([&end])
            .map(|f| f.divergence_after_convergence)
            .sum();
        Self {
            seed: cfg.seed,
            duration_s: cfg.duration.as_secs_f64(),
            elapsed_s: elapsed.as_secs_f64(),
            fleet: serde_json::json!({
                "replicas": replicas,
                "indexing_replicas": cfg.replicas - 1,
                "mockers": cfg.mockers,
                "workers_per_mocker": cfg.workers_per_mocker,
                "dp_size": cfg.dp_size,
                "engines": cfg.engines.iter().map(|e| serde_json::json!({
                    "kind": e.kind,
                    "zmq_wire": e.wire,
                    "dp_size": e.dp_size,
                    "bridge": true,
                })).collect::<Vec<_>>(),
                "engine_share": cfg.engine_share,
                "worker_ranks": ranks,
                "capacity_blocks": cfg.capacity_blocks,
                "block_size": cfg.block_size,
                "speedup": cfg.speedup,
                "concurrency": cfg.concurrency,
                "max_retries": cfg.max_retries,
                "request_timeout_secs": cfg.request_timeout_secs,
            }),
            faults_injected,
            routes,
            convergence_ms: Spread::of(all.iter().copied()),
            convergence_ms_by_kind: by_kind
                .into_iter()
                .filter_map(|(k, v)| Some((k, Spread::of(v)?)))
                .collect(),
            faults_converged: converged,
            faults_unconverged: faults.len() - converged,
            divergence_after_convergence: divergence,
            startup,
            faults,
            end,
        }
    }

    /// Whether the fleet held: every fault converged, the end converged, nothing diverged
    /// after convergence.
    pub fn passed(&self) -> bool {
        self.faults_unconverged == 0 && self.end.converged && self.divergence_after_convergence == 0
    }

    /// The table for an operator.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let ms = |v: Option<f64>| v.map_or("-".to_string(), |x| format!("{x:.0}"));
        let _ = writeln!(
            s,
            "kvrouter bench chaos: seed {}, {:.0} s of faults ({:.0} s wall), {} replicas, {} worker ranks",
            self.seed, self.duration_s, self.elapsed_s, self.fleet["replicas"].as_array().map_or(0, |a| a.len()), self.fleet["worker_ranks"]
        );
        let r = &self.routes;
        let _ = writeln!(
            s,
            "  routes    {} requests ({} to the bridged engines, {} of them succeeded): {} attempted, {} retried, {} failed after retries{}",
            r.requests,
            r.engine_requests,
            r.engine_succeeded,
            r.attempted,
            r.retried,
            r.failed,
            if r.errors.is_empty() {
                String::new()
            } else {
                format!(
                    " (errors: {})",
                    r.errors
                        .iter()
                        .map(|(k, v)| format!("{k} {v}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            }
        );
        let _ = writeln!(
            s,
            "  {:<14} {:>6} {:>10} {:>10} {:>10}",
            "fault", "count", "min ms", "median ms", "max ms"
        );
        for (k, n) in &self.faults_injected {
            let sp = self.convergence_ms_by_kind.get(k);
            let _ = writeln!(
                s,
                "  {:<14} {:>6} {:>10} {:>10} {:>10}",
                k,
                n,
                ms(sp.map(|x| x.min)),
                ms(sp.map(|x| x.median)),
                ms(sp.map(|x| x.max))
            );
        }
        let sp = self.convergence_ms;
        let _ = writeln!(
            s,
            "  {:<14} {:>6} {:>10} {:>10} {:>10}",
            "all",
            self.faults.len(),
            ms(sp.map(|x| x.min)),
            ms(sp.map(|x| x.median)),
            ms(sp.map(|x| x.max))
        );
        let _ = writeln!(
            s,
            "  converged {} of {} faults; end: {} ({} ms after traffic stopped, {} prefixes compared, {} of them the engines')",
            self.faults_converged,
            self.faults.len(),
            if self.end.converged { "converged" } else { "NOT converged" },
            ms(self.end.convergence_ms),
            self.end.prefixes_checked,
            self.end.engine_prefixes_checked
        );
        let _ = writeln!(
            s,
            "  divergence after convergence: {}",
            self.divergence_after_convergence
        );
        for f in self.faults.iter().chain([&self.end]) {
            if !f.converged || f.divergence_after_convergence > 0 || !f.notes.is_empty() {
                let _ = writeln!(
                    s,
                    "  ! fault {} {} {}: converged {}, {}{}",
                    f.index.map_or("end".to_string(), |i| i.to_string()),
                    f.kind.as_deref().unwrap_or(""),
                    f.target,
                    f.converged,
                    f.detail,
                    if f.notes.is_empty() {
                        String::new()
                    } else {
                        format!(" [{}]", f.notes.join("; "))
                    }
                );
            }
        }
        s
    }
}

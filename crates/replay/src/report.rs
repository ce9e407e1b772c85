//! Per-run summaries, goodput across rates, kv against round robin, and the text table.
//!
//! [`ReplayReport`] is exactly what `--json` prints. Times in the report are milliseconds of
//! simulated time; rates are fractions (0.37, not 37%).

use crate::ideal::Ideals;
use crate::stats::percentile;
use crate::{RequestResult, RunOutcome};
use serde::Serialize;
use std::fmt::Write as _;

/// The policy names the comparison looks for (as `kvrouter_scheduler` spells them).
pub const KV_POLICY: &str = "kv";
pub const ROUND_ROBIN_POLICY: &str = "round-robin";

fn is_round_robin(policy: &str) -> bool {
    policy == ROUND_ROBIN_POLICY || policy == "rr"
}

/// Time to first token over the successful requests, ms (nearest-rank percentiles).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TtftMs {
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
}

/// End-to-end latency over the successful requests, ms.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct E2eMs {
    pub mean: f64,
    pub p50: f64,
    pub p99: f64,
}

/// Over the run's simulated duration (first arrival to last completion).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Throughput {
    pub output_tokens_per_s: f64,
    pub requests_per_s: f64,
}

/// Max / mean active blocks across ranks, over the load samples whose mean is above 0
/// (both 0 without such samples).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct LoadSpread {
    pub mean: f64,
    pub max: f64,
}

/// One policy at one rate.
/// Route call wall times, client side, in µs.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RouteUs {
    pub mean: f64,
    pub p50: f64,
    pub p99: f64,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PolicySummary {
    pub policy: String,
    pub rate_scale: f64,
    /// Requests replayed, failed ones included.
    pub requests: usize,
    pub errors: usize,
    /// Σ cached blocks / Σ full prompt blocks over the successful requests (every tier).
    pub hit_rate: f64,
    /// Of `hit_rate`, the blocks loaded from host memory and from disk (0 without tiers).
    pub host_hit_rate: f64,
    pub disk_hit_rate: f64,
    pub cached_blocks: u64,
    pub prompt_blocks: u64,
    pub ttft_ms: TtftMs,
    /// p90 TTFT with failed requests counted as never answered (`None`: over 10% failed);
    /// equals `ttft_ms.p90` without errors. Goodput is judged on this.
    pub ttft_p90_incl_errors_ms: Option<f64>,
    /// Mean gap between output tokens, over every gap of every successful request.
    pub itl_mean_ms: f64,
    pub e2e_ms: E2eMs,
    pub throughput: Throughput,
    pub load_spread: LoadSpread,
    /// Σ (prompt blocks − cached blocks) × block size over the successful requests: the
    /// prefill work the run could not skip.
    pub uncached_prompt_tokens: u64,
    pub output_tokens: u64,
    pub duration_s: f64,
    pub cluster: crate::ClusterCounters,
    /// Over NATS: what the route calls cost (the decision, plus remote lookups if any);
    /// `None` on the virtual clock.
    pub route_wall_us: Option<RouteUs>,
}

fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

fn mean(values: &[u64]) -> f64 {
    if values.is_empty() {
        0.0
    } else {
        values.iter().map(|&v| v as f64).sum::<f64>() / values.len() as f64
    }
}

fn pct_ms(sorted: &[u64], q: f64) -> f64 {
    percentile(sorted, q).map(ms).unwrap_or(0.0)
}

fn ratio(num: f64, den: f64) -> Option<f64> {
    (den > 0.0 && num.is_finite()).then(|| num / den)
}

/// Summarizes one run.
pub fn summarize(outcome: &RunOutcome, block_size: usize) -> PolicySummary {
    let ok: Vec<&RequestResult> = outcome
        .results
        .iter()
        .filter(|r| r.error.is_none())
        .collect();
    let requests = outcome.results.len();
    let errors = requests - ok.len();

    let cached_blocks: u64 = ok.iter().map(|r| r.cached_blocks as u64).sum();
    let host_blocks: u64 = ok.iter().map(|r| r.host_blocks as u64).sum();
    let disk_blocks: u64 = ok.iter().map(|r| r.disk_blocks as u64).sum();
    let prompt_blocks: u64 = ok.iter().map(|r| r.prompt_blocks as u64).sum();
    let uncached_blocks: u64 = ok
        .iter()
        .map(|r| r.prompt_blocks.saturating_sub(r.cached_blocks) as u64)
        .sum();

    let mut ttft: Vec<u64> = ok.iter().map(|r| r.ttft_us).collect();
    ttft.sort_unstable();
    let mut e2e: Vec<u64> = ok.iter().map(|r| r.e2e_us).collect();
    e2e.sort_unstable();

    // Failed requests as infinitely late: the p90 over all requests is the nearest-rank
    // sample among the successes, if it falls there.
    let ttft_p90_incl_errors_ms = if requests == 0 {
        None
    } else {
        let rank = ((0.9 * requests as f64).ceil() as usize).clamp(1, requests);
        ttft.get(rank - 1).map(|&us| ms(us))
    };

    let (gaps, gap_us) =
        ok.iter()
            .filter(|r| r.output_tokens >= 2)
            .fold((0u64, 0f64), |(n, sum), r| {
                let g = r.output_tokens as u64 - 1;
                (n + g, sum + r.itl_mean_us * g as f64)
            });
    let itl_mean_ms = if gaps == 0 {
        0.0
    } else {
        gap_us / gaps as f64 / 1000.0
    };

    let output_tokens: u64 = ok.iter().map(|r| r.output_tokens as u64).sum();
    let duration_s = outcome.duration_us as f64 / 1e6;
    let per_s = |n: f64| {
        if duration_s > 0.0 {
            n / duration_s
        } else {
            0.0
        }
    };

    let spreads: Vec<f64> = outcome
        .samples
        .iter()
        .filter(|s| !s.active_blocks.is_empty())
        .filter_map(|s| {
            let m = s.active_blocks.iter().sum::<u64>() as f64 / s.active_blocks.len() as f64;
            let max = s.active_blocks.iter().copied().max().unwrap_or(0) as f64;
            (m > 0.0).then(|| max / m)
        })
        .collect();
    let load_spread = if spreads.is_empty() {
        LoadSpread::default()
    } else {
        LoadSpread {
            mean: spreads.iter().sum::<f64>() / spreads.len() as f64,
            max: spreads.iter().copied().fold(0.0, f64::max),
        }
    };

    PolicySummary {
        policy: outcome.policy.clone(),
        rate_scale: outcome.rate_scale,
        requests,
        errors,
        hit_rate: ratio(cached_blocks as f64, prompt_blocks as f64).unwrap_or(0.0),
        host_hit_rate: ratio(host_blocks as f64, prompt_blocks as f64).unwrap_or(0.0),
        disk_hit_rate: ratio(disk_blocks as f64, prompt_blocks as f64).unwrap_or(0.0),
        cached_blocks,
        prompt_blocks,
        ttft_ms: TtftMs {
            mean: mean(&ttft) / 1000.0,
            p50: pct_ms(&ttft, 0.50),
            p90: pct_ms(&ttft, 0.90),
            p99: pct_ms(&ttft, 0.99),
        },
        ttft_p90_incl_errors_ms,
        itl_mean_ms,
        e2e_ms: E2eMs {
            mean: mean(&e2e) / 1000.0,
            p50: pct_ms(&e2e, 0.50),
            p99: pct_ms(&e2e, 0.99),
        },
        throughput: Throughput {
            output_tokens_per_s: per_s(output_tokens as f64),
            requests_per_s: per_s(ok.len() as f64),
        },
        load_spread,
        uncached_prompt_tokens: uncached_blocks * block_size as u64,
        output_tokens,
        duration_s,
        cluster: outcome.cluster.clone(),
        // Only on the wall clock: on the virtual one these are not route costs.
        route_wall_us: outcome.real_clock.then(|| {
            let mut route: Vec<u64> = ok.iter().map(|r| r.route_wall_us).collect();
            route.sort_unstable();
            let at = |q| percentile(&route, q).unwrap_or(0) as f64;
            RouteUs {
                mean: mean(&route),
                p50: at(0.50),
                p99: at(0.99),
            }
        }),
    }
}

/// A policy's goodput: the highest rate scale whose p90 TTFT (failed requests counting as
/// never answered) is at most the SLO; `None` when no rate meets it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Goodput {
    pub policy: String,
    pub rate_scale: Option<f64>,
}

/// Goodput of every policy in `runs`, in order of first appearance.
pub fn goodput(runs: &[PolicySummary], slo_ttft_ms: f64) -> Vec<Goodput> {
    let mut out: Vec<Goodput> = Vec::new();
    for run in runs {
        let meets = run
            .ttft_p90_incl_errors_ms
            .is_some_and(|p90| p90 <= slo_ttft_ms);
        let entry = match out.iter_mut().find(|g| g.policy == run.policy) {
            Some(g) => g,
            None => {
                out.push(Goodput {
                    policy: run.policy.clone(),
                    rate_scale: None,
                });
                out.last_mut().expect("just pushed")
            }
        };
        if meets && !entry.rate_scale.is_some_and(|r| r >= run.rate_scale) {
            entry.rate_scale = Some(run.rate_scale);
        }
    }
    out
}

/// Where the default TTFT objective comes from: round robin's p90 TTFT on the same trace at
/// a rate low enough for it to be unloaded, times a factor.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SloBase {
    pub policy: String,
    pub rate_scale: f64,
    /// p90 TTFT at that rate (failed requests counting as never answered).
    pub p90_ttft_ms: f64,
    pub factor: f64,
}

/// The SLO a trace can meet: `factor` × round robin's unloaded p90 TTFT (`None` when that
/// run has no p90: over 10% of its requests failed).
pub fn derived_slo_ttft_ms(unloaded: &PolicySummary, factor: f64) -> Option<SloBase> {
    unloaded.ttft_p90_incl_errors_ms.map(|p90| SloBase {
        policy: unloaded.policy.clone(),
        rate_scale: unloaded.rate_scale,
        p90_ttft_ms: p90,
        factor,
    })
}

impl SloBase {
    pub fn slo_ttft_ms(&self) -> f64 {
        self.factor * self.p90_ttft_ms
    }
}

/// A policy's saturation throughput: the most requests per second it completed at any rate
/// tried (runs whose offered load exceeds what the fleet serves all complete at about that
/// rate), and the lowest rate at which it reached 95% of it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Saturation {
    pub policy: String,
    pub requests_per_s: f64,
    pub rate_scale: f64,
    /// The lowest rate scale whose throughput is at least 95% of the maximum.
    pub saturates_at_rate_scale: f64,
}

/// Saturation throughput of every policy in `runs`, in order of first appearance.
pub fn saturation(runs: &[PolicySummary]) -> Vec<Saturation> {
    let mut out: Vec<Saturation> = Vec::new();
    for run in runs {
        let rps = run.throughput.requests_per_s;
        match out.iter_mut().find(|s| s.policy == run.policy) {
            Some(s) if rps > s.requests_per_s => {
                s.requests_per_s = rps;
                s.rate_scale = run.rate_scale;
            }
            Some(_) => {}
            None => out.push(Saturation {
                policy: run.policy.clone(),
                requests_per_s: rps,
                rate_scale: run.rate_scale,
                saturates_at_rate_scale: run.rate_scale,
            }),
        }
    }
    for s in &mut out {
        s.saturates_at_rate_scale = runs
            .iter()
            .filter(|r| r.policy == s.policy)
            .filter(|r| r.throughput.requests_per_s >= 0.95 * s.requests_per_s)
            .map(|r| r.rate_scale)
            .fold(f64::INFINITY, f64::min);
    }
    out
}

/// How the replay was run.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ReportSettings {
    pub workers: usize,
    pub dp_size: u32,
    pub block_size: usize,
    /// Blocks per worker rank.
    pub capacity_blocks: u64,
    /// Host-memory and disk blocks per worker rank (0: no such tier).
    pub host_capacity_blocks: u64,
    pub disk_capacity_blocks: u64,
    pub replicas: usize,
    /// Simulated seconds per wall second; 0 for the in-process replay's virtual clock.
    pub speedup: f64,
    /// The goodput objective (p90 TTFT), ms: `--slo-ttft-ms`, or derived (`slo_base`).
    pub slo_ttft_ms: f64,
    /// How `slo_ttft_ms` was derived; `None` when given explicitly.
    pub slo_base: Option<SloBase>,
    /// Routes carried the trace's output length as their expected output.
    pub expected_output: bool,
    /// `"in-process"` or `"nats"`.
    pub bus: String,
    /// Requests replayed from the trace.
    pub requests: usize,
    /// Seed of the routers' tie-breaks (in-process replays are deterministic for a seed).
    pub seed: u64,
    /// Requests whose input_length exceeded their hash ids' 512 tokens each and were cut.
    pub truncated_requests: usize,
    /// How the replicas share state: serving indexers among them (the rest ask them),
    /// replica sync, approximate mode.
    pub serving_indexers: usize,
    pub replica_sync: bool,
    pub no_kv_events: bool,
}

/// kv against round robin at one rate both ran at.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RateComparison {
    pub rate_scale: f64,
    pub kv_hit_rate: f64,
    /// kv's observed hit rate / the pooled LRU ideal's (target ≥ 0.9).
    pub kv_hit_rate_vs_pooled: Option<f64>,
    /// kv / round robin (targets at round robin's goodput rate: mean ≤ 0.5, p99 ≤ 1/3).
    pub ttft_mean_ratio: Option<f64>,
    pub ttft_p99_ratio: Option<f64>,
    pub rr_uncached_prompt_tokens: u64,
    pub pooled_uncached_prompt_tokens: u64,
    /// Round robin's uncached prompt tokens / the pooled ideal's: the most prefill work a
    /// router can save, as a factor (`None` when the ideal misses nothing).
    pub bound: Option<f64>,
}

/// The derived comparison, when both kv and round robin ran.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct KvVsRoundRobin {
    /// Every rate both ran at, ascending.
    pub per_rate: Vec<RateComparison>,
    pub kv_goodput: Option<f64>,
    pub rr_goodput: Option<f64>,
    /// The comparison at round robin's goodput rate, if kv ran there too.
    pub at_rr_goodput: Option<RateComparison>,
    /// kv goodput / rr goodput − 1.
    pub goodput_gain: Option<f64>,
    /// The bound used for the goodput target: at round robin's goodput rate, else at the
    /// lowest rate both ran at.
    pub bound: Option<f64>,
    pub bound_rate_scale: Option<f64>,
    /// 0.8 × (bound − 1): the goodput gain the target asks for.
    pub target_goodput_gain: Option<f64>,
    pub meets_goodput_target: Option<bool>,
    /// Saturation throughput (requests/s), kv / round robin.
    pub saturation_ratio: Option<f64>,
    /// The rate at which round robin saturates, and kv there (if kv ran at it).
    pub at_rr_saturation: Option<RateComparison>,
}

/// Everything `bench replay --json` prints.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ReplayReport {
    pub trace: String,
    pub config: ReportSettings,
    pub ideals: Ideals,
    pub runs: Vec<PolicySummary>,
    pub goodput: Vec<Goodput>,
    pub saturation: Vec<Saturation>,
    pub kv_vs_round_robin: Option<KvVsRoundRobin>,
}

fn same_rate(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
}

impl ReplayReport {
    /// A report from the runs' summaries: computes goodput and the kv-vs-rr comparison.
    pub fn new(
        trace: String,
        config: ReportSettings,
        ideals: Ideals,
        runs: Vec<PolicySummary>,
    ) -> Self {
        let goodput = goodput(&runs, config.slo_ttft_ms);
        let saturation = saturation(&runs);
        let kv_vs_round_robin = compare(&runs, &goodput, &saturation, &ideals, config.block_size);
        Self {
            trace,
            config,
            ideals,
            runs,
            goodput,
            saturation,
            kv_vs_round_robin,
        }
    }

    /// A report straight from the runs' outcomes.
    pub fn from_outcomes(
        trace: String,
        config: ReportSettings,
        ideals: Ideals,
        outcomes: &[RunOutcome],
    ) -> Self {
        let runs = outcomes
            .iter()
            .map(|o| summarize(o, config.block_size))
            .collect();
        Self::new(trace, config, ideals, runs)
    }
}

fn compare(
    runs: &[PolicySummary],
    goodput: &[Goodput],
    saturation: &[Saturation],
    ideals: &Ideals,
    block_size: usize,
) -> Option<KvVsRoundRobin> {
    let kv: Vec<&PolicySummary> = runs.iter().filter(|r| r.policy == KV_POLICY).collect();
    let rr: Vec<&PolicySummary> = runs.iter().filter(|r| is_round_robin(&r.policy)).collect();
    if kv.is_empty() || rr.is_empty() {
        return None;
    }
    let pooled_uncached = ideals.pooled_uncached_prompt_tokens(block_size);
    let mut per_rate: Vec<RateComparison> = kv
        .iter()
        .filter_map(|k| {
            let r = rr.iter().find(|r| same_rate(r.rate_scale, k.rate_scale))?;
            Some(RateComparison {
                rate_scale: k.rate_scale,
                kv_hit_rate: k.hit_rate,
                kv_hit_rate_vs_pooled: ratio(k.hit_rate, ideals.pooled_hit_rate),
                ttft_mean_ratio: ratio(k.ttft_ms.mean, r.ttft_ms.mean),
                ttft_p99_ratio: ratio(k.ttft_ms.p99, r.ttft_ms.p99),
                rr_uncached_prompt_tokens: r.uncached_prompt_tokens,
                pooled_uncached_prompt_tokens: pooled_uncached,
                bound: ratio(r.uncached_prompt_tokens as f64, pooled_uncached as f64),
            })
        })
        .collect();
    per_rate.sort_by(|a, b| a.rate_scale.total_cmp(&b.rate_scale));

    let of = |is: &dyn Fn(&str) -> bool| {
        goodput
            .iter()
            .find(|g| is(&g.policy))
            .and_then(|g| g.rate_scale)
    };
    let kv_goodput = of(&|p| p == KV_POLICY);
    let rr_goodput = of(&is_round_robin);
    let at_rr_goodput = rr_goodput.and_then(|g| {
        per_rate
            .iter()
            .find(|c| same_rate(c.rate_scale, g))
            .cloned()
    });
    let goodput_gain = match (kv_goodput, rr_goodput) {
        (Some(k), Some(r)) if r > 0.0 => Some(k / r - 1.0),
        _ => None,
    };
    let bound_at = at_rr_goodput.as_ref().or(per_rate.first());
    let bound = bound_at.and_then(|c| c.bound);
    let bound_rate_scale = bound_at.map(|c| c.rate_scale);
    let target_goodput_gain = bound.map(|b| 0.8 * (b - 1.0));
    let meets_goodput_target = match (goodput_gain, target_goodput_gain) {
        (Some(g), Some(t)) => Some(g >= t),
        _ => None,
    };
    let sat = |is: &dyn Fn(&str) -> bool| saturation.iter().find(|s| is(&s.policy));
    let (kv_sat, rr_sat) = (sat(&|p| p == KV_POLICY), sat(&is_round_robin));
    let saturation_ratio = match (kv_sat, rr_sat) {
        (Some(k), Some(r)) => ratio(k.requests_per_s, r.requests_per_s),
        _ => None,
    };
    let at_rr_saturation = rr_sat.and_then(|r| {
        per_rate
            .iter()
            .find(|c| same_rate(c.rate_scale, r.saturates_at_rate_scale))
            .cloned()
    });
    Some(KvVsRoundRobin {
        saturation_ratio,
        at_rr_saturation,
        at_rr_goodput,
        kv_goodput,
        rr_goodput,
        goodput_gain,
        bound,
        bound_rate_scale,
        target_goodput_gain,
        meets_goodput_target,
        per_rate,
    })
}

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

fn opt(x: Option<f64>, f: impl Fn(f64) -> String) -> String {
    x.map(f).unwrap_or_else(|| "n/a".to_string())
}

fn times(x: f64) -> String {
    format!("{x:.2}x")
}

/// The report as a fixed-width table for a terminal.
pub fn render_table(report: &ReplayReport) -> String {
    let c = &report.config;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "trace {} ({} requests{}), {} workers x {} ranks, block {} tokens, {} blocks/rank, {} replicas, {} bus, {}",
        report.trace,
        c.requests,
        if c.truncated_requests > 0 {
            format!(", {} cut to their hash ids", c.truncated_requests)
        } else {
            String::new()
        },
        c.workers,
        c.dp_size,
        c.block_size,
        c.capacity_blocks,
        c.replicas,
        c.bus,
        if c.speedup > 0.0 {
            format!("speedup {}", c.speedup)
        } else {
            "virtual clock".to_string()
        }
    );
    let mut shared = Vec::new();
    if c.serving_indexers > 0 {
        shared.push(format!(
            "{} serving indexer(s), {} remote",
            c.serving_indexers,
            c.replicas.saturating_sub(c.serving_indexers)
        ));
    }
    if c.replica_sync {
        shared.push("replica sync".to_string());
    }
    if c.no_kv_events {
        shared.push("approximate mode (no KV events)".to_string());
    }
    if !shared.is_empty() {
        let _ = writeln!(out, "replicas: {}", shared.join(", "));
    }
    if c.host_capacity_blocks > 0 || c.disk_capacity_blocks > 0 {
        let _ = writeln!(
            out,
            "lower tiers per rank: host {} blocks, disk {} blocks",
            c.host_capacity_blocks, c.disk_capacity_blocks
        );
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "{:<14} {:>6} {:>6} {:>4} {:>6} | {:>9} {:>9} {:>9} {:>9} | {:>7} | {:>9} {:>9} | {:>9} {:>7} | {:>6} {:>6}",
        "policy", "rate", "reqs", "err", "hit", "ttft mean", "p50", "p90", "p99", "itl", "e2e mean", "e2e p99",
        "out tok/s", "req/s", "spread", "max"
    );
    let _ = writeln!(
        out,
        "{:<14} {:>6} {:>6} {:>4} {:>6} | {:>9} {:>9} {:>9} {:>9} | {:>7} | {:>9} {:>9} | {:>9} {:>7} | {:>6} {:>6}",
        "", "x", "", "", "", "ms", "ms", "ms", "ms", "ms", "ms", "ms", "", "", "", ""
    );
    let _ = writeln!(out, "{}", "-".repeat(150));
    for r in &report.runs {
        let _ = writeln!(
            out,
            "{:<14} {:>6} {:>6} {:>4} {:>6} | {:>9.1} {:>9.1} {:>9.1} {:>9.1} | {:>7.2} | {:>9.1} {:>9.1} | {:>9.1} {:>7.2} | {:>6.2} {:>6.2}",
            r.policy,
            r.rate_scale,
            r.requests,
            r.errors,
            pct(r.hit_rate),
            r.ttft_ms.mean,
            r.ttft_ms.p50,
            r.ttft_ms.p90,
            r.ttft_ms.p99,
            r.itl_mean_ms,
            r.e2e_ms.mean,
            r.e2e_ms.p99,
            r.throughput.output_tokens_per_s,
            r.throughput.requests_per_s,
            r.load_spread.mean,
            r.load_spread.max,
        );
    }
    for r in &report.runs {
        if r.host_hit_rate > 0.0 || r.disk_hit_rate > 0.0 {
            let _ = writeln!(
                out,
                "hit by tier ({} x{}): device {}, host {}, disk {}",
                r.policy,
                r.rate_scale,
                pct(r.hit_rate - r.host_hit_rate - r.disk_hit_rate),
                pct(r.host_hit_rate),
                pct(r.disk_hit_rate)
            );
        }
    }
    for r in &report.runs {
        if let Some(route) = &r.route_wall_us {
            let _ = writeln!(
                out,
                "route call ({} x{}, client wall time): mean {:.0} µs, p50 {:.0} µs, p99 {:.0} µs",
                r.policy, r.rate_scale, route.mean, route.p50, route.p99
            );
        }
    }
    let _ = writeln!(out);
    let i = &report.ideals;
    let _ = writeln!(
        out,
        "ideal hit rates over {} prompt blocks: unlimited cache {}, pooled LRU of {} blocks {}",
        i.prompt_blocks,
        pct(i.unlimited_hit_rate),
        i.pooled_capacity_blocks,
        pct(i.pooled_hit_rate)
    );
    if !report.goodput.is_empty() {
        let list: Vec<String> = report
            .goodput
            .iter()
            .map(|g| format!("{} {}", g.policy, opt(g.rate_scale, |r| format!("x{r}"))))
            .collect();
        let slo = match &c.slo_base {
            Some(b) => format!(
                "{:.0} ms = {} x {}'s unloaded p90 at x{}, {:.0} ms",
                c.slo_ttft_ms, b.factor, b.policy, b.rate_scale, b.p90_ttft_ms
            ),
            None => format!("{} ms", c.slo_ttft_ms),
        };
        let _ = writeln!(
            out,
            "goodput (highest rate with p90 TTFT <= {slo}): {}",
            list.join(", ")
        );
    }
    if !report.saturation.is_empty() {
        let list: Vec<String> = report
            .saturation
            .iter()
            .map(|s| {
                format!(
                    "{} {:.2} req/s (x{}, 95% from x{})",
                    s.policy, s.requests_per_s, s.rate_scale, s.saturates_at_rate_scale
                )
            })
            .collect();
        let _ = writeln!(out, "saturation throughput: {}", list.join(", "));
    }
    if let Some(cmp) = &report.kv_vs_round_robin {
        let _ = writeln!(out, "kv vs round-robin:");
        for p in &cmp.per_rate {
            let _ = writeln!(
                out,
                "  x{:<6} kv hit rate {} = {} of pooled ideal; TTFT mean {}, p99 {} of round-robin's; bound {}",
                p.rate_scale,
                pct(p.kv_hit_rate),
                opt(p.kv_hit_rate_vs_pooled, pct),
                opt(p.ttft_mean_ratio, times),
                opt(p.ttft_p99_ratio, times),
                opt(p.bound, times),
            );
        }
        if let Some(at) = &cmp.at_rr_goodput {
            let _ = writeln!(
                out,
                "  at round-robin's goodput rate x{}: kv TTFT mean {} (target <= 0.50x), p99 {} (target <= 0.33x)",
                at.rate_scale,
                opt(at.ttft_mean_ratio, times),
                opt(at.ttft_p99_ratio, times),
            );
        }
        let _ = writeln!(
            out,
            "  goodput gain kv/rr - 1 = {} (kv {}, rr {}); target 0.8 x (bound - 1) = {} with bound {}{}",
            opt(cmp.goodput_gain, |g| format!("{g:.2}")),
            opt(cmp.kv_goodput, |r| format!("x{r}")),
            opt(cmp.rr_goodput, |r| format!("x{r}")),
            opt(cmp.target_goodput_gain, |g| format!("{g:.2}")),
            opt(cmp.bound, times),
            match cmp.meets_goodput_target {
                Some(true) => ": met",
                Some(false) => ": not met",
                None => "",
            }
        );
        let _ = writeln!(
            out,
            "  saturation throughput kv/rr = {}",
            opt(cmp.saturation_ratio, times)
        );
        if let Some(at) = &cmp.at_rr_saturation {
            let _ = writeln!(
                out,
                "  at round-robin's saturation rate x{}: kv hit rate {} = {} of pooled ideal",
                at.rate_scale,
                pct(at.kv_hit_rate),
                opt(at.kv_hit_rate_vs_pooled, pct),
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LoadSample;

    fn result(ttft_ms: u64, cached: u32, prompt: u32) -> RequestResult {
        RequestResult {
            ttft_us: ttft_ms * 1000,
            e2e_us: ttft_ms * 1000 + 100_000,
            cached_blocks: cached,
            prompt_blocks: prompt,
            output_tokens: 11,
            itl_mean_us: 10_000.0,
            ..Default::default()
        }
    }

    #[test]
    fn summary_math() {
        let mut results: Vec<RequestResult> = (1..=10).map(|i| result(i * 10, 1, 4)).collect();
        results.push(RequestResult {
            error: Some("boom".into()),
            prompt_blocks: 100,
            ..Default::default()
        });
        results[0].output_tokens = 1; // no gaps
        results[1].output_tokens = 3;
        results[1].itl_mean_us = 40_000.0; // 2 gaps of 40 ms
        let outcome = RunOutcome {
            policy: "kv".into(),
            rate_scale: 2.0,
            results,
            samples: vec![
                LoadSample {
                    at_us: 0,
                    active_blocks: vec![0, 0],
                },
                LoadSample {
                    at_us: 1,
                    active_blocks: vec![1, 3],
                },
                LoadSample {
                    at_us: 2,
                    active_blocks: vec![2, 2],
                },
            ],
            duration_us: 2_000_000,
            ..Default::default()
        };
        let s = summarize(&outcome, 16);
        assert_eq!((s.requests, s.errors), (11, 1));
        assert_eq!((s.cached_blocks, s.prompt_blocks), (10, 40));
        assert!((s.hit_rate - 0.25).abs() < 1e-12);
        assert_eq!(s.uncached_prompt_tokens, 30 * 16);
        assert!((s.ttft_ms.mean - 55.0).abs() < 1e-9);
        assert_eq!(s.ttft_ms.p50, 50.0);
        assert_eq!(s.ttft_ms.p90, 90.0);
        assert_eq!(s.ttft_ms.p99, 100.0);
        // 11 requests, rank ceil(9.9) = 10: the 10th success.
        assert_eq!(s.ttft_p90_incl_errors_ms, Some(100.0));
        assert_eq!(s.e2e_ms.p50, 150.0);
        // gaps: 2 × 40 ms + 8 requests × 10 gaps × 10 ms = 880 ms over 82 gaps
        assert!((s.itl_mean_ms - 880.0 / 82.0).abs() < 1e-9);
        let out_tokens = 1 + 3 + 8 * 11;
        assert_eq!(s.output_tokens, out_tokens);
        assert!((s.throughput.output_tokens_per_s - out_tokens as f64 / 2.0).abs() < 1e-9);
        assert!((s.throughput.requests_per_s - 5.0).abs() < 1e-9);
        // spreads: 3/2 and 1 (the all-idle sample is skipped)
        assert!((s.load_spread.mean - 1.25).abs() < 1e-12);
        assert!((s.load_spread.max - 1.5).abs() < 1e-12);
    }

    #[test]
    fn empty_run_is_all_zero() {
        let s = summarize(&RunOutcome::default(), 64);
        assert_eq!(s.requests, 0);
        assert_eq!(s.hit_rate, 0.0);
        assert_eq!(s.ttft_p90_incl_errors_ms, None);
        assert_eq!(s.throughput.requests_per_s, 0.0);
    }

    #[test]
    fn too_many_errors_fail_the_slo() {
        let mut results: Vec<RequestResult> = (0..8).map(|_| result(1, 0, 1)).collect();
        for _ in 0..2 {
            results.push(RequestResult {
                error: Some("overloaded".into()),
                ..Default::default()
            });
        }
        let outcome = RunOutcome {
            policy: "kv".into(),
            rate_scale: 1.0,
            results,
            ..Default::default()
        };
        let s = summarize(&outcome, 1);
        assert_eq!(s.ttft_ms.p90, 1.0);
        assert_eq!(s.ttft_p90_incl_errors_ms, None);
        assert_eq!(
            goodput(std::slice::from_ref(&s), 1000.0)[0].rate_scale,
            None
        );
        // No p90, no derived SLO.
        assert_eq!(derived_slo_ttft_ms(&s, 3.0), None);
    }

    fn run_at(policy: &str, rate: f64, p90_ms: u64, rps: f64) -> PolicySummary {
        PolicySummary {
            policy: policy.into(),
            rate_scale: rate,
            ttft_p90_incl_errors_ms: Some(p90_ms as f64),
            throughput: Throughput {
                requests_per_s: rps,
                output_tokens_per_s: 0.0,
            },
            ..Default::default()
        }
    }

    #[test]
    fn derived_slo_is_a_factor_of_the_unloaded_p90() {
        let unloaded = run_at("round-robin", 0.1, 700, 0.5);
        let base = derived_slo_ttft_ms(&unloaded, 3.0).unwrap();
        assert_eq!(base.slo_ttft_ms(), 2100.0);
        assert_eq!(
            (base.policy.as_str(), base.rate_scale),
            ("round-robin", 0.1)
        );
        // With it, the policy whose p90 grows slower keeps goodput at higher rates.
        let runs = [
            run_at("kv", 1.0, 900, 1.0),
            run_at("round-robin", 1.0, 1500, 1.0),
            run_at("kv", 2.0, 2000, 2.0),
            run_at("round-robin", 2.0, 9000, 1.6),
        ];
        let settings = ReportSettings {
            slo_ttft_ms: base.slo_ttft_ms(),
            slo_base: Some(base),
            ..Default::default()
        };
        let report = ReplayReport::new("t".into(), settings, Ideals::default(), runs.to_vec());
        let rates: Vec<Option<f64>> = report.goodput.iter().map(|g| g.rate_scale).collect();
        assert_eq!(rates, vec![Some(2.0), Some(1.0)]);
        let table = render_table(&report);
        assert!(
            table.contains("2100 ms = 3 x round-robin's unloaded p90 at x0.1, 700 ms"),
            "{table}"
        );
    }

    #[test]
    fn saturation_is_the_most_requests_per_second() {
        let runs = [
            run_at("kv", 1.0, 0, 1.0),
            run_at("round-robin", 1.0, 0, 1.0),
            run_at("kv", 2.0, 0, 2.0),
            run_at("round-robin", 2.0, 0, 1.9),
            run_at("kv", 4.0, 0, 2.5),
            run_at("round-robin", 4.0, 0, 1.95),
        ];
        let sat = saturation(&runs);
        assert_eq!(sat[0].policy, "kv");
        assert_eq!((sat[0].requests_per_s, sat[0].rate_scale), (2.5, 4.0));
        assert_eq!(sat[0].saturates_at_rate_scale, 4.0);
        assert_eq!((sat[1].requests_per_s, sat[1].rate_scale), (1.95, 4.0));
        // 1.9 ≥ 0.95 × 1.95: round robin saturates from x2.
        assert_eq!(sat[1].saturates_at_rate_scale, 2.0);
        let report = ReplayReport::new(
            "t".into(),
            ReportSettings::default(),
            Ideals::default(),
            runs.to_vec(),
        );
        let cmp = report.kv_vs_round_robin.unwrap();
        assert!((cmp.saturation_ratio.unwrap() - 2.5 / 1.95).abs() < 1e-12);
        assert_eq!(cmp.at_rr_saturation.unwrap().rate_scale, 2.0);
    }
}

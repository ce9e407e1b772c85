//! Open-loop route latency measurement (`kvrouter bench route-latency`).
//!
//! Requests are scheduled by intended send time (request `i` at `start + i / rate`) and each
//! latency runs from the intended send time to the reply, so a stalled router shows up in the
//! tail instead of silently slowing the sender (no coordinated omission). The pacing runs on
//! its own OS thread (`std::thread::sleep` is precise to tens of µs; the tokio timer ticks in
//! milliseconds) and every request runs as its own task.

use crate::phase_ab::{AbState, PhaseAb};
use crate::stats::percentile;
use kvrouter_client::{GenerateParams, KvRouterClient};
use kvrouter_protocol::RouteRequest;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What to send.
#[derive(Clone, Debug, PartialEq)]
pub struct RouteLatencyConfig {
    pub model: String,
    /// Requests per second (open loop).
    pub rate: f64,
    pub prompt_tokens: usize,
    pub duration: Duration,
    /// Fraction of each prompt taken from a small pool of shared prefixes, so the index sees
    /// overlaps.
    pub prefix_share: f64,
    /// How many shared prefixes the pool holds.
    pub prefix_pool: usize,
    pub seed: u64,
    /// Run each shared prefix through the fleet first (generate, one output token), so the
    /// workers cache it and the index holds it during the measurement.
    pub warm_up: bool,
    /// Prompts to send instead of random ones (a trace's), cycled in order; the warm-up
    /// then runs the first `prefix_pool` of them.
    pub prompts: Option<std::sync::Arc<Vec<Vec<u32>>>>,
    /// Flip the replicas' phase timing on and off during the run, and report the service
    /// time of each half.
    pub phase_ab: Option<PhaseAb>,
}

impl RouteLatencyConfig {
    pub fn new(
        model: impl Into<String>,
        rate: f64,
        prompt_tokens: usize,
        duration: Duration,
    ) -> Self {
        Self {
            model: model.into(),
            rate,
            prompt_tokens,
            duration,
            prefix_share: 0.5,
            prefix_pool: 8,
            seed: 0x6b76_726f_7574_6572,
            warm_up: true,
            prompts: None,
            phase_ab: None,
        }
    }

    pub fn validate(&self) -> Result<(), String> {
        if !(self.rate.is_finite() && self.rate > 0.0) {
            return Err(format!(
                "rate must be a positive number of requests per second, got {}",
                self.rate
            ));
        }
        if self.prompt_tokens == 0 && self.prompts.is_none() {
            return Err("prompt tokens must be at least 1".into());
        }
        if self.duration.is_zero() {
            return Err("duration must be positive".into());
        }
        if !(0.0..=1.0).contains(&self.prefix_share) {
            return Err(format!(
                "prefix share must be within 0..=1, got {}",
                self.prefix_share
            ));
        }
        if self.prefix_pool == 0 {
            return Err("the prefix pool needs at least one prefix".into());
        }
        if let Some(ab) = &self.phase_ab {
            ab.validate()?;
        }
        if self.prompts.as_ref().is_some_and(|p| p.is_empty()) {
            return Err("the prompt list is empty".into());
        }
        Ok(())
    }
}

/// Latency percentiles in µs (nearest-rank).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct LatencySummary {
    pub count: usize,
    pub p50_us: u64,
    pub p99_us: u64,
    pub p999_us: u64,
    pub max_us: u64,
    pub mean_us: f64,
}

impl LatencySummary {
    /// Summarises samples (sorted in place). All zero when there are none.
    pub fn from_samples(samples: &mut [u64]) -> Self {
        samples.sort_unstable();
        let count = samples.len();
        if count == 0 {
            return Self::default();
        }
        let sum: u128 = samples.iter().map(|&v| u128::from(v)).sum();
        Self {
            count,
            p50_us: percentile(samples, 0.50).unwrap_or(0),
            p99_us: percentile(samples, 0.99).unwrap_or(0),
            p999_us: percentile(samples, 0.999).unwrap_or(0),
            max_us: samples[count - 1],
            mean_us: sum as f64 / count as f64,
        }
    }
}

/// When request `i` should go out: `start + i / rate`.
pub fn intended_send_time(start: Instant, rate: f64, i: u64) -> Instant {
    start + Duration::from_secs_f64(i as f64 / rate)
}

/// How many requests a run of `duration` at `rate` sends.
pub fn scheduled_count(rate: f64, duration: Duration) -> u64 {
    (rate * duration.as_secs_f64()).ceil().max(0.0) as u64
}

/// Random prompts of a fixed length whose first `prefix_share` part comes from a pool of
/// shared prefixes; or a given list of prompts, cycled.
#[derive(Clone, Debug)]
pub struct PromptSource {
    prompt_tokens: usize,
    prefixes: Vec<Vec<u32>>,
    rng: fastrand::Rng,
    list: Option<(std::sync::Arc<Vec<Vec<u32>>>, usize)>,
}

/// Token ids are drawn from `1..VOCAB`.
const VOCAB: u32 = 32_000;

impl PromptSource {
    /// The prompts of `config`: its list if it has one, else random ones.
    pub fn of(config: &RouteLatencyConfig) -> Self {
        match &config.prompts {
            Some(list) => Self {
                prompt_tokens: 0,
                prefixes: list.iter().take(config.prefix_pool).cloned().collect(),
                rng: fastrand::Rng::with_seed(config.seed),
                list: Some((list.clone(), 0)),
            },
            None => Self::new(
                config.prompt_tokens,
                config.prefix_share,
                config.prefix_pool,
                config.seed,
            ),
        }
    }

    pub fn new(prompt_tokens: usize, prefix_share: f64, pool: usize, seed: u64) -> Self {
        let mut rng = fastrand::Rng::with_seed(seed);
        let prefix_len = ((prompt_tokens as f64) * prefix_share.clamp(0.0, 1.0)).round() as usize;
        let prefix_len = prefix_len.min(prompt_tokens);
        let prefixes = (0..pool.max(1))
            .map(|_| (0..prefix_len).map(|_| random_token(&mut rng)).collect())
            .collect();
        Self {
            prompt_tokens,
            prefixes,
            rng,
            list: None,
        }
    }

    /// The shared prefixes (to warm the workers' caches with).
    pub fn prefixes(&self) -> &[Vec<u32>] {
        &self.prefixes
    }

    pub fn next_prompt(&mut self) -> Vec<u32> {
        if let Some((list, next)) = &mut self.list {
            let prompt = list
                .get(*next % list.len().max(1))
                .cloned()
                .unwrap_or_default();
            *next += 1;
            return prompt;
        }
        let pick = self.rng.usize(..self.prefixes.len());
        let mut tokens = Vec::with_capacity(self.prompt_tokens);
        if let Some(prefix) = self.prefixes.get(pick) {
            tokens.extend_from_slice(prefix);
        }
        while tokens.len() < self.prompt_tokens {
            tokens.push(random_token(&mut self.rng));
        }
        tokens
    }
}

fn random_token(rng: &mut fastrand::Rng) -> u32 {
    rng.u32(1..VOCAB)
}

/// The result of a run.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RouteLatencyReport {
    pub model: String,
    pub target_rate: f64,
    pub prompt_tokens: usize,
    pub prefix_share: f64,
    pub duration_s: f64,
    /// Requests sent.
    pub sent: u64,
    /// Successful decisions.
    pub ok: u64,
    /// Failed requests by [`ClientError::kind_label`](kvrouter_client::ClientError::kind_label).
    pub errors: BTreeMap<String, u64>,
    /// Requests sent per second of the send window.
    pub send_rate: f64,
    /// Replies (ok or error) per second, from the start to the last reply.
    pub achieved_rate: f64,
    /// Successful requests: intended send time → reply (what a caller waiting on the
    /// schedule sees).
    pub latency: LatencySummary,
    /// Successful requests: actual send → reply (the router and bus alone).
    pub service: LatencySummary,
    /// How late the sender was against the schedule.
    pub send_lag: LatencySummary,
    /// With `phase_ab`: service times with the replicas' phase timing on and off.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub phase_ab: Option<PhaseAbReport>,
}

/// Service times of the requests answered while phase timing was on, and while it was off.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PhaseAbReport {
    pub on: LatencySummary,
    pub off: LatencySummary,
    /// How much longer the median service time was with timing on, in percent.
    pub p50_overhead_pct: f64,
}

impl PhaseAbReport {
    fn new(mut on: Vec<u64>, mut off: Vec<u64>) -> Self {
        let (on, off) = (
            LatencySummary::from_samples(&mut on),
            LatencySummary::from_samples(&mut off),
        );
        let p50_overhead_pct = if off.p50_us > 0 {
            (on.p50_us as f64 / off.p50_us as f64 - 1.0) * 100.0
        } else {
            0.0
        };
        Self {
            on,
            off,
            p50_overhead_pct,
        }
    }
}

struct Sample {
    ok: Result<(), &'static str>,
    latency_us: u64,
    service_us: u64,
    lag_us: u64,
    done: Instant,
    /// Phase timing was on (or off) from send to answer; `None` across a flip or without
    /// an A/B run.
    timing_on: Option<bool>,
}

/// A duration in whole µs (saturating).
pub(crate) fn us(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Sends route requests (`update_states` off: the decision alone is measured) at an open-loop
/// rate and reports their latency. Must run inside a multi-threaded tokio runtime.
pub async fn run_route_latency(
    client: &KvRouterClient,
    config: &RouteLatencyConfig,
) -> Result<RouteLatencyReport, String> {
    config.validate()?;
    let total = scheduled_count(config.rate, config.duration);
    let mut prompts = PromptSource::of(config);
    if config.warm_up {
        for prefix in prompts.prefixes() {
            let params = GenerateParams::new(config.model.clone(), prefix.clone(), 1);
            client
                .generate(&params)
                .await
                .map_err(|e| format!("warm-up generate failed: {e}"))?;
        }
        // Let the KV events reach every replica.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let ab_state = Arc::new(AbState::default());
    let (stop_ab, stopped) = tokio::sync::watch::channel(false);
    let ab = config
        .phase_ab
        .clone()
        .map(|ab| tokio::spawn(ab.run(ab_state.clone(), stopped)));
    let with_ab = ab.is_some();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Sample>();
    let handle = tokio::runtime::Handle::current();
    let client = client.clone();
    let model = config.model.clone();
    let rate = config.rate;
    // The prompt of each request is built before sleeping until its send time.
    let start = Instant::now() + Duration::from_millis(20);
    let pacer = std::thread::Builder::new()
        .name("route-latency-pacer".into())
        .spawn(move || {
            for i in 0..total {
                let intended = intended_send_time(start, rate, i);
                let req = RouteRequest::new(model.clone(), prompts.next_prompt())
                    .with_request_id(format!("bench-{i}"));
                let now = Instant::now();
                if intended > now {
                    std::thread::sleep(intended - now);
                }
                let client = client.clone();
                let tx = tx.clone();
                let ab_state = ab_state.clone();
                handle.spawn(async move {
                    let before = ab_state.read();
                    let sent = Instant::now();
                    let result = client.route(&req).await;
                    let done = Instant::now();
                    let timing_on = AbState::settled(before, ab_state.read());
                    let _ = tx.send(Sample {
                        ok: result.map(|_| ()).map_err(|e| e.kind_label()),
                        latency_us: us(done.saturating_duration_since(intended)),
                        service_us: us(done.saturating_duration_since(sent)),
                        lag_us: us(sent.saturating_duration_since(intended)),
                        done,
                        timing_on,
                    });
                });
            }
            Instant::now()
        })
        .map_err(|e| format!("cannot start the pacing thread: {e}"))?;

    let cap = usize::try_from(total).unwrap_or(usize::MAX).min(1 << 20);
    let mut latency = Vec::with_capacity(cap);
    let mut service = Vec::with_capacity(cap);
    let mut lag = Vec::with_capacity(cap);
    let (mut timed_on, mut timed_off) = (Vec::new(), Vec::new());
    let mut errors: BTreeMap<String, u64> = BTreeMap::new();
    let mut last_done = start;
    let mut received = 0u64;
    // Every spawned task holds a sender; the channel closes when the pacer and all requests
    // are done.
    while let Some(s) = rx.recv().await {
        received += 1;
        lag.push(s.lag_us);
        last_done = last_done.max(s.done);
        match s.ok {
            Ok(()) => {
                latency.push(s.latency_us);
                service.push(s.service_us);
                match s.timing_on {
                    Some(true) => timed_on.push(s.service_us),
                    Some(false) => timed_off.push(s.service_us),
                    None => {}
                }
            }
            Err(kind) => *errors.entry(kind.to_string()).or_default() += 1,
        }
    }
    let send_end = tokio::task::spawn_blocking(move || pacer.join())
        .await
        .map_err(|e| format!("pacing thread lost: {e}"))?
        .map_err(|_| "pacing thread panicked".to_string())?;
    let _ = stop_ab.send(true);
    if let Some(ab) = ab {
        ab.await
            .map_err(|e| format!("the phase-timing switch task failed: {e}"))??;
    }
    let ok = latency.len() as u64;
    let send_window = send_end.saturating_duration_since(start).as_secs_f64();
    let reply_window = last_done.saturating_duration_since(start).as_secs_f64();
    Ok(RouteLatencyReport {
        model: config.model.clone(),
        target_rate: config.rate,
        // With a prompt list: its mean length.
        prompt_tokens: config.prompts.as_ref().map_or(config.prompt_tokens, |l| {
            l.iter().map(Vec::len).sum::<usize>() / l.len().max(1)
        }),
        prefix_share: config.prefix_share,
        duration_s: config.duration.as_secs_f64(),
        sent: total,
        ok,
        errors,
        send_rate: if send_window > 0.0 {
            total as f64 / send_window
        } else {
            0.0
        },
        achieved_rate: if reply_window > 0.0 {
            received as f64 / reply_window
        } else {
            0.0
        },
        latency: LatencySummary::from_samples(&mut latency),
        service: LatencySummary::from_samples(&mut service),
        send_lag: LatencySummary::from_samples(&mut lag),
        phase_ab: with_ab.then(|| PhaseAbReport::new(timed_on, timed_off)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summaries_sort_and_average() {
        let mut v = vec![5, 1, 4, 2, 3];
        let s = LatencySummary::from_samples(&mut v);
        assert_eq!(s.count, 5);
        assert_eq!(s.p50_us, 3);
        assert_eq!(s.p99_us, 5);
        assert_eq!(s.max_us, 5);
        assert!((s.mean_us - 3.0).abs() < 1e-9);
        assert_eq!(
            LatencySummary::from_samples(&mut []),
            LatencySummary::default()
        );
    }

    #[test]
    fn schedule_is_evenly_spaced() {
        let start = Instant::now();
        assert_eq!(intended_send_time(start, 1000.0, 0), start);
        assert_eq!(
            intended_send_time(start, 1000.0, 250) - start,
            Duration::from_millis(250)
        );
        assert_eq!(scheduled_count(1000.0, Duration::from_secs(2)), 2000);
        assert_eq!(scheduled_count(0.5, Duration::from_secs(3)), 2);
    }

    #[test]
    fn prompts_share_prefixes() {
        let mut src = PromptSource::new(100, 0.5, 2, 42);
        let prompts: Vec<Vec<u32>> = (0..50).map(|_| src.next_prompt()).collect();
        assert!(prompts
            .iter()
            .all(|p| p.len() == 100 && p.iter().all(|&t| t > 0)));
        let prefixes: std::collections::HashSet<&[u32]> =
            prompts.iter().map(|p| &p[..50]).collect();
        assert_eq!(prefixes.len(), 2);
        let suffixes: std::collections::HashSet<&[u32]> =
            prompts.iter().map(|p| &p[50..]).collect();
        assert_eq!(suffixes.len(), 50);
        // No sharing: all distinct; full sharing: only pool-many prompts.
        let mut none = PromptSource::new(10, 0.0, 4, 1);
        let a = none.next_prompt();
        assert_ne!(a, none.next_prompt());
        let mut full = PromptSource::new(10, 1.0, 1, 1);
        assert_eq!(full.next_prompt(), full.next_prompt());
    }

    #[test]
    fn a_prompt_list_is_cycled_and_warms_up_with_its_first_prompts() {
        let list = vec![vec![1, 2], vec![3], vec![4, 5, 6]];
        let config = RouteLatencyConfig {
            prefix_pool: 2,
            prompts: Some(std::sync::Arc::new(list.clone())),
            ..RouteLatencyConfig::new("m", 100.0, 0, Duration::from_secs(1))
        };
        assert!(config.validate().is_ok(), "no --prompt-tokens needed");
        let mut src = PromptSource::of(&config);
        assert_eq!(src.prefixes(), &list[..2]);
        let sent: Vec<Vec<u32>> = (0..5).map(|_| src.next_prompt()).collect();
        assert_eq!(sent, [&list[..], &list[..2]].concat());
        let empty = RouteLatencyConfig {
            prompts: Some(Default::default()),
            ..config
        };
        assert!(empty.validate().is_err());
    }

    #[test]
    fn configs_are_checked() {
        let ok = RouteLatencyConfig::new("m", 100.0, 64, Duration::from_secs(1));
        assert!(ok.validate().is_ok());
        for bad in [
            RouteLatencyConfig {
                rate: 0.0,
                ..ok.clone()
            },
            RouteLatencyConfig {
                rate: f64::NAN,
                ..ok.clone()
            },
            RouteLatencyConfig {
                prompt_tokens: 0,
                ..ok.clone()
            },
            RouteLatencyConfig {
                duration: Duration::ZERO,
                ..ok.clone()
            },
            RouteLatencyConfig {
                prefix_share: 1.5,
                ..ok.clone()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }
}

//! The replay through real replicas and a mocker fleet on the in-process bus (virtual clock):
//! deterministic for a fixed seed, and kv beats round robin on a trace with shared prefixes.

use kvrouter_replay::requests::{build_requests, ReplayRequest};
use kvrouter_replay::runner::{run_policy, virtual_runtime, ReplayConfig};
use kvrouter_replay::trace::TraceRequest;
use kvrouter_replay::RunOutcome;
use kvrouter_scheduler::RoutingPolicy;

/// 60 requests, 100 ms apart, over 6 long shared prefixes (4 trace blocks each) plus one
/// block of their own: routing a request where its prefix is cached saves most of its prefill.
fn shared_prefix_trace() -> Vec<ReplayRequest> {
    let trace: Vec<TraceRequest> = (0..60u64)
        .map(|i| {
            let group = (i * 7) % 6;
            let mut hash_ids: Vec<u64> = (0..4).map(|b| group * 100 + b).collect();
            hash_ids.push(10_000 + i);
            TraceRequest {
                timestamp: i * 100,
                input_length: 5 * 512,
                output_length: 8,
                hash_ids,
            }
        })
        .collect();
    build_requests(&trace, 1.0).expect("requests")
}

fn replay_config() -> ReplayConfig {
    ReplayConfig {
        workers: 4,
        block_size: 64,
        capacity_blocks: 512,
        replicas: 2,
        seed: 7,
        ..ReplayConfig::default()
    }
}

fn run_replay(policy: RoutingPolicy, requests: &[ReplayRequest]) -> RunOutcome {
    let rt = virtual_runtime().expect("runtime");
    rt.block_on(run_policy(&replay_config(), policy, 1.0, requests, &|_| {}))
        .expect("replay runs")
}

fn hit_rate(o: &RunOutcome) -> f64 {
    let cached: u64 = o.results.iter().map(|r| u64::from(r.cached_blocks)).sum();
    let total: u64 = o.results.iter().map(|r| u64::from(r.prompt_blocks)).sum();
    cached as f64 / total as f64
}

fn mean_ttft_ms(o: &RunOutcome) -> f64 {
    o.results.iter().map(|r| r.ttft_us as f64).sum::<f64>() / o.results.len() as f64 / 1000.0
}

#[test]
fn the_replay_is_deterministic_for_a_fixed_seed() {
    let requests = shared_prefix_trace();
    let a = run_replay(RoutingPolicy::Kv, &requests);
    let b = run_replay(RoutingPolicy::Kv, &requests);
    assert!(
        a.results.iter().all(|r| r.error.is_none()),
        "{:?}",
        a.results[0]
    );
    assert_eq!(a.results.len(), 60);
    assert_eq!(a.results, b.results, "same seed, same replay");
    assert_eq!(a.duration_us, b.duration_us);
}

#[test]
fn kv_beats_round_robin_on_shared_prefixes() {
    let requests = shared_prefix_trace();
    let kv = run_replay(RoutingPolicy::Kv, &requests);
    let rr = run_replay(RoutingPolicy::RoundRobin, &requests);
    let (kv_hit, rr_hit) = (hit_rate(&kv), hit_rate(&rr));
    let (kv_ttft, rr_ttft) = (mean_ttft_ms(&kv), mean_ttft_ms(&rr));
    // The ideal: every request after its group's first finds its 32 shared blocks of 40.
    let ideal = (54.0 * 32.0) / (60.0 * 40.0);
    assert!(
        kv_hit >= 0.9 * ideal,
        "kv hit rate {kv_hit:.2}, ideal {ideal:.2}"
    );
    assert!(
        kv_hit > rr_hit + 0.1,
        "hit rate kv {kv_hit:.2} vs rr {rr_hit:.2}"
    );
    assert!(
        kv_ttft < rr_ttft * 0.75,
        "TTFT kv {kv_ttft:.0} ms vs rr {rr_ttft:.0} ms"
    );
    // Every request reports the full prompt's blocks.
    assert!(kv.results.iter().all(|r| r.prompt_blocks == 40));
}

/// `n` requests with prompts of their own (nothing cached anywhere), all arriving at the
/// same instant.
fn burst(n: u64) -> Vec<ReplayRequest> {
    let trace: Vec<TraceRequest> = (0..n)
        .map(|i| TraceRequest {
            timestamp: 0,
            input_length: 8 * 512,
            output_length: 16,
            hash_ids: (0..8).map(|b| 1_000 * (i + 1) + b).collect(),
        })
        .collect();
    build_requests(&trace, 1.0).expect("requests")
}

/// Requests per worker of one run, most loaded first.
fn per_worker(o: &RunOutcome) -> Vec<usize> {
    let mut counts = std::collections::BTreeMap::<u64, usize>::new();
    for r in &o.results {
        assert!(r.error.is_none(), "{r:?}");
        *counts.entry(r.worker_id).or_default() += 1;
    }
    let mut v: Vec<usize> = counts.into_values().collect();
    v.sort_unstable_by(|a, b| b.cmp(a));
    v
}

/// A burst of 8 through three replicas onto 8 idle workers; requests per worker.
fn burst_through_replicas(sync: bool, echo: std::time::Duration, seed: u64) -> Vec<usize> {
    let config = ReplayConfig {
        workers: 8,
        replicas: 3,
        replica_sync: sync,
        replica_sync_echo: echo,
        seed,
        ..replay_config()
    };
    let rt = virtual_runtime().expect("runtime");
    let o = rt
        .block_on(run_policy(
            &config,
            RoutingPolicy::Kv,
            1.0,
            &burst(8),
            &|_| {},
        ))
        .expect("replay runs");
    assert_eq!(o.results.len(), 8);
    per_worker(&o)
}

#[test]
fn a_burst_through_synced_replicas_spreads_across_workers() {
    // Eight requests at one instant, nothing cached, eight idle workers, three replicas
    // sharing the requests. Synced, each replica sees its peers' picks before deciding (the
    // peer batches are applied before every decision): the burst lands on at least 7
    // workers, at most 2 on one. Unsynced, each replica knows only its own third of the
    // burst and the picks collide.
    let echo = kvrouter_replica::DEFAULT_SYNC_ECHO;
    let mut unsynced_collisions = 0;
    for seed in 1..=6 {
        let synced = burst_through_replicas(true, echo, seed);
        assert!(
            synced.len() >= 7 && synced[0] <= 2,
            "seed {seed}: synced replicas put the burst on {synced:?}"
        );
        let unsynced = burst_through_replicas(false, echo, seed);
        if unsynced.len() < 7 {
            unsynced_collisions += 1;
        }
    }
    assert!(
        unsynced_collisions > 0,
        "unsynced replicas spread every burst too: the test shows nothing"
    );
}

//! The pure parts of `bench replay`: trace → requests, the ideals, summaries, goodput, the
//! kv-vs-round-robin comparison and the table.

use kvrouter_replay::ideal::{ideal_hit_rates, Ideals};
use kvrouter_replay::report::{goodput, render_table, ReplayReport, ReportSettings};
use kvrouter_replay::requests::{build_requests, load_trace, ReplayError};
use kvrouter_replay::trace::TraceRequest;
use kvrouter_replay::{LoadSample, RequestResult, RunOutcome};
use std::io::Write;
use std::time::Duration;

fn rec(timestamp: u64, input_length: u64, hash_ids: &[u64]) -> TraceRequest {
    TraceRequest {
        timestamp,
        input_length,
        output_length: 4,
        hash_ids: hash_ids.to_vec(),
    }
}

#[test]
fn trace_file_to_requests() {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    writeln!(
        f,
        "{{\"timestamp\": 1000, \"input_length\": 600, \"output_length\": 3, \"hash_ids\": [7, 8]}}"
    )
    .unwrap();
    writeln!(
        f,
        "{{\"timestamp\": 3000, \"input_length\": 512, \"output_length\": 5, \"hash_ids\": [7]}}"
    )
    .unwrap();
    writeln!(f, "not json").unwrap();
    // The limit stops before the malformed line.
    let trace = load_trace(f.path(), Some(2)).unwrap();
    assert_eq!(trace.len(), 2);
    assert!(matches!(
        load_trace(f.path(), None),
        Err(ReplayError::Trace(_))
    ));

    let reqs = build_requests(&trace, 4.0).unwrap();
    assert_eq!(reqs[0].arrival, Duration::ZERO);
    assert_eq!(reqs[1].arrival, Duration::from_millis(500));
    assert_eq!(reqs[0].tokens.len(), 600);
    assert_eq!(reqs[1].tokens[..], reqs[0].tokens[..512]);
    assert_eq!(reqs[1].output_tokens, 5);

    // Tokens depend on the id only, not on the request or the rate.
    let again = build_requests(&[rec(0, 512, &[8])], 1.0).unwrap();
    assert_eq!(again[0].tokens[..88], reqs[0].tokens[512..]);
    assert_ne!(again[0].tokens[..88], reqs[0].tokens[..88]);
}

#[test]
fn ideals_on_trace_blocks() {
    // Block 512: r0 = (1)(1,2), r1 = (1)(1,3), r2 = (1)(1,2).
    let trace = [
        rec(0, 1024, &[1, 2]),
        rec(100, 1024, &[1, 3]),
        rec(200, 1024, &[1, 2]),
    ];
    let reqs = build_requests(&trace, 1.0).unwrap();
    let ideal = ideal_hit_rates(&reqs, 512, 2);
    assert_eq!(ideal.prompt_blocks, 6);
    assert_eq!(ideal.unlimited_hits, 3); // 0 + 1 + 2
                                         // LRU of 2: after r1 it holds (1) and (1,3); r2 hits (1) only.
    assert_eq!(ideal.pooled_hits, 2);
    assert!((ideal.unlimited_hit_rate - 0.5).abs() < 1e-12);
    assert!((ideal.pooled_hit_rate - 2.0 / 6.0).abs() < 1e-12);
    assert_eq!(ideal_hit_rates(&reqs, 512, 3).pooled_hits, 3);

    // Any block size dividing 512 sees the same sharing: block 128 → 4 blocks per id.
    let ideal = ideal_hit_rates(&reqs, 128, 1000);
    assert_eq!(ideal.prompt_blocks, 24);
    assert_eq!(ideal.unlimited_hits, 4 + 8);
}

fn result(ttft_ms: u64, cached: u32, prompt: u32) -> RequestResult {
    RequestResult {
        ttft_us: ttft_ms * 1000,
        e2e_us: ttft_ms * 1000 + 50_000,
        cached_blocks: cached,
        prompt_blocks: prompt,
        output_tokens: 5,
        itl_mean_us: 2_000.0,
        ..Default::default()
    }
}

fn outcome(policy: &str, rate: f64, ttfts: &[u64], cached: u32) -> RunOutcome {
    RunOutcome {
        policy: policy.to_string(),
        rate_scale: rate,
        results: ttfts.iter().map(|&t| result(t, cached, 4)).collect(),
        samples: vec![LoadSample {
            at_us: 0,
            active_blocks: vec![2, 4, 6],
        }],
        duration_us: 1_000_000,
        ..Default::default()
    }
}

fn with_tail(base: u64, tail: u64) -> Vec<u64> {
    let mut v = vec![base; 9];
    v.push(tail);
    v
}

fn outcomes() -> Vec<RunOutcome> {
    vec![
        outcome("kv", 1.0, &[10; 10], 3),
        outcome("kv", 2.0, &[20; 10], 3),
        outcome("kv", 4.0, &with_tail(30, 5000), 3), // p90 = 30: meets
        outcome("round-robin", 1.0, &[40; 10], 1),
        outcome("round-robin", 2.0, &with_tail(50, 200), 1),
        outcome("round-robin", 4.0, &[300; 10], 1), // fails
        outcome("random", 1.0, &[150; 10], 1),
    ]
}

fn report_settings() -> ReportSettings {
    ReportSettings {
        workers: 2,
        dp_size: 1,
        block_size: 16,
        capacity_blocks: 100,
        replicas: 2,
        speedup: 1.0,
        slo_ttft_ms: 100.0,
        bus: "in-process".into(),
        requests: 10,
        seed: 1,
        truncated_requests: 0,
        ..ReportSettings::default()
    }
}

fn ideals() -> Ideals {
    Ideals {
        prompt_blocks: 40,
        unlimited_hits: 24,
        pooled_hits: 20,
        unlimited_hit_rate: 0.6,
        pooled_hit_rate: 0.5,
        pooled_capacity_blocks: 200,
    }
}

fn report() -> ReplayReport {
    ReplayReport::from_outcomes("t.jsonl".into(), report_settings(), ideals(), &outcomes())
}

fn close(a: Option<f64>, b: f64) -> bool {
    a.is_some_and(|a| (a - b).abs() < 1e-9)
}

#[test]
fn summaries_goodput_and_comparison() {
    let r = report();
    assert_eq!(r.runs.len(), 7);
    let kv1 = &r.runs[0];
    assert!((kv1.hit_rate - 0.75).abs() < 1e-12);
    assert!((kv1.load_spread.mean - 1.5).abs() < 1e-12);
    assert!((kv1.itl_mean_ms - 2.0).abs() < 1e-12);
    assert!((kv1.throughput.output_tokens_per_s - 50.0).abs() < 1e-9);
    let rr2 = &r.runs[4];
    assert_eq!(rr2.ttft_ms.p90, 50.0);
    assert_eq!(rr2.ttft_ms.p99, 200.0);
    assert!((rr2.ttft_ms.mean - 65.0).abs() < 1e-9);
    assert_eq!(rr2.uncached_prompt_tokens, 10 * 3 * 16);

    let g: Vec<(String, Option<f64>)> = r
        .goodput
        .iter()
        .map(|g| (g.policy.clone(), g.rate_scale))
        .collect();
    assert_eq!(
        g,
        vec![
            ("kv".to_string(), Some(4.0)),
            ("round-robin".to_string(), Some(2.0)),
            ("random".to_string(), None),
        ]
    );
    // A stricter SLO moves round robin down to 1 and leaves kv at 4.
    let strict = goodput(&r.runs, 45.0);
    assert_eq!(strict[1].rate_scale, Some(1.0));
    assert_eq!(strict[0].rate_scale, Some(4.0));

    let c = r.kv_vs_round_robin.as_ref().expect("kv and rr ran");
    assert_eq!(c.per_rate.len(), 3);
    assert_eq!(c.kv_goodput, Some(4.0));
    assert_eq!(c.rr_goodput, Some(2.0));
    assert!(close(c.goodput_gain, 1.0));
    let at = c
        .at_rr_goodput
        .as_ref()
        .expect("kv ran at rr's goodput rate");
    assert_eq!(at.rate_scale, 2.0);
    assert!(close(at.ttft_mean_ratio, 20.0 / 65.0));
    assert!(close(at.ttft_p99_ratio, 0.1));
    assert!(close(at.kv_hit_rate_vs_pooled, 1.5));
    // rr misses 480 tokens, the pooled ideal (40 − 20) × 16 = 320.
    assert_eq!(at.rr_uncached_prompt_tokens, 480);
    assert_eq!(at.pooled_uncached_prompt_tokens, 320);
    assert!(close(c.bound, 1.5));
    assert_eq!(c.bound_rate_scale, Some(2.0));
    assert!(close(c.target_goodput_gain, 0.4));
    assert_eq!(c.meets_goodput_target, Some(true));

    // Without round robin there is nothing to compare.
    let kv_only: Vec<RunOutcome> = outcomes()
        .into_iter()
        .filter(|o| o.policy == "kv")
        .collect();
    let r = ReplayReport::from_outcomes("t".into(), report_settings(), ideals(), &kv_only);
    assert!(r.kv_vs_round_robin.is_none());
}

#[test]
fn json_holds_every_field() {
    let v = serde_json::to_value(report()).unwrap();
    for key in [
        "trace",
        "config",
        "ideals",
        "runs",
        "goodput",
        "kv_vs_round_robin",
    ] {
        assert!(v.get(key).is_some(), "missing {key}");
    }
    for key in [
        "workers",
        "dp_size",
        "block_size",
        "capacity_blocks",
        "replicas",
        "speedup",
        "slo_ttft_ms",
        "bus",
    ] {
        assert!(v["config"].get(key).is_some(), "missing config.{key}");
    }
    for key in [
        "unlimited_hit_rate",
        "pooled_hit_rate",
        "pooled_capacity_blocks",
    ] {
        assert!(v["ideals"].get(key).is_some(), "missing ideals.{key}");
    }
    let run = &v["runs"][0];
    for key in [
        "policy",
        "rate_scale",
        "requests",
        "errors",
        "hit_rate",
        "ttft_ms",
        "itl_mean_ms",
        "e2e_ms",
        "throughput",
        "load_spread",
        "uncached_prompt_tokens",
    ] {
        assert!(run.get(key).is_some(), "missing runs[0].{key}");
    }
    for key in ["mean", "p50", "p90", "p99"] {
        assert!(run["ttft_ms"].get(key).is_some());
    }
    let cmp = &v["kv_vs_round_robin"];
    for key in [
        "per_rate",
        "goodput_gain",
        "bound",
        "target_goodput_gain",
        "at_rr_goodput",
    ] {
        assert!(cmp.get(key).is_some(), "missing kv_vs_round_robin.{key}");
    }
}

#[test]
fn table_is_readable() {
    let table = render_table(&report());
    println!("{table}");
    for needle in [
        "round-robin",
        "random",
        "unlimited cache 60.0%",
        "pooled LRU of 200 blocks 50.0%",
        "goodput",
        "kv x4",
        "random n/a",
        "0.31x",
        "met",
    ] {
        assert!(table.contains(needle), "table lacks {needle:?}:\n{table}");
    }
    let row_lines: Vec<&str> = table
        .lines()
        .filter(|l| l.starts_with("kv ") && l.contains('|'))
        .collect();
    assert_eq!(row_lines.len(), 3);
    assert!(row_lines.windows(2).all(|w| w[0].len() == w[1].len()));
}

//! `kvrouter demo` and `kvrouter bench replay` through the real binary.

mod common;

use common::{repo_file, run};
use serde_json::Value;

fn json(out: &std::process::Output) -> Value {
    assert!(
        out.status.success(),
        "exit {:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

fn field<'a>(v: &'a Value, path: &str) -> &'a Value {
    path.split('.').fold(v, |v, k| {
        let next = &v[k];
        assert!(!next.is_null(), "missing field {path} in {v}");
        next
    })
}

#[test]
fn the_demo_json_holds_every_figure() {
    let out = run(&["demo", "--json", "--limit", "300"]);
    let v = json(&out);
    for path in [
        "trace",
        "config.workers",
        "config.block_size",
        "config.capacity_blocks",
        "config.replicas",
        "config.slo_ttft_ms",
        "config.bus",
        "ideals.unlimited_hit_rate",
        "ideals.pooled_hit_rate",
        "goodput",
        "kv_vs_round_robin.per_rate",
    ] {
        field(&v, path);
    }
    let runs = v["runs"].as_array().expect("runs");
    let policies: Vec<&str> = runs.iter().map(|r| r["policy"].as_str().unwrap()).collect();
    assert_eq!(policies, vec!["kv", "round-robin"]);
    for r in runs {
        for path in [
            "rate_scale",
            "requests",
            "errors",
            "hit_rate",
            "ttft_ms.mean",
            "ttft_ms.p50",
            "ttft_ms.p90",
            "ttft_ms.p99",
            "itl_mean_ms",
            "e2e_ms.mean",
            "e2e_ms.p99",
            "throughput.output_tokens_per_s",
            "throughput.requests_per_s",
            "load_spread.mean",
        ] {
            field(r, path);
        }
        assert_eq!(r["requests"], 300);
        assert_eq!(r["errors"], 0);
        let hit = r["hit_rate"].as_f64().unwrap();
        assert!(hit > 0.0 && hit <= v["ideals"]["unlimited_hit_rate"].as_f64().unwrap());
    }
    // Deterministic: the same command gives the same report.
    assert_eq!(json(&run(&["demo", "--json", "--limit", "300"])), v);
}

#[test]
fn replay_plots_and_refuses_bad_settings() {
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("replay.svg");
    let trace = repo_file("data/synthetic_trace.jsonl");
    let out = run(&[
        "bench",
        "replay",
        "--trace",
        trace.to_str().unwrap(),
        "--limit",
        "150",
        "--policies",
        "kv,least-loaded",
        "--rate-scales",
        "1,4",
        "--plot",
        svg.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains("least-loaded") && table.contains("pooled LRU"),
        "{table}"
    );
    let plot = std::fs::read_to_string(&svg).expect("the plot is written");
    assert!(plot.contains("<svg") && plot.contains("least-loaded"));

    let bad = run(&[
        "bench",
        "replay",
        "--trace",
        trace.to_str().unwrap(),
        "--block-size",
        "48",
    ]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("512"));
    let bad = run(&["bench", "replay", "--trace", "/nonexistent.jsonl"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("/nonexistent.jsonl"));
}

//! `kvrouter demo` and `kvrouter bench replay` through the real binary.

use crate::common;

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

/// The default goodput objective is derived from the trace: 3 x round robin's p90 TTFT in an
/// extra run at x0.1, printed with the report; `--slo-ttft-ms` overrides it.
#[test]
fn the_default_slo_is_derived_from_round_robin_unloaded() {
    let trace = repo_file("data/mooncake_trace_1000.jsonl");
    let replay = |extra: &[&str]| {
        let mut args = vec![
            "bench",
            "replay",
            "--trace",
            trace.to_str().unwrap(),
            "--limit",
            "120",
            "--policies",
            "kv,round-robin",
            "--rate-scales",
            "1,2",
        ];
        args.extend_from_slice(extra);
        run(&args)
    };
    let v = json(&replay(&["--json"]));
    let base = field(&v, "config.slo_base");
    assert_eq!(base["policy"], "round-robin");
    assert_eq!(base["rate_scale"].as_f64(), Some(0.1));
    assert_eq!(base["factor"].as_f64(), Some(3.0));
    let p90 = base["p90_ttft_ms"].as_f64().unwrap();
    assert!(p90 > 0.0);
    let slo = field(&v, "config.slo_ttft_ms").as_f64().unwrap();
    assert!((slo - 3.0 * p90).abs() < 1e-6, "{slo} vs 3 x {p90}");
    // The base run is not one of the report's runs.
    assert_eq!(v["runs"].as_array().unwrap().len(), 4);
    for key in ["saturation", "kv_vs_round_robin.saturation_ratio"] {
        field(&v, key);
    }

    // Printed with the report.
    let out = replay(&["--slo-factor", "2", "--slo-base-rate-scale", "0.2"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains("x round-robin's unloaded p90 at x0.2") && table.contains("= 2 x"),
        "{table}"
    );
    assert!(table.contains("saturation throughput"), "{table}");

    // An explicit objective is used as given, with no base run.
    let v = json(&replay(&["--json", "--slo-ttft-ms", "1234"]));
    assert_eq!(field(&v, "config.slo_ttft_ms").as_f64(), Some(1234.0));
    assert!(v["config"]["slo_base"].is_null());
    let bad = replay(&["--slo-ttft-ms", "0"]);
    assert!(!bad.status.success());
}

/// `bench replay` with the replica-cluster set-ups: each flag reaches the replicas (their
/// counters show it at work) and the report names the set-up.
#[test]
fn replay_runs_every_replica_cluster_set_up() {
    let trace = repo_file("data/mooncake_trace_1000.jsonl");
    let replay = |extra: &[&str]| {
        let mut args = vec![
            "bench",
            "replay",
            "--trace",
            trace.to_str().unwrap(),
            "--limit",
            "120",
            "--policies",
            "kv",
            "--rate-scale",
            "1",
            "--replicas",
            "3",
            "--json",
        ];
        args.extend_from_slice(extra);
        let v = json(&run(&args));
        let run = v["runs"][0].clone();
        assert_eq!(run["requests"], 120, "{extra:?}");
        assert_eq!(run["errors"], 0, "{extra:?}");
        assert!(run["hit_rate"].as_f64().unwrap() > 0.0, "{extra:?}");
        (v["config"].clone(), run["cluster"].clone())
    };
    let n = |v: &Value, k: &str| field(v, k).as_u64().unwrap();

    // Three independent replicas: each applies every event, none asks or syncs.
    let (config, c) = replay(&[]);
    assert_eq!(n(&config, "serving_indexers"), 0);
    assert!(n(&c, "kv_events_applied") > 0);
    assert_eq!(n(&c, "replicas_applying_events"), 3);
    assert_eq!(
        n(&c, "remote_lookups") + n(&c, "sync_peers") + n(&c, "approx_records"),
        0
    );

    // One serving indexer, two remote: only the serving one applies events; the remote ones
    // ask it and never fall back.
    let (config, c) = replay(&["--serve-indexer-replicas", "1"]);
    assert_eq!(n(&config, "serving_indexers"), 1);
    assert_eq!(n(&c, "replicas_applying_events"), 1);
    assert!(n(&c, "remote_lookups") > 0);
    assert_eq!(n(&c, "remote_fallbacks"), 0);
    let (config, _) = replay(&["--remote-indexer"]);
    assert_eq!(n(&config, "serving_indexers"), 1);

    // Replica sync: every replica sees the other two.
    let (config, c) = replay(&["--replica-sync"]);
    assert_eq!(config["replica_sync"], true);
    assert_eq!(n(&c, "sync_peers"), 6);

    // Approximate mode: no events, the index is the replicas' own decisions.
    let (config, c) = replay(&["--no-kv-events"]);
    assert_eq!(config["no_kv_events"], true);
    assert_eq!(n(&c, "replicas_applying_events"), 0);
    assert!(n(&c, "approx_records") >= 120);

    let bad = run(&[
        "bench",
        "replay",
        "--trace",
        trace.to_str().unwrap(),
        "--replicas",
        "2",
        "--serve-indexer-replicas",
        "3",
    ]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("3 serving indexers asked of 2 replicas"));
}

/// `bench replay` with a host tier: blocks the small devices evict are loaded back from host
/// memory, the report counts them by tier, and the hit rate beats the same fleet without it.
#[test]
fn replay_with_a_host_tier_reports_hits_by_tier() {
    let trace = repo_file("data/mooncake_trace_1000.jsonl");
    let replay = |extra: &[&str]| {
        let mut args = vec![
            "bench",
            "replay",
            "--trace",
            trace.to_str().unwrap(),
            "--limit",
            "200",
            "--workers",
            "4",
            "--capacity-blocks",
            "2048",
            "--policies",
            "kv",
            "--rate-scale",
            "1",
            "--json",
        ];
        args.extend_from_slice(extra);
        let v = json(&run(&args));
        assert_eq!(v["runs"][0]["errors"], 0, "{extra:?}");
        v
    };
    let f = |v: &Value, k: &str| field(v, k).as_f64().unwrap();
    let without = replay(&[]);
    let with = replay(&["--host-capacity-blocks", "16384"]);
    let (r0, r1) = (&without["runs"][0], &with["runs"][0]);
    assert_eq!(f(r0, "host_hit_rate"), 0.0);
    assert!(f(r1, "host_hit_rate") > 0.0, "{r1}");
    assert_eq!(f(r1, "disk_hit_rate"), 0.0);
    assert!(f(r1, "hit_rate") > f(r0, "hit_rate"), "{r0} vs {r1}");
    assert_eq!(with["config"]["host_capacity_blocks"], 16384);
}

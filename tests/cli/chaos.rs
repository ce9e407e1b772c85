//! `kvrouter bench chaos` end to end: the real binary drives a real nats-server, three
//! replicas, two mocker processes and two emulated engines (vLLM-like and SGLang-like, two
//! ranks each) behind their `kvrouter bridge`s through every kind of fault, and every
//! replica ends up agreeing with the workers' true caches (the engines' own caches for the
//! bridged workers).

use crate::common;

use common::kvrouter;
use serde_json::Value;
use std::process::Command;
use std::time::Instant;

const KINDS: [&str; 8] = [
    "replica_kill",
    "replica_pause",
    "nats_restart",
    "mocker_kill",
    "event_drop",
    "garbage",
    "bridge_kill",
    "engine_kill",
];

#[test]
fn every_fault_kind_converges_and_nothing_diverges_after() {
    let found = Command::new("nats-server").arg("--version").output();
    assert!(
        found.is_ok_and(|o| o.status.success()),
        "nats-server is not on PATH: run the tests with scripts/test.sh (it sources \
         scripts/setup.sh, which installs it)"
    );
    let t0 = Instant::now();
    let out = kvrouter()
        .args([
            "bench",
            "chaos",
            "--duration",
            "60",
            "--seed",
            "1",
            "--json",
        ])
        .output()
        .expect("kvrouter runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let report: Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| {
        panic!(
            "no JSON report ({e}): status {:?}\nstdout {stdout}\nstderr {stderr}",
            out.status
        )
    });
    let faults = &report["faults_injected"];
    for kind in KINDS {
        assert!(
            faults[kind].as_u64().unwrap_or(0) >= 1,
            "{kind} was never injected: {faults}"
        );
        assert!(
            report["convergence_ms_by_kind"][kind]["max"].is_number(),
            "{kind} never converged: {}",
            report["convergence_ms_by_kind"]
        );
    }
    let engines = report["fleet"]["engines"].as_array().expect("engines");
    let kinds: Vec<&str> = engines.iter().filter_map(|e| e["kind"].as_str()).collect();
    assert_eq!(kinds, ["vllm", "sglang"], "{}", report["fleet"]);
    assert!(engines.iter().all(|e| e["dp_size"] == 2));
    // Mocker workers: 2 processes × 2 workers × 2 ranks; engines: 2 × 2 ranks.
    assert_eq!(report["fleet"]["worker_ranks"], 12);
    // Traffic reached the bridged engines, over HTTP as a frontend sends it.
    assert!(
        report["routes"]["engine_succeeded"].as_u64().unwrap_or(0) > 0,
        "{}",
        report["routes"]
    );
    assert!(
        report["routes"]["attempted"].as_u64().unwrap_or(0) > 0,
        "{}",
        report["routes"]
    );
    assert!(
        report["routes"]["succeeded"].as_u64().unwrap_or(0) > 0,
        "{}",
        report["routes"]
    );
    for f in report["faults"].as_array().expect("faults") {
        assert_eq!(f["converged"], true, "a fault did not converge: {f}");
        assert_eq!(f["divergence_after_convergence"], 0, "{f}");
    }
    assert_eq!(report["faults_unconverged"], 0);
    assert_eq!(report["final"]["converged"], true, "{}", report["final"]);
    assert!(
        report["final"]["prefixes_checked"].as_u64().unwrap_or(0) > 0,
        "the final comparison compared nothing: {}",
        report["final"]
    );
    assert!(
        report["final"]["engine_prefixes_checked"]
            .as_u64()
            .unwrap_or(0)
            > 0,
        "the final comparison compared nothing of the engines: {}",
        report["final"]
    );
    assert_eq!(
        report["divergence_after_convergence"], 0,
        "divergence after convergence: {report}"
    );
    assert_eq!(report["passed"], true);
    assert!(out.status.success(), "status {:?}: {stderr}", out.status);
    eprintln!(
        "chaos run: {:.0} s wall, convergence {} ms",
        t0.elapsed().as_secs_f64(),
        report["convergence_ms"]
    );
}

//! `kvrouter bench hostile` end to end, short: the real binary drives a real nats-server, two
//! replicas, a frontend and an emulated vLLM engine behind its bridge through a clean phase
//! and one phase per attack, and the invariants hold (not the timings): no process died,
//! honest success at least the threshold in every phase, the fleet served again after each
//! attack, every peak resident set under the ceiling, every process exited on SIGTERM
//! within its drain timeout.

use crate::common;

use common::{kvrouter, model_dir};
use serde_json::Value;
use std::process::Command;
use std::time::Instant;

/// Every attack of the bench: slow and half-open connections, oversized and nested bodies,
/// label floods, 200,000-entry worker lists, 1 MiB request ids, poisoned engine frames.
const ATTACKS: [&str; 6] = [
    "slowloris",
    "bodies",
    "labels",
    "allowed_workers",
    "request_ids",
    "poison_frames",
];

#[test]
fn the_fleet_absorbs_every_attack_and_exits_on_sigterm() {
    let found = Command::new("nats-server").arg("--version").output();
    assert!(
        found.is_ok_and(|o| o.status.success()),
        "nats-server is not on PATH: run the tests with scripts/test.sh (it sources \
         scripts/setup.sh, which installs it)"
    );
    let dir = model_dir();
    let t0 = Instant::now();
    let out = kvrouter()
        .args(["bench", "hostile", "--model-dir"])
        .arg(dir.path())
        .args([
            "--phase-secs",
            "3",
            "--slow-connections",
            "1100",
            "--attacks",
            &ATTACKS.join(","),
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
    eprintln!("hostile run: {:.0} s, {report}", t0.elapsed().as_secs_f64());

    let phases = report["phases"].as_array().expect("phases");
    let names: Vec<&str> = phases.iter().filter_map(|p| p["phase"].as_str()).collect();
    let mut expected = vec!["clean"];
    expected.extend(ATTACKS);
    assert_eq!(names, expected);
    let min_success = report["thresholds"]["min_success"].as_f64().unwrap();
    let max_rss = report["thresholds"]["max_rss_mib"].as_f64().unwrap();
    for p in phases {
        let phase = &p["phase"];
        for kind in ["completions", "routes"] {
            let h = &p[kind];
            assert!(h["sent"].as_u64().unwrap_or(0) > 0, "{phase}: no {kind}");
            assert!(
                h["success"].as_f64().unwrap() >= min_success,
                "{phase}: honest {kind} {h}"
            );
        }
        assert_eq!(p["died"], serde_json::json!([]), "{phase}");
        assert!(
            p["recovery_secs"].is_number(),
            "{phase}: never served again"
        );
        if phase != "clean" {
            let a = &p["attack"];
            assert!(
                a["ops"].as_u64().unwrap_or(0) > 0,
                "{phase}: no attack: {a}"
            );
            assert!(a["cpu_secs"].is_number());
        }
        if phase == "slowloris" {
            // At least a thousand connections at once on every listener.
            for listener in ["frontend", "replica", "bridge", "engine"] {
                let open = p["attack"]["peak_open"][listener].as_u64().unwrap_or(0);
                assert!(
                    open >= 1000,
                    "{listener}: only {open} slow connections at once"
                );
            }
        }
    }
    let procs = report["processes"].as_array().expect("processes");
    assert_eq!(
        procs.len(),
        6,
        "nats-server, 2 replicas, frontend, bridge, engine"
    );
    for p in procs {
        let name = &p["name"];
        assert!(p["died_in"].is_null(), "{name} died: {p}");
        assert!(
            p["peak_rss_mib"].as_f64().unwrap() <= max_rss,
            "{name}: {p}"
        );
        if p["drain_timeout_secs"].is_number() {
            assert_eq!(p["exited_in_time"], true, "{name} on SIGTERM: {p}");
        }
    }
    assert_eq!(report["failures"], serde_json::json!([]));
    assert_eq!(report["passed"], true);
    assert!(out.status.success(), "stderr {stderr}");
}

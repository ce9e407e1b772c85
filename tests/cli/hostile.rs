//! `kvrouter bench hostile` end to end, short: the real binary drives a real nats-server
//! (with the users `kvrouter creds` writes), two replicas, a frontend and an emulated vLLM
//! engine behind its bridge, each with its own credentials, through a clean phase and one
//! phase per attack, and the invariants hold (not the timings): no process died, honest
//! success at least the threshold in every phase, the fleet served again after each attack,
//! every peak resident set under the ceiling, every process exited on SIGTERM within its
//! drain timeout, no impostor's action took effect and each was refused where it should be.
//! The control run opens the bus and sees the same impostors take effect.

use crate::common;

use common::{kvrouter, model_dir};
use serde_json::Value;
use std::process::Command;
use std::time::Instant;

/// Every attack of the bench: slow and half-open connections, oversized and nested bodies,
/// label floods, 200,000-entry worker lists, 1 MiB request ids, a tenant ending others'
/// bookings, a bridge speaking for another worker, a frontend answering routes and
/// publishing sync, readers of others' replies, poisoned engine frames.
const ATTACKS: [&str; 10] = [
    "slowloris",
    "bodies",
    "labels",
    "allowed_workers",
    "request_ids",
    "lease_theft",
    "forged_worker",
    "frontend_impostor",
    "reply_reader",
    "poison_frames",
];

/// The attacks on who may do what over the bus.
const BUS_IMPOSTORS: [&str; 3] = ["forged_worker", "frontend_impostor", "reply_reader"];

/// Runs `kvrouter bench hostile --json` with `args`: its exit status and report.
fn hostile(args: &[&str]) -> (bool, Value) {
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
        .args(args)
        .args(["--seed", "1", "--json"])
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
    (out.status.success(), report)
}

/// A phase's count of `key` in `field` (`refusals`, or the attack's `outcomes`).
fn counted(phase: &Value, field: &str, key: &str) -> u64 {
    let v = if field == "refusals" {
        &phase["refusals"][key]
    } else {
        &phase["attack"][field][key]
    };
    v.as_u64().unwrap_or(0)
}

#[test]
fn the_fleet_absorbs_every_attack_and_exits_on_sigterm() {
    let attacks = ATTACKS.join(",");
    let (passed, report) = hostile(&[
        "--phase-secs",
        "3",
        "--slow-connections",
        "1100",
        "--attacks",
        &attacks,
    ]);

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
        if phase == "clean" {
            // Honest callers hold what they use: nothing refused them.
            assert_eq!(p["refusals"], serde_json::json!({}), "clean");
        } else {
            assert_eq!(p["attack"]["breaches"], 0, "{phase}: {p}");
        }
        let nats_refused = counted(p, "outcomes", "refused by nats-server");
        match phase.as_str().unwrap_or("") {
            "lease_theft" => {
                // Every theft answered like an unknown request, and counted: over HTTP and
                // the bus by the lease, without credentials at the door.
                let a = &p["attack"]["outcomes"];
                assert!(counted(p, "outcomes", "http 404") > 0, "{a}");
                assert!(counted(p, "outcomes", "bus unknown_request") > 0, "{a}");
                assert!(counted(p, "refusals", "lease_refused") > 0, "{p}");
                assert!(counted(p, "refusals", "http_auth_refused") > 0, "{p}");
                assert_eq!(a.get("http 200"), None, "{a}");
            }
            "forged_worker" => {
                // On the victim's subjects nats-server refuses; on its own, the replicas.
                assert!(nats_refused > 0, "{p}");
                assert!(counted(p, "refusals", "misattributed") > 0, "{p}");
            }
            "frontend_impostor" | "reply_reader" => assert!(nats_refused > 0, "{p}"),
            _ => {}
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
    assert!(passed);
}

/// The control: the same impostors on a bus without the users file take effect (forged
/// messages delivered, routes and replies read), and the run fails saying so. Without it,
/// the locked run's "no breach" could mean the bench cannot see one.
#[test]
fn on_an_open_bus_the_impostors_take_effect_and_the_run_fails() {
    let attacks = BUS_IMPOSTORS.join(",");
    let (passed, report) = hostile(&[
        "--phase-secs",
        "2",
        "--attacks",
        &attacks,
        "--open-bus",
        "--recovery-timeout-secs",
        "30",
    ]);
    assert!(!passed, "{report}");
    let phases = report["phases"].as_array().expect("phases");
    for p in phases.iter().skip(1) {
        let phase = &p["phase"];
        assert!(
            p["attack"]["breaches"].as_u64().unwrap_or(0) > 0,
            "{phase}: nothing took effect on an open bus: {p}"
        );
        let failed = report["failures"].as_array().unwrap();
        assert!(
            failed.iter().any(|f| f
                .as_str()
                .is_some_and(|f| f.starts_with(&format!("{}: ", phase.as_str().unwrap()))
                    && f.contains("took effect"))),
            "{phase}: {failed:?}"
        );
    }
}

//! `kvrouter frontend` end to end with a real third-party client: the official `openai`
//! Python SDK against the frontend, two `serve` replicas over a real nats-server, and
//! `mocker --emulate vllm` engines behind real bridges.

use crate::common;

use crate::support::{emulated_engine_with, EmulatedEngine};
use common::*;
use serde_json::Value;
use std::process::Command;
use std::time::{Duration, Instant};

/// Runs one scenario of tests/engines/openai_client.py and returns its JSON.
fn sdk(scenario: &str, port: u16, args: &[&str]) -> Value {
    let out = Command::new("python3")
        .arg(repo_file("tests/engines/openai_client.py"))
        .args([scenario, &format!("http://127.0.0.1:{port}"), E2E_MODEL])
        .args(args)
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "openai_client.py {scenario} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "openai_client.py {scenario}: not JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// An emulated vLLM engine (one rank per worker here, two for the first) and its bridge.
/// A rank's cache holds several 7,000-token answers at once: a full cache would end a held
/// stream early and let the overload check through.
struct BridgedEngine {
    engine: EmulatedEngine,
    bridge: Proc,
    worker_id: u64,
}

fn bridged_engine(nats: &NatsServer, dp: u32) -> BridgedEngine {
    let ports = free_ports(5);
    let (zmq, http) = (ports, ports + 4);
    let engine = emulated_engine_with("vllm", "array-batch", dp, zmq, http, 4096, 20, &[]);
    let (bridge, worker_id, _admin) = common::bridge(nats, &engine.at());
    BridgedEngine {
        engine,
        bridge,
        worker_id,
    }
}

/// Active requests a replica tracks, summed over ranks.
fn active_requests(admin: u16) -> u64 {
    metric_sum(admin, "kvrouter_worker_active_requests") as u64
}

#[test]
fn the_openai_sdk_through_the_frontend_replicas_and_engines() {
    let nats = NatsServer::start();
    let (a1, a2) = (free_port(), free_port());
    let r1 = serve(&nats, "r1", a1, &[]);
    let r2 = serve(&nats, "r2", a2, &[]);
    let mut engines = vec![bridged_engine(&nats, 2), bridged_engine(&nats, 1)];
    let dir = model_dir();
    let model_arg = format!("{E2E_MODEL}={}", dir.path().display());
    let url = nats.url();
    let mut fe = kvrouter_proc(
        "frontend",
        &[
            "frontend",
            "--nats",
            &url,
            "--listen",
            "127.0.0.1:0",
            "--model",
            &model_arg,
            "--max-inflight",
            "4",
            "--route-retries",
            "2",
        ],
    );
    let port: u16 = fe.first_json()["listen"]
        .as_str()
        .and_then(|a| a.rsplit(':').next()?.parse().ok())
        .expect("the frontend prints its address");
    assert!(ready(a1) && ready(a2), "replicas not ready");
    // Both replicas see all three ranks before the first request.
    assert!(wait_until(Duration::from_secs(10), || {
        [a1, a2]
            .iter()
            .all(|&a| metric_sum(a, "kvrouter_worker_ranks") >= 3.0)
    }));

    // Completions and chat, streaming and not.
    let v = sdk("basic", port, &[]);
    assert_eq!(v["completion"]["text"], " tok tok tok tok", "{v}");
    assert_eq!(v["completion"]["finish"], "length");
    assert_eq!(v["completion"]["usage"], 68);
    assert_eq!(v["completion_stream"]["text"], " tok tok tok tok");
    assert_eq!(v["chat"]["object"], "chat.completion");
    assert_eq!(v["chat"]["role"], "assistant");
    assert_eq!(v["chat"]["content"], " tok tok tok");
    assert_eq!(v["chat_stream"]["content"], " tok tok tok");
    assert_eq!(v["chat_stream"]["roles"], serde_json::json!(["assistant"]));
    assert!(v["chat_stream"]["usage"].as_u64().unwrap_or(0) > 3, "{v}");
    for k in ["completion", "completion_stream", "chat", "chat_stream"] {
        let worker = v[k]["worker"].as_str().unwrap_or_default();
        let id: u64 = worker.split(':').next().unwrap().parse().unwrap();
        assert!(engines.iter().any(|e| e.worker_id == id), "{k}: {worker}");
        assert!(["r1", "r2"].contains(&v[k]["replica"].as_str().unwrap()));
        assert!(!v[k]["request_id"].as_str().unwrap().is_empty());
    }
    assert_eq!(v["unknown_model"], 404);
    // An unknown model counts under one label, not its own.
    let (_, metrics) = http_get(port, "/metrics");
    assert!(!metrics.contains("no-such-model"), "{metrics}");
    assert!(metrics.contains(r#"model="_other""#), "{metrics}");
    assert_eq!(v["too_long"]["status"], 400);
    assert_eq!(v["too_long"]["code"], "context_length_exceeded");

    // A growing conversation stays on one rank and finds more of itself cached each time.
    let v = sdk("prefix", port, &["4"]);
    let rounds = v["rounds"].as_array().unwrap();
    let overlaps: Vec<u64> = rounds
        .iter()
        .map(|r| r["overlap"].as_u64().unwrap())
        .collect();
    assert_eq!(overlaps, vec![0, 4, 8, 12], "{v}");
    assert!(
        rounds.iter().all(|r| r["worker"] == rounds[0]["worker"]),
        "{v}"
    );

    // A client hanging up mid-stream leaves no load behind on any replica.
    let v = sdk("disconnect", port, &[]);
    assert_eq!(v["chunks"], 3);
    let t = Instant::now();
    assert!(
        wait_until(Duration::from_secs(1), || active_requests(a1)
            + active_requests(a2)
            == 0),
        "active requests left after a disconnect: {} + {}",
        active_requests(a1),
        active_requests(a2)
    );
    eprintln!("freed {:?} after the disconnect", t.elapsed());
    assert!(wait_until(Duration::from_secs(1), || {
        metric_sum(port, "kvrouter_frontend_routes_taken_total")
            == metric_sum(port, "kvrouter_frontend_routes_freed_total")
    }));

    // Four answers in flight fill the frontend (--max-inflight 4): the fifth gets a 503.
    let v = sdk("overload", port, &["4"]);
    assert_eq!(v["status"], 503, "{v}");
    assert_eq!(v["retry_after"], "1");
    assert!(wait_until(Duration::from_secs(2), || active_requests(a1)
        + active_requests(a2)
        == 0));

    // Slow clients hold connections, never in-flight places: eight that sent a head and one
    // body byte of 100,000 leave --max-inflight 4 free for honest requests.
    let slow: Vec<std::net::TcpStream> = (0..8)
        .map(|_| {
            let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
            std::io::Write::write_all(
                &mut s,
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{",
            )
            .unwrap();
            s
        })
        .collect();
    assert!(wait_until(Duration::from_secs(5), || metric_sum(
        port,
        "kvrouter_frontend_http_connections"
    ) >= 8.0));
    let v = sdk("many", port, &["4", "50"]);
    assert_eq!(v["ok"], 4, "{v}");
    drop(slow);

    // An engine killed while the router still lists it is routed around: no request fails.
    let v = sdk("many", port, &["1", "50"]);
    let cached_on = v["workers"][0].as_str().unwrap().to_string();
    let id: u64 = cached_on.split(':').next().unwrap().parse().unwrap();
    let dead = engines.iter().position(|e| e.worker_id == id).unwrap();

    let mut victim = engines.remove(dead);
    victim.bridge.signal(libc::SIGSTOP); // its registration outlives the engine for a while
    victim.engine.proc.kill();
    let v = sdk("many", port, &["5", "50"]);
    assert_eq!(v["ok"], 5, "{v}");
    assert_eq!(v["failed"], serde_json::json!([]));
    assert!(
        v["workers"]
            .as_array()
            .unwrap()
            .iter()
            .all(|w| *w != cached_on),
        "{v}"
    );
    assert!(metric_sum(port, "kvrouter_frontend_route_retries_total") >= 1.0);
    assert!(wait_until(Duration::from_secs(2), || active_requests(a1)
        + active_requests(a2)
        == 0));

    // A clean stop.
    assert!(fe
        .terminate(Duration::from_secs(10))
        .is_some_and(|s| s.success()));
    drop((r1, r2, engines, victim.bridge));
}

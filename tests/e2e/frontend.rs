//! `kvrouter frontend` end to end with a real third-party client: the official `openai`
//! Python SDK against the frontend, two `serve` replicas over a real nats-server, and
//! `mocker --emulate vllm` engines behind real bridges.

use crate::common;

use crate::support::{emulated_engine_with, sdk, EmulatedEngine};
use common::*;
use kvrouter_testkit::{OtlpReceiver, ReceivedSpan};
use serde_json::Value;
use std::time::{Duration, Instant};

/// An emulated vLLM engine (one rank per worker here, two for the first) and its bridge.
/// A rank's cache holds several 7,000-token answers at once: a full cache would end a held
/// stream early and let the overload check through.
struct BridgedEngine {
    engine: EmulatedEngine,
    bridge: Proc,
    worker_id: u64,
}

fn bridged_engine(nats: &NatsServer, dp: u32) -> BridgedEngine {
    bridged_engine_with(nats, dp, &["--cache-report"])
}

fn bridged_engine_with(nats: &NatsServer, dp: u32, extra: &[&str]) -> BridgedEngine {
    let ports = free_ports(5);
    let (zmq, http) = (ports, ports + 4);
    let engine = emulated_engine_with("vllm", "array-batch", dp, zmq, http, 4096, 20, extra);
    let (bridge, worker_id, _admin) = common::bridge(nats, &engine.at());
    BridgedEngine {
        engine,
        bridge,
        worker_id,
    }
}

/// The frontend's port, from its start line.
fn listen_port(fe: &mut Proc) -> u16 {
    fe.first_json()["listen"]
        .as_str()
        .and_then(|a| a.rsplit(':').next()?.parse().ok())
        .expect("the frontend prints its address")
}

/// `kvrouter frontend` on the bus of `nats` serving [`E2E_MODEL`] from `dir`, with `extra`
/// flags, and the port it listens on.
fn frontend(nats: &NatsServer, dir: &std::path::Path, extra: &[&str]) -> (Proc, u16) {
    let model_arg = format!("{E2E_MODEL}={}", dir.display());
    let url = nats.url();
    let mut args = vec![
        "frontend",
        "--nats",
        &url,
        "--listen",
        "127.0.0.1:0",
        "--model",
        &model_arg,
    ];
    args.extend_from_slice(extra);
    let mut fe = kvrouter_proc("frontend", &args);
    let port = listen_port(&mut fe);
    (fe, port)
}

/// `kvrouter_frontend_auth_refused_total` for one reason.
fn auth_refused(port: u16, reason: &str) -> f64 {
    let page = metrics(port);
    let prefix = format!("kvrouter_frontend_auth_refused_total{{reason=\"{reason}\"}} ");
    page.lines()
        .find_map(|l| l.strip_prefix(&prefix)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {prefix} in {page}"))
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
    let (fe, port) = frontend(
        &nats,
        dir.path(),
        &[
            "--max-inflight",
            "4",
            "--route-retries",
            "2",
            // Trusted clients: the test reads which worker served and what was cached.
            "--grant-overlap-header",
        ],
    );
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

/// Where each request's time went and whether the cache the router predicted was there:
/// the frontend and the replica time every phase of a request (and stop when switched off
/// at `/debug/phase-timing`), and the frontend holds each engine's reported cached tokens
/// against the router's prediction: close along a conversation, `under` while the engine's
/// KV events do not reach the router, missing from an engine that does not report them. The
/// client's `traceparent` reaches the engine.
#[test]
fn the_doors_time_each_phase_and_check_the_engines_cached_tokens() {
    let nats = NatsServer::start();
    let a1 = free_port();
    let r1 = serve(&nats, "r1", a1, &[]);
    let mut reporting = bridged_engine(&nats, 1);
    let dir = model_dir();
    let (fe, port) = frontend(&nats, dir.path(), &["--grant-overlap-header"]);
    assert!(ready(a1), "replica not ready");
    assert!(wait_until(Duration::from_secs(10), || metric_sum(
        a1,
        "kvrouter_worker_ranks"
    ) >= 1.0));

    // Completions and chat (two each, one streamed), then a conversation of 4 rounds.
    sdk("basic", port, &[]);
    let v = sdk("prefix", port, &["4"]);
    let overlaps: Vec<u64> = v["rounds"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["overlap"].as_u64().unwrap())
        .collect();
    assert_eq!(overlaps, [0, 4, 8, 12], "{v}");
    let phases = |port: u16, name: &str, phase: &str| {
        metric_where(port, name, &[("model", E2E_MODEL), ("phase", phase)])
    };
    let (door, replica) = (
        "kvrouter_frontend_phase_seconds_count",
        "kvrouter_route_phase_seconds_count",
    );
    for phase in ["parse", "tokenize", "route", "engine_first_byte"] {
        assert_eq!(phases(port, door, phase), 8.0, "{phase}: {}", metrics(port));
    }
    assert_eq!(phases(port, door, "template"), 2.0, "the chats alone");
    for phase in [
        "decode",
        "hash",
        "index_local",
        "schedule",
        "queue",
        "encode",
    ] {
        assert_eq!(phases(a1, replica, phase), 8.0, "{phase}: {}", metrics(a1));
    }
    assert_eq!(phases(a1, replica, "index_remote"), 0.0);
    assert!(
        phases(a1, "kvrouter_route_phase_seconds_sum", "hash") > 0.0,
        "time was measured"
    );

    // Switched off, the replica times nothing; on again, it does.
    let (status, body) = http_get(a1, "/debug/phase-timing?set=off");
    assert_eq!((status, body.as_str()), (200, r#"{"phase_timing":false}"#));
    sdk("many", port, &["2", "60"]);
    assert_eq!(phases(a1, replica, "hash"), 8.0, "timed while off");
    assert_eq!(http_get(a1, "/debug/phase-timing?set=maybe").0, 400);
    assert_eq!(http_get(a1, "/debug/phase-timing?set=on").0, 200);
    sdk("many", port, &["1", "61"]);
    assert_eq!(phases(a1, replica, "hash"), 9.0);

    // Every answer so far was where the router said (within a block): no misprediction.
    let worker = reporting.worker_id.to_string();
    let at = |name: &str, extra: &[(&str, &str)]| {
        let mut labels = vec![("worker", worker.as_str())];
        labels.extend_from_slice(extra);
        metric_where(port, name, &labels)
    };
    let page = metrics(port);
    // Never `over`; `under` only where a request raced the events of the one before it
    // with the same prompt (a loaded machine delays them): at most a couple.
    let lagged = at(
        "kvrouter_frontend_cache_mispredictions_total",
        &[("direction", "under")],
    );
    assert_eq!(
        metric_sum_in(&page, "kvrouter_frontend_cache_mispredictions_total"),
        lagged,
        "{page}"
    );
    assert!(lagged <= 2.0, "{page}");
    let predicted = at("kvrouter_frontend_cache_predicted_tokens_total", &[]);
    let reported = at("kvrouter_frontend_cache_reported_tokens_total", &[]);
    let answers = at("kvrouter_frontend_cache_prediction_error_tokens_count", &[]);
    assert_eq!(answers, 11.0, "every answer compared: {page}");
    assert!(
        predicted >= ((4 + 8 + 12) * E2E_BLOCK) as f64,
        "the conversation's overlaps: {predicted}"
    );
    assert!(
        (reported - predicted).abs() <= answers * E2E_BLOCK as f64,
        "predicted {predicted}, reported {reported}"
    );
    assert_eq!(
        metric_sum_in(&page, "kvrouter_frontend_cache_reports_missing_total"),
        0.0
    );

    // The client's trace context reaches the engine as it was sent (its own spans join the
    // client's trace); a malformed one is not passed on.
    let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let body = format!(r#"{{"model":"{E2E_MODEL}","prompt":[1,2,3],"max_tokens":1}}"#);
    for sent in [tp, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1"] {
        let (status, text) = http_post(port, "/v1/completions", &[("traceparent", sent)], &body);
        assert_eq!(status, 200, "{text}");
    }
    let (_, seen) = http_get(reporting.engine.http, "/kvrouter/test/traceparents");
    let seen: Vec<Value> = serde_json::from_str(&seen).unwrap();
    assert_eq!(
        seen[seen.len() - 2..],
        [Value::from(tp), Value::Null],
        "{seen:?}"
    );

    // The bridge stopped: the engine caches a prefix the router never hears of, and reports
    // it cached where the router predicted nothing.
    reporting.bridge.signal(libc::SIGSTOP);
    let v = sdk("many", port, &["3", "62"]);
    reporting.bridge.signal(libc::SIGCONT);
    assert_eq!(v["ok"], 3, "{v}");
    assert_eq!(
        at(
            "kvrouter_frontend_cache_mispredictions_total",
            &[("direction", "under")]
        ),
        lagged + 2.0,
        "the second and third requests found the first's prefix: {}",
        metrics(port)
    );

    // An engine started without its cache report (vLLM's default): its answers are counted
    // as missing reports, nothing else.
    let silent = bridged_engine_with(&nats, 1, &[]);
    let BridgedEngine { engine, bridge, .. } = reporting;
    assert!(bridge
        .terminate(Duration::from_secs(10))
        .is_some_and(|s| s.success()));
    engine.proc.kill();
    assert!(wait_until(Duration::from_secs(10), || metric_sum(
        a1,
        "kvrouter_worker_ranks"
    ) == 1.0));
    let compared = metric_sum(
        port,
        "kvrouter_frontend_cache_prediction_error_tokens_count",
    );
    let v = sdk("many", port, &["2", "63"]);
    assert_eq!(v["ok"], 2, "{v}");
    let silent_worker = silent.worker_id.to_string();
    assert!(
        v["workers"].as_array().unwrap().iter().all(|w| w
            .as_str()
            .unwrap()
            .starts_with(&format!("{silent_worker}:"))),
        "{v}"
    );
    assert_eq!(
        metric_where(
            port,
            "kvrouter_frontend_cache_reports_missing_total",
            &[("model", E2E_MODEL)]
        ),
        2.0
    );
    assert_eq!(
        metric_sum(
            port,
            "kvrouter_frontend_cache_prediction_error_tokens_count"
        ),
        compared
    );
    drop((fe, r1, silent));
}

const OPERATOR_KEY: &str = "sk-operator-0123456789abcdef";
const TENANT_KEY: &str = "sk-tenant-0123456789abcdef";

/// With API keys, the front door serves only callers holding one, and each only what the
/// operator granted its key: a tenant's key gets plain OpenAI answers (no `kvrouter`
/// extension, no x-kvrouter-* headers); the operator's key gets both. The client's
/// x-request-id is only a label: two requests may share one.
#[test]
fn the_front_door_serves_each_key_what_it_was_granted() {
    let nats = NatsServer::start();
    let a1 = free_port();
    let r1 = serve(&nats, "r1", a1, &[]);
    let engines = [bridged_engine(&nats, 1), bridged_engine(&nats, 1)];
    let dir = model_dir();
    let keys = dir.path().join("api-keys");
    std::fs::write(
        &keys,
        format!(
            "# who may call the front door\n\n{OPERATOR_KEY} routing-extension,overlap-header \
             # the operator's tools\n{TENANT_KEY}\n"
        ),
    )
    .unwrap();
    let keys = keys.display().to_string();
    let (fe, port) = frontend(&nats, dir.path(), &["--api-keys-file", &keys]);
    assert!(ready(a1), "replica not ready");
    assert!(wait_until(Duration::from_secs(10), || metric_sum(
        a1,
        "kvrouter_worker_ranks"
    ) >= 2.0));
    for reason in ["missing_key", "wrong_key", "routing_extension"] {
        assert_eq!(auth_refused(port, reason), 0.0, "{reason}");
    }

    // No key at all: 401 in OpenAI's shape, on every /v1/ path; the probes stay open.
    let body = format!(r#"{{"model":"{E2E_MODEL}","prompt":[1,2,3],"max_tokens":1}}"#);
    let (status, text) = http_post(port, "/v1/completions", &[], &body);
    assert_eq!(status, 401, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["error"]["code"], "invalid_api_key", "{v}");
    assert_eq!(v["error"]["type"], "authentication_error", "{v}");
    assert_eq!(http_get(port, "/v1/models").0, 401);
    let (status, _) = http_post(
        port,
        "/v1/completions",
        &[("Authorization", &format!("Basic {OPERATOR_KEY}"))],
        &body,
    );
    assert_eq!(status, 401);
    assert_eq!(http_get(port, "/health").0, 200);
    assert_eq!(http_get(port, "/readyz").0, 200);
    assert_eq!(auth_refused(port, "missing_key"), 3.0);

    let pin = engines[1].worker_id.to_string();
    let v = sdk("auth", port, &[OPERATOR_KEY, TENANT_KEY, &pin]);
    // A wrong key: 401 for completions and for the model list.
    for k in ["wrong_key", "wrong_key_models"] {
        assert_eq!(v[k]["status"], 401, "{k}: {v}");
        assert_eq!(v[k]["code"], "invalid_api_key", "{k}: {v}");
    }
    // The operator's key: the extension works (pinned to the second worker) and the
    // routing headers come.
    let op = &v["operator_pinned"];
    assert_eq!(op["worker"], format!("{pin}:0"), "{v}");
    assert_eq!(op["overlap"], 0, "{v}");
    assert_eq!(op["cached"], 0, "{v}");
    assert_eq!(op["replica"], "r1", "{v}");
    assert_eq!(
        op["x_kvrouter"],
        serde_json::json!([
            "x-kvrouter-overlap-blocks",
            "x-kvrouter-replica",
            "x-kvrouter-worker"
        ]),
        "{v}"
    );
    // A tenant's key: 403 on the extension, and no x-kvrouter-* header on its answers (its
    // prompt is the one just cached: the header would have told it so).
    let t = &v["tenant_extension"];
    assert_eq!(t["status"], 403, "{v}");
    assert_eq!(t["code"], "permission_denied", "{v}");
    assert_eq!(t["param"], "kvrouter", "{v}");
    assert!(
        t["message"]
            .as_str()
            .unwrap()
            .contains("--grant-routing-extension"),
        "{v}"
    );
    for k in ["tenant_plain", "tenant_chat_stream"] {
        assert_eq!(v[k]["x_kvrouter"], serde_json::json!([]), "{k}: {v}");
    }
    assert_eq!(v["tenant_plain"]["overlap"], -1, "{v}");
    // Nor the engine's cached-token count, the same probe in the usage.
    assert_eq!(v["tenant_plain"]["cached"], Value::Null, "{v}");
    assert!(!v["tenant_plain"]["request_id"].as_str().unwrap().is_empty());
    assert_eq!(v["tenant_models"], serde_json::json!([E2E_MODEL]), "{v}");
    assert_eq!(auth_refused(port, "wrong_key"), 2.0);
    assert_eq!(auth_refused(port, "routing_extension"), 1.0);

    // Two requests in flight at once under one x-request-id: both answered in full (the
    // router books each under the frontend's own id), each echoing the client's id.
    let shared = "tenant-chose-this-id";
    let v = sdk("same_id", port, &[TENANT_KEY, shared, "400"]);
    assert_eq!(v["inflight_together"], 2, "{v}");
    let answers = v["answers"].as_array().unwrap();
    assert_eq!(answers.len(), 2, "{v}");
    for a in answers {
        assert_eq!(a["request_id"], shared, "{v}");
        assert_eq!(
            a["text"].as_str().unwrap().matches("tok").count(),
            400,
            "{v}"
        );
    }
    // Nothing booked under the client's id, nothing left booked at all.
    assert!(wait_until(Duration::from_secs(2), || active_requests(a1) == 0));
    assert!(wait_until(Duration::from_secs(2), || {
        metric_sum(port, "kvrouter_frontend_routes_taken_total")
            == metric_sum(port, "kvrouter_frontend_routes_freed_total")
    }));
    assert!(fe
        .terminate(Duration::from_secs(10))
        .is_some_and(|s| s.success()));
    drop((r1, engines));
}

/// Keys that would leave the door open, or are too easy to guess, fail the start with a
/// message saying why (and never the key): an empty `--api-key` (flag or environment), a
/// short one, a keys file with no keys or a bad line.
#[test]
fn the_frontend_refuses_to_start_on_an_empty_or_weak_key() {
    let dir = tempfile::tempdir().unwrap();
    let model_arg = format!("{E2E_MODEL}={}", dir.path().join("no-model").display());
    let file = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    };
    let comments = file("comments", "# no keys yet\n\n");
    let indented = file("indented", "  routing-extension\n");
    let unknown = file("unknown", "sk-0123456789abcdef-secret admin\n");
    let start = |extra: &[&str], env: Option<&str>| {
        let mut cmd = kvrouter();
        cmd.args([
            "frontend",
            "--nats",
            "nats://127.0.0.1:1",
            "--listen",
            "127.0.0.1:0",
            "--model",
            &model_arg,
        ])
        .args(extra)
        .env_remove("KVROUTER_API_KEY")
        .env_remove("KVROUTER_API_KEYS_FILE");
        if let Some(v) = env {
            cmd.env("KVROUTER_API_KEY", v);
        }
        let out = cmd.output().expect("kvrouter runs");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let cases: Vec<(Vec<&str>, Option<&str>, &str)> = vec![
        (vec!["--api-key", ""], None, "the API key is empty"),
        (vec!["--api-key="], None, "the API key is empty"),
        (vec![], Some(""), "the API key is empty"),
        (vec![], Some("  \n"), "the API key is empty"),
        (vec!["--api-key", "sk-tiny"], None, "at least 16"),
        (vec!["--api-keys-file", &comments], None, "no keys in it"),
        (
            vec!["--api-keys-file", &indented],
            None,
            "line 1 starts with whitespace",
        ),
        (
            vec!["--api-keys-file", &unknown],
            None,
            "unknown grant \"admin\"",
        ),
        (
            vec!["--api-keys-file", "/nonexistent/keys"],
            None,
            "cannot use the API keys file /nonexistent/keys",
        ),
    ];
    for (args, env, want) in cases {
        let (ok, err) = start(&args, env);
        assert!(!ok, "{args:?} {env:?} started");
        assert!(err.contains(want), "{args:?} {env:?}: {err}");
        assert!(!err.contains("0123456789abcdef-secret"), "{err}");
        // The key is refused before the model directory is looked at.
        assert!(!err.contains("no-model"), "{args:?}: {err}");
    }
}

/// One request, one trace across three processes: the frontend's request span (under the
/// client's `traceparent`), its route call and the replica's route span under it (the
/// context on the bus), its engine call, whose id the engine receives as its parent. The
/// route span names the choice, its overlap by tier, its cost and the runner-up's, the
/// policy. A frontend that exports nothing still carries the client's context on to the
/// replica and the engine.
#[test]
fn one_request_is_one_trace_across_frontend_replica_and_engine() {
    let nats = NatsServer::start();
    let rx = OtlpReceiver::start().unwrap();
    let endpoint = rx.endpoint();
    let a1 = free_port();
    let _r1 = serve(&nats, "r1", a1, &["--otlp-traces-endpoint", &endpoint]);
    let engine = bridged_engine(&nats, 2);
    let dir = model_dir();
    let (_fe, port) = frontend(&nats, dir.path(), &["--otlp-traces-endpoint", &endpoint]);
    assert!(ready(a1), "replica not ready");
    assert!(wait_until(Duration::from_secs(10), || metric_sum(
        a1,
        "kvrouter_worker_ranks"
    ) >= 2.0));

    let client_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_span = "00f067aa0ba902b7";
    let tp = format!("00-{client_trace}-{client_span}-01");
    // Two full blocks, cached where they are routed.
    let prompt: Vec<u32> = (100..100 + 2 * E2E_BLOCK as u32).collect();
    let body = format!(
        r#"{{"model":"{E2E_MODEL}","prompt":{},"max_tokens":2}}"#,
        serde_json::to_string(&prompt).unwrap()
    );
    let (status, text) = http_post(port, "/v1/completions", &[("traceparent", &tp)], &body);
    assert_eq!(status, 200, "{text}");

    let spans = rx.wait_for(Duration::from_secs(10), |s| {
        s.iter().filter(|s| s.trace_id == client_trace).count() >= 4
    });
    let ours: Vec<&ReceivedSpan> = spans
        .iter()
        .filter(|s| s.trace_id == client_trace)
        .collect();
    let named = |name: &str| -> &ReceivedSpan {
        let found: Vec<_> = ours.iter().filter(|s| s.name == name).collect();
        assert_eq!(found.len(), 1, "one {name} span: {ours:#?}");
        found[0]
    };
    let request = named("kvrouter.frontend.request");
    let call = named("kvrouter.route_call");
    let route = named("kvrouter.route");
    let engine_call = named("kvrouter.engine_call");
    assert_eq!(ours.len(), 4, "{ours:#?}");
    assert_eq!(rx.rejected(), 0, "every export decoded");

    // Nesting across the processes.
    assert_eq!(request.service, "kvrouter-frontend");
    assert_eq!(request.parent_span_id.as_deref(), Some(client_span));
    assert_eq!(
        (request.kind, call.kind, route.kind, engine_call.kind),
        (2, 3, 2, 3)
    );
    assert_eq!(call.parent_span_id, Some(request.span_id.clone()));
    assert_eq!(engine_call.parent_span_id, Some(request.span_id.clone()));
    assert_eq!(route.service, "kvrouter-replica");
    assert_eq!(
        route.parent_span_id,
        Some(call.span_id.clone()),
        "the bus carried the route call's context"
    );
    let (_, seen) = http_get(engine.engine.http, "/kvrouter/test/traceparents");
    let seen: Vec<Value> = serde_json::from_str(&seen).unwrap();
    assert_eq!(
        seen.last().and_then(Value::as_str),
        Some(format!("00-{client_trace}-{}-01", engine_call.span_id).as_str()),
        "the engine's parent is the engine call"
    );
    // Each span within its parent's time (one host: one clock).
    for (child, parent) in [(call, request), (engine_call, request)] {
        assert!(
            child.start_unix_nano >= parent.start_unix_nano
                && child.end_unix_nano <= parent.end_unix_nano,
            "{child:#?} within {parent:#?}"
        );
    }

    // What the route span says of the choice.
    let worker = engine.worker_id.to_string();
    assert_eq!(route.attr("kvrouter.worker_id"), Some(worker.as_str()));
    assert_eq!(call.attr("kvrouter.worker_id"), Some(worker.as_str()));
    assert_eq!(
        engine_call.attr("kvrouter.worker_id"),
        Some(worker.as_str())
    );
    let rank = route.attr("kvrouter.dp_rank").unwrap();
    assert!(rank == "0" || rank == "1", "{rank}");
    assert_eq!(route.attr("kvrouter.policy"), Some("kv"));
    assert_eq!(route.attr("kvrouter.model"), Some(E2E_MODEL));
    assert_eq!(route.attr("kvrouter.replica_id"), Some("r1"));
    for tier in ["device", "host", "disk", "shared"] {
        let key = format!("kvrouter.overlap_blocks.{tier}");
        assert_eq!(route.attr(&key), Some("0"), "{key}: nothing cached yet");
    }
    let cost: f64 = route.attr("kvrouter.cost").unwrap().parse().unwrap();
    let runner_up: f64 = route
        .attr("kvrouter.runner_up_cost")
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        runner_up >= cost,
        "two ranks: the other one is the runner-up ({cost} vs {runner_up})"
    );
    assert_eq!(request.attr("kvrouter.model"), Some(E2E_MODEL));
    assert_eq!(request.attr("kvrouter.endpoint"), Some("completions"));
    assert_eq!(request.status_code, 0);

    // The same prompt again, now without a traceparent: a new trace rooted at the frontend,
    // the prefix cached on the rank it chose.
    assert!(wait_until(Duration::from_secs(10), || metric_sum(
        a1,
        "kvrouter_kv_events_applied_total"
    ) >= 1.0));
    // Freed, so that the cached rank is not also the loaded one.
    assert!(wait_until(Duration::from_secs(10), || metric_sum(
        a1,
        "kvrouter_worker_active_requests"
    ) == 0.0));
    let (status, text) = http_post(port, "/v1/completions", &[], &body);
    assert_eq!(status, 200, "{text}");
    let spans = rx.wait_for(Duration::from_secs(10), |s| {
        s.iter()
            .any(|s| s.name == "kvrouter.frontend.request" && s.parent_span_id.is_none())
            && s.iter().filter(|s| s.name == "kvrouter.route").count() >= 2
    });
    let root = spans
        .iter()
        .find(|s| s.name == "kvrouter.frontend.request" && s.parent_span_id.is_none())
        .expect("a root request span");
    let second = spans
        .iter()
        .find(|s| s.name == "kvrouter.route" && s.trace_id == root.trace_id)
        .expect("the replica's span in the new trace");
    assert_ne!(root.trace_id, client_trace);
    assert_eq!(second.attr("kvrouter.dp_rank"), Some(rank), "cached there");
    assert_eq!(second.attr("kvrouter.overlap_blocks.device"), Some("2"));

    // A frontend that exports nothing passes the client's context on: the replica's span
    // hangs under the client's span directly, the engine gets the client's traceparent.
    let (_quiet, quiet_port) = frontend(&nats, dir.path(), &[]);
    let other_trace = "0af7651916cd43dd8448eb211c80319c";
    let tp2 = format!("00-{other_trace}-b7ad6b7169203331-01");
    let (status, text) = http_post(
        quiet_port,
        "/v1/completions",
        &[("traceparent", &tp2)],
        &body,
    );
    assert_eq!(status, 200, "{text}");
    let spans = rx.wait_for(Duration::from_secs(10), |s| {
        s.iter().any(|s| s.trace_id == other_trace)
    });
    let theirs: Vec<&ReceivedSpan> = spans.iter().filter(|s| s.trace_id == other_trace).collect();
    assert_eq!(theirs.len(), 1, "the replica's alone: {theirs:#?}");
    assert_eq!(theirs[0].name, "kvrouter.route");
    assert_eq!(
        theirs[0].parent_span_id.as_deref(),
        Some("b7ad6b7169203331")
    );
    let (_, seen) = http_get(engine.engine.http, "/kvrouter/test/traceparents");
    let seen: Vec<Value> = serde_json::from_str(&seen).unwrap();
    assert_eq!(seen.last().and_then(Value::as_str), Some(tp2.as_str()));

    // The replicas' JSON API takes a caller's traceparent too.
    let (t3, p3) = ("1bf92f3577b34da6a3ce929d0e0e4736", "c0f067aa0ba902b7");
    let route_body = format!(
        r#"{{"model":"{E2E_MODEL}","tokens":{}}}"#,
        serde_json::to_string(&prompt).unwrap()
    );
    let (status, text) = http_post(
        a1,
        "/v1/route",
        &[("traceparent", &format!("00-{t3}-{p3}-01"))],
        &route_body,
    );
    assert_eq!(status, 200, "{text}");
    let spans = rx.wait_for(Duration::from_secs(10), |s| {
        s.iter().any(|s| s.trace_id == t3)
    });
    let api = spans.iter().find(|s| s.trace_id == t3).unwrap();
    assert_eq!(
        (api.name.as_str(), api.parent_span_id.as_deref()),
        ("kvrouter.route", Some(p3))
    );
    assert_eq!(api.attr("kvrouter.overlap_blocks.device"), Some("2"));

    // The exporters count what the collector took.
    assert!(metric_sum(port, "kvrouter_frontend_otlp_spans_exported_total") >= 6.0);
    assert!(metric_sum(a1, "kvrouter_otlp_spans_exported_total") >= 3.0);
    assert_eq!(metric_sum(a1, "kvrouter_otlp_spans_dropped_total"), 0.0);
}

//! Engines whose KV events do not reach the router, while the router sends them requests:
//! one whose events go elsewhere from the start, one that stops publishing while it keeps
//! serving. Each rank is flagged on the replica (`/v1/workers`, metrics) after
//! `--events-silent-secs`, its booked routes then predict its cache (approximate mode for it
//! alone), and it is back to its own events once they flow again, without a restart.

use crate::common;
use crate::support::{emulated_engine, EmulatedEngine};
use common::*;
use serde_json::{json, Value};
use std::time::Duration;

/// A worker rank as the replica's `/v1/workers` shows it.
fn rank_of(admin: u16, worker: u64) -> Value {
    let (status, body) = http_get(admin, "/v1/workers");
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    v["models"][0]["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["worker_id"] == worker && r["dp_rank"] == 0)
        .cloned()
        .unwrap_or(Value::Null)
}

fn silent(admin: u16, worker: u64) -> Option<bool> {
    rank_of(admin, worker)["events_silent"].as_bool()
}

fn engine(nats: &NatsServer, bridge_args: &[&str]) -> (EmulatedEngine, Proc, u64) {
    let ports = free_ports(5);
    let e = emulated_engine("vllm", "array-batch", 1, ports, ports + 4);
    let (bridge, worker, _) = common::bridge_with(nats, &e.at(), bridge_args);
    (e, bridge, worker)
}

#[test]
fn a_rank_sent_requests_without_publishing_is_flagged_until_its_events_flow() {
    let nats = NatsServer::start();
    let admin = free_port();
    let _r1 = serve(&nats, "r1", admin, &["--events-silent-secs", "2"]);
    // Its bridge reads another topic than the engine publishes on: never heard from.
    let (_elsewhere, _b1, lost) = engine(&nats, &["--topic", "elsewhere"]);
    let (speaking, _b2, heard) = engine(&nats, &[]);
    let dir = model_dir();
    let model = format!("{E2E_MODEL}={}", dir.path().display());
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
            &model,
            "--grant-routing-extension",
        ],
    );
    let port: u16 = fe.first_json()["listen"]
        .as_str()
        .and_then(|a| a.rsplit(':').next()?.parse().ok())
        .expect("the frontend prints its address");
    assert!(ready(admin));
    assert!(wait_until(Duration::from_secs(10), || metric_sum(
        admin,
        "kvrouter_worker_ranks"
    ) >= 2.0));
    // Prompts of two blocks each, pinned to a worker: each is served by its engine.
    let send = |worker: u64, n: u32| {
        let prompt: Vec<u32> = (0..2 * E2E_BLOCK as u32).map(|t| n * 1000 + t).collect();
        let body = json!({
            "model": E2E_MODEL,
            "prompt": prompt,
            "max_tokens": 2,
            "kvrouter": {"pin": worker.to_string()},
        });
        let (status, text) = http_post(port, "/v1/completions", &[], &body.to_string());
        assert_eq!(status, 200, "{text}");
    };
    for n in 0..4 {
        send(lost, n);
        send(heard, 100 + n);
    }
    assert!(
        wait_until(Duration::from_secs(8), || silent(admin, lost) == Some(true)),
        "{}",
        rank_of(admin, lost)
    );
    assert_eq!(
        silent(admin, heard),
        Some(false),
        "{}",
        rank_of(admin, heard)
    );
    assert!(
        rank_of(admin, lost)["seconds_since_last_event"]
            .as_f64()
            .unwrap()
            >= 2.0
    );
    let at =
        |name: &str, worker: u64| metric_where(admin, name, &[("worker", &worker.to_string())]);
    assert_eq!(
        rank_of(admin, lost)["cached_blocks"],
        0,
        "its routes were not recorded while it was not flagged"
    );
    // Flagged, its booked routes predict its cache (approximate mode for it alone): the
    // blocks of the next one count as cached there.
    send(lost, 7);
    assert!(
        wait_until(Duration::from_secs(5), || rank_of(admin, lost)
            ["cached_blocks"]
            == 2),
        "{}",
        rank_of(admin, lost)
    );
    assert_eq!(at("kvrouter_worker_events_silent", lost), 1.0);
    assert_eq!(at("kvrouter_worker_events_silent", heard), 0.0);
    assert_eq!(at("kvrouter_worker_routes_total", lost), 5.0);
    assert_eq!(at("kvrouter_worker_kv_events_total", lost), 0.0);
    assert!(
        at("kvrouter_worker_kv_events_total", heard) >= 4.0,
        "{}",
        metrics(admin)
    );

    // The other engine stops publishing while it serves on: flagged too.
    let mute = |muted: bool| {
        let body = json!({"dp_rank": 0, "muted": muted}).to_string();
        let (status, text) = http_post(speaking.http, "/kvrouter/test/mute", &[], &body);
        assert_eq!(status, 200, "{text}");
    };
    mute(true);
    // One more than the watch needs: the last unmuted answer's events may land after the
    // first of these.
    for n in 0..5 {
        send(heard, 200 + n);
    }
    assert!(
        wait_until(Duration::from_secs(8), || silent(admin, heard)
            == Some(true)),
        "{}",
        rank_of(admin, heard)
    );
    // Its events flow again (the bridge replays what it missed): no longer silent, with no
    // restart.
    mute(false);
    send(heard, 300);
    assert!(
        wait_until(Duration::from_secs(8), || silent(admin, heard)
            == Some(false)),
        "{}",
        rank_of(admin, heard)
    );
    assert_eq!(at("kvrouter_worker_events_silent", heard), 0.0);
    assert_eq!(
        silent(admin, lost),
        Some(true),
        "still nothing from the other one"
    );
}

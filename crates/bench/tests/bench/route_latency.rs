//! The route latency bench against the in-process bus and a fake replica.

use bytes::Bytes;
use kvrouter_bench::route_latency::{run_route_latency, RouteLatencyConfig};
use kvrouter_bus::Bus;
use kvrouter_client::KvRouterClient;
use kvrouter_protocol::{decode, encode, Reply, RouteDecision, RouteRequest, Subjects, TierBlocks};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const NS: &str = "test-ns";
const MODEL: &str = "Qwen/Qwen3-0.6B";

/// A fake replica on the in-process bus: answers every route request with a decision for
/// worker 7 of replica r1; returns the requests it saw.
async fn fake_route_replica(bus: &Bus) -> Arc<Mutex<Vec<RouteRequest>>> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let subject = Subjects::new(NS).unwrap().route();
    let mut sub = bus
        .queue_subscribe(&subject, "kvrouter-replicas")
        .await
        .expect("subscribes");
    let decision = RouteDecision {
        tier_overlap_blocks: TierBlocks::default(),
        worker_id: 7,
        dp_rank: 1,
        overlap_blocks: 3,
        replica_id: "r1".to_string(),
        base_url: String::new(),
        block_size: 0,
        lease: kvrouter_protocol::Lease::NONE,
        fallbacks: Vec::new(),
    };
    let answer = Bytes::from(encode(&Reply::Ok(decision)).expect("encodes"));
    let (bus, seen2) = (bus.clone(), seen.clone());
    tokio::spawn(async move {
        while let Some(msg) = sub.next().await {
            seen2
                .lock()
                .unwrap()
                .push(decode(&msg.payload).expect("a RouteRequest"));
            if let Some(reply) = msg.reply {
                let _ = bus.publish(&reply, answer.clone()).await;
            }
        }
    });
    seen
}

/// The client the bench drives: routes time out after 500 ms.
fn route_client(bus: &Bus) -> KvRouterClient {
    KvRouterClient::new(bus.clone(), NS)
        .unwrap()
        .with_timeout(Duration::from_millis(500))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_latency_bench_sends_on_schedule() {
    let bus = Bus::local();
    let seen = fake_route_replica(&bus).await;
    let config = RouteLatencyConfig {
        warm_up: false, // the fake replica has no workers to generate on
        ..RouteLatencyConfig::new(MODEL, 400.0, 32, Duration::from_millis(500))
    };
    let report = run_route_latency(&route_client(&bus), &config)
        .await
        .unwrap();
    assert_eq!(report.sent, 200);
    assert_eq!(report.ok, 200, "{report:?}");
    assert!(report.errors.is_empty());
    assert_eq!(report.latency.count, 200);
    assert!(report.latency.p50_us <= report.latency.p99_us);
    assert!(report.latency.p99_us <= report.latency.max_us);
    assert!(report.send_rate > 200.0, "{report:?}");
    let reqs = seen.lock().unwrap().clone();
    assert!(reqs
        .iter()
        .all(|r| !r.update_states && r.tokens.len() == 32));

    // Without a replica, every request is counted as a no_router error.
    let bus = Bus::local();
    let config = RouteLatencyConfig {
        warm_up: false,
        ..RouteLatencyConfig::new(MODEL, 200.0, 8, Duration::from_millis(100))
    };
    let report = run_route_latency(&route_client(&bus), &config)
        .await
        .unwrap();
    assert_eq!(report.ok, 0);
    assert_eq!(report.errors.get("no_router"), Some(&report.sent));
}

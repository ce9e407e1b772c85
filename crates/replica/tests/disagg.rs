//! Disaggregated prefill and decode on the in-process bus: a prefill pool (dp 2 from rank 2,
//! tp 2), a decode pool (dp 4, tp 2) and one aggregated worker, a replica and a client.

use bytes::Bytes;
use kvrouter_bus::Bus;
use kvrouter_client::{ClientError, GenerateParams, KvRouterClient};
use kvrouter_mocker::{EngineConfig, FleetConfig, MockerFleet};
use kvrouter_protocol::{
    encode, prefill_request_id, DisaggRouteRequest, ErrorKind, GenerateRequest, RouteRequest,
    Subjects, WorkerRole,
};
use kvrouter_replica::{Replica, ReplicaConfig};
use std::time::Duration;

const MODEL: &str = "m";

fn pool(role: WorkerRole, first_id: u64, dp_size: u32, dp_start_rank: u32) -> FleetConfig {
    FleetConfig {
        model: MODEL.into(),
        workers: 2,
        worker_id_start: first_id,
        dp_size,
        dp_start_rank,
        tp_size: 2,
        role,
        engine: EngineConfig {
            block_size: 16,
            capacity_blocks: 512,
            ..EngineConfig::default()
        },
        speedup: 1000.0,
        heartbeat_interval: Duration::from_millis(200),
        ..FleetConfig::default()
    }
}

fn prompt(seed: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * 16).map(|t| seed * 100_000 + t).collect()
}

fn disagg_request(tokens: Vec<u32>, update_states: bool) -> DisaggRouteRequest {
    DisaggRouteRequest {
        model: MODEL.into(),
        request_id: kvrouter_client::new_request_id(),
        tokens,
        lora: None,
        allowed_workers: None,
        update_states,
    }
}

fn kind<T>(r: Result<T, ClientError>) -> Option<ErrorKind> {
    match r {
        Err(ClientError::Router(e)) => Some(e.kind),
        _ => None,
    }
}

/// The decode rank the offset rule gives: prefill ranks 2..4, decode ranks 0..4.
fn expected_decode_rank(prefill_rank: u32) -> u32 {
    (prefill_rank - 2) % 4
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_by_overlap_decode_on_the_matching_rank_and_transfers_release_the_prefill() {
    let bus = Bus::local();
    let prefill = MockerFleet::start(bus.clone(), pool(WorkerRole::Prefill, 100, 2, 2))
        .await
        .unwrap();
    let decode = MockerFleet::start(bus.clone(), pool(WorkerRole::Decode, 200, 4, 0))
        .await
        .unwrap();
    let aggregated = MockerFleet::start(
        bus.clone(),
        FleetConfig {
            workers: 1,
            dp_size: 1,
            tp_size: 1,
            ..pool(WorkerRole::Aggregated, 300, 1, 0)
        },
    )
    .await
    .unwrap();
    let replica = Replica::start(
        ReplicaConfig {
            models: vec![MODEL.into()],
            discovery_window: Duration::from_millis(100),
            ..ReplicaConfig::default()
        },
        bus.clone(),
    )
    .await
    .unwrap();
    assert!(replica.wait_ready(Duration::from_secs(5)).await);
    let client = KvRouterClient::new(bus.clone(), "kvrouter").unwrap();

    // Fresh prompts: both keys named, each in its pool, the decode rank by the offset rule.
    for i in 0..20 {
        let d = client
            .route_disagg(&disagg_request(prompt(i, 4), false))
            .await
            .unwrap();
        assert!((100..102).contains(&d.prefill.worker_id), "{d:?}");
        assert!((2..4).contains(&d.prefill.dp_rank), "{d:?}");
        assert!((200..202).contains(&d.decode.worker_id), "{d:?}");
        assert_eq!(d.decode.dp_rank, expected_decode_rank(d.prefill.dp_rank));
        assert_eq!(d.replica_id, replica.replica_id());
    }
    // Aggregated routes use the aggregated worker only (the model has one).
    for i in 0..10 {
        let mut req = kvrouter_client::route_request(MODEL, prompt(50 + i, 2));
        req.update_states = false;
        assert_eq!(client.route(&req).await.unwrap().worker_id, 300);
    }

    // A generated prompt: prefilled on one prefill rank, decoded on its matching rank.
    let tokens = prompt(7, 8);
    let out = client
        .generate_disagg(&GenerateParams::new(MODEL, tokens.clone(), 4))
        .await
        .unwrap();
    assert!(
        out.bookkeeping_errors.is_empty(),
        "{:?}",
        out.bookkeeping_errors
    );
    assert_eq!(
        out.prefill.output_tokens, 0,
        "a prefill worker only prefills"
    );
    assert_eq!(out.decode.output_tokens, 4);
    let first = out.decision.prefill.key();
    assert_eq!(
        out.decision.decode.dp_rank,
        expected_decode_rank(first.dp_rank)
    );

    // The repeated prompt goes back to the prefill rank holding it, with full overlap.
    let found = async {
        loop {
            let d = client
                .route_disagg(&disagg_request(tokens.clone(), false))
                .await
                .unwrap();
            if d.prefill.overlap_blocks == 8 {
                return d;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let d = tokio::time::timeout(Duration::from_secs(3), found)
        .await
        .expect("the prefill rank's KV events reach the replica");
    assert_eq!(d.prefill.key(), first);
    assert_eq!(d.decode.dp_rank, expected_decode_rank(first.dp_rank));

    // Allowed workers narrow both pools.
    let mut narrowed = disagg_request(prompt(8, 2), false);
    narrowed.allowed_workers = Some(vec![101, 201]);
    for _ in 0..10 {
        let d = client.route_disagg(&narrowed).await.unwrap();
        assert_eq!((d.prefill.worker_id, d.decode.worker_id), (101, 201));
        assert_eq!(d.decode.dp_rank, expected_decode_rank(d.prefill.dp_rank));
    }
    narrowed.allowed_workers = Some(vec![101, 300]);
    assert_eq!(
        kind(client.route_disagg(&narrowed).await),
        Some(ErrorKind::NoWorkers),
        "no decode worker allowed"
    );

    // Transfer tracking: the prefill half stays active until every prefill tp rank has
    // reported the KV sent (the mocker's prefill workers report after their prefill).
    let req = disagg_request(prompt(9, 4), true);
    let d = client.route_disagg(&req).await.unwrap();
    let prefill_id = prefill_request_id(&req.request_id);
    client
        .mark_prefill(&d.replica_id, MODEL, &prefill_id)
        .await
        .expect("the prefill half is tracked");
    let generate = Subjects::new("kvrouter")
        .unwrap()
        .model(MODEL)
        .unwrap()
        .generate(d.prefill.worker_id);
    let run = GenerateRequest {
        request_id: req.request_id.clone(),
        tokens: req.tokens.clone(),
        max_tokens: 8,
        dp_rank: d.prefill.dp_rank,
    };
    let mut stream = bus
        .request_stream(
            &generate,
            Bytes::from(encode(&run).unwrap()),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    while let Some(ev) = stream.next().await {
        ev.unwrap();
    }
    let released = async {
        loop {
            let r = client.mark_prefill(&d.replica_id, MODEL, &prefill_id).await;
            if kind(r) == Some(ErrorKind::UnknownRequest) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(3), released)
        .await
        .expect("the prefill half is released once both tp ranks reported");
    // The decode half is the client's to free.
    client
        .free(&d.replica_id, MODEL, &req.request_id)
        .await
        .unwrap();

    replica.shutdown().await;
    for f in [prefill, decode, aggregated] {
        f.shutdown().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_without_pools_refuses_disagg_and_routes_aggregated_over_all() {
    let bus = Bus::local();
    let prefill = MockerFleet::start(bus.clone(), pool(WorkerRole::Prefill, 100, 2, 2))
        .await
        .unwrap();
    let replica = Replica::start(
        ReplicaConfig {
            models: vec![MODEL.into()],
            discovery_window: Duration::from_millis(100),
            ..ReplicaConfig::default()
        },
        bus.clone(),
    )
    .await
    .unwrap();
    assert!(replica.wait_ready(Duration::from_secs(5)).await);
    let client = KvRouterClient::new(bus.clone(), "kvrouter").unwrap();
    assert_eq!(
        kind(
            client
                .route_disagg(&disagg_request(prompt(1, 2), false))
                .await
        ),
        Some(ErrorKind::NoWorkers),
        "no decode pool"
    );
    // No aggregated worker: a plain route uses the workers there are.
    let req = RouteRequest {
        update_states: false,
        ..kvrouter_client::route_request(MODEL, prompt(1, 2))
    };
    assert!((100..102).contains(&client.route(&req).await.unwrap().worker_id));
    replica.shutdown().await;
    prefill.shutdown().await.unwrap();
}

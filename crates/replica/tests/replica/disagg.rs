//! Disaggregated prefill and decode on the in-process bus: a prefill pool (dp 2 from rank 2,
//! tp 2), a decode pool (dp 4, tp 2) and one aggregated worker, a replica and a client.

use crate::support::{fleet_config, prompt, replica_config, MODEL};
use bytes::Bytes;
use kvrouter_bus::Bus;
use kvrouter_client::{Booking, ClientError, GenerateParams, KvRouterClient};
use kvrouter_mocker::{FleetConfig, MockerFleet};
use kvrouter_protocol::{
    encode, prefill_request_id, DisaggRouteRequest, ErrorKind, GenerateRequest, Lease,
    RouteRequest, Subjects, WorkerRole,
};
use kvrouter_replica::{Replica, ReplicaConfig};
use std::time::Duration;

/// Two workers of `role` from `first_id`, `dp_size` ranks from `dp_start_rank`, tp 2.
fn pool_config(role: WorkerRole, first_id: u64, dp_size: u32, dp_start_rank: u32) -> FleetConfig {
    FleetConfig {
        worker_id_start: first_id,
        dp_start_rank,
        tp_size: 2,
        role,
        ..fleet_config(2, dp_size, 512)
    }
}

/// The lease of every disaggregated booking here.
const LEASE: Lease = Lease::from_bits(0x5eed);

/// What a caller holds of half `request_id` of a booking [`disagg_request`] made.
fn held(replica_id: &str, request_id: &str) -> Booking {
    Booking {
        replica_id: replica_id.into(),
        model: MODEL.into(),
        request_id: request_id.into(),
        lease: LEASE,
    }
}

fn disagg_request(tokens: Vec<u32>, update_states: bool) -> DisaggRouteRequest {
    DisaggRouteRequest {
        model: MODEL.into(),
        request_id: kvrouter_client::new_request_id(),
        tokens,
        lora: None,
        allowed_workers: None,
        update_states,
        lease: LEASE,
        trace: None,
    }
}

fn kind<T>(r: Result<T, ClientError>) -> Option<ErrorKind> {
    match r {
        Err(ClientError::Router(e)) => Some(e.kind),
        _ => None,
    }
}

/// Starts a replica and waits until it is ready.
async fn ready_replica(bus: &Bus, config: ReplicaConfig) -> Replica {
    let replica = Replica::start(config, bus.clone()).await.unwrap();
    assert!(replica.wait_ready(Duration::from_secs(5)).await);
    replica
}

/// The decode rank the offset rule gives: prefill ranks 2..4, decode ranks 0..4.
fn expected_decode_rank(prefill_rank: u32) -> u32 {
    (prefill_rank - 2) % 4
}

#[tokio::test(start_paused = true)]
async fn prefill_by_overlap_decode_on_the_matching_rank_and_transfers_release_the_prefill() {
    let bus = Bus::local();
    let prefill = MockerFleet::start(bus.clone(), pool_config(WorkerRole::Prefill, 100, 2, 2))
        .await
        .unwrap();
    let decode = MockerFleet::start(bus.clone(), pool_config(WorkerRole::Decode, 200, 4, 0))
        .await
        .unwrap();
    let aggregated = MockerFleet::start(
        bus.clone(),
        FleetConfig {
            workers: 1,
            dp_size: 1,
            tp_size: 1,
            ..pool_config(WorkerRole::Aggregated, 300, 1, 0)
        },
    )
    .await
    .unwrap();
    let replica = ready_replica(&bus, replica_config()).await;
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
        .mark_prefill(&held(&d.replica_id, &prefill_id))
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
            let r = client.mark_prefill(&held(&d.replica_id, &prefill_id)).await;
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
        .free(&held(&d.replica_id, &req.request_id))
        .await
        .unwrap();

    replica.shutdown().await;
    for f in [prefill, decode, aggregated] {
        f.shutdown().await.unwrap();
    }
}

#[tokio::test(start_paused = true)]
async fn a_model_without_pools_refuses_disagg_and_routes_aggregated_over_all() {
    let bus = Bus::local();
    let prefill = MockerFleet::start(bus.clone(), pool_config(WorkerRole::Prefill, 100, 2, 2))
        .await
        .unwrap();
    let replica = ready_replica(&bus, replica_config()).await;
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
    let req = RouteRequest::new(MODEL, prompt(1, 2));
    assert!((100..102).contains(&client.route(&req).await.unwrap().worker_id));
    replica.shutdown().await;
    prefill.shutdown().await.unwrap();
}

/// One worker of `role` (tp 2, one rank), optionally with a silenced tp rank.
fn one(role: WorkerRole, id: u64, silence_tp_rank: Option<u32>) -> FleetConfig {
    FleetConfig {
        workers: 1,
        silence_tp_rank,
        ..pool_config(role, id, 1, 0)
    }
}

/// Prefill workers 100 (its tp rank 1 never reports its KV sent) and 110, decode worker 200.
async fn tp_pools(bus: &Bus) -> (MockerFleet, MockerFleet, MockerFleet) {
    let start = |config| MockerFleet::start(bus.clone(), config);
    (
        start(one(WorkerRole::Prefill, 100, Some(1))).await.unwrap(),
        start(one(WorkerRole::Prefill, 110, None)).await.unwrap(),
        start(one(WorkerRole::Decode, 200, None)).await.unwrap(),
    )
}

/// (prefill blocks, decode blocks) that a fresh one-block prompt would see on `worker`'s
/// rank 0: the load the replica counts there, plus the prompt's own block.
async fn load_on(client: &KvRouterClient, worker: u64, seed: u32) -> (f64, u64) {
    let req = kvrouter_protocol::OverlapRequest {
        model: MODEL.into(),
        tokens: prompt(seed, 1),
        lora: None,
    };
    let loads = client.potential_loads(&req).await.unwrap();
    let l = loads
        .iter()
        .find(|l| l.key == kvrouter_protocol::WorkerKey::new(worker, 0))
        .expect("the worker rank is known");
    (l.prefill_blocks, l.decode_blocks)
}

/// Runs a request on a worker rank to its end (a stream that ends without `Done` fails).
async fn run_on(bus: &Bus, worker: u64, request_id: &str, tokens: Vec<u32>) {
    let subject = Subjects::new("kvrouter")
        .unwrap()
        .model(MODEL)
        .unwrap()
        .generate(worker);
    let run = GenerateRequest {
        request_id: request_id.into(),
        tokens,
        max_tokens: 2,
        dp_rank: 0,
    };
    let mut stream = bus
        .request_stream(
            &subject,
            Bytes::from(encode(&run).unwrap()),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    let mut done = false;
    while let Some(ev) = stream.next().await {
        let ev: kvrouter_protocol::GenerateEvent = kvrouter_protocol::decode(&ev.unwrap()).unwrap();
        assert!(
            !matches!(ev, kvrouter_protocol::GenerateEvent::Error(_)),
            "{ev:?}"
        );
        done |= matches!(ev, kvrouter_protocol::GenerateEvent::Done { .. });
    }
    assert!(done, "{request_id} on worker {worker} ran to its end");
}

// Real clock: the replica finds transfers overdue by std `Instant`, which a paused clock
// does not move.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prefill_load_stays_until_every_prefill_tp_rank_sent_and_a_missing_one_is_overdue() {
    let bus = Bus::local();
    let (silenced, healthy, decode) = tp_pools(&bus).await;
    let timeout = Duration::from_millis(400);
    let replica = ready_replica(
        &bus,
        ReplicaConfig {
            transfer_timeout: timeout,
            // The scheduler counts prefill tokens in blocks of this size.
            block_sizes: [(MODEL.to_string(), 16)].into(),
            ..replica_config()
        },
    )
    .await;
    let client = KvRouterClient::new(bus.clone(), "kvrouter").unwrap();
    let overdue = || {
        replica
            .shared()
            .metrics
            .transfers_overdue
            .get_or_create(&kvrouter_replica::metrics::Metrics::model(MODEL))
            .get()
    };

    // One disaggregated request through `prefill` and worker 200; returns its id once both
    // stages ran (so every decode tp rank has received).
    let run = |prefill: u64, seed: u32| {
        let (client, bus) = (&client, &bus);
        async move {
            let mut req = disagg_request(prompt(seed, 4), true);
            req.allowed_workers = Some(vec![prefill, 200]);
            let d = client.route_disagg(&req).await.unwrap();
            assert_eq!((d.prefill.worker_id, d.decode.worker_id), (prefill, 200));
            run_on(bus, prefill, &req.request_id, req.tokens.clone()).await;
            run_on(bus, 200, &req.request_id, req.tokens.clone()).await;
            req.request_id
        }
    };

    // Silenced: the prefill half keeps its prefill load (4 blocks of prompt) and its blocks.
    let base = load_on(&client, 100, 90).await;
    let started = tokio::time::Instant::now();
    let id = run(100, 1).await;
    let kept = (base.0 + 4.0, base.1 + 4);
    assert_eq!(load_on(&client, 100, 90).await, kept);
    assert_eq!(overdue(), 0, "not overdue before the timeout");
    let reported = async {
        while overdue() == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(3), reported)
        .await
        .expect("the missing Sent report is counted overdue");
    assert!(started.elapsed() >= timeout);
    // Reported once (the decode side is complete), and the load is still held.
    tokio::time::sleep(timeout).await;
    assert_eq!(overdue(), 1, "only the Sent side, only once");
    assert_eq!(load_on(&client, 100, 90).await, kept);
    let prefill_id = prefill_request_id(&id);
    client
        .mark_prefill(&held(replica.replica_id(), &prefill_id))
        .await
        .expect("the prefill half is still tracked");

    // Not silenced: once both prefill tp ranks reported, the prefill half is released.
    let base = load_on(&client, 110, 91).await;
    let id2 = run(110, 2).await;
    let released = async {
        while load_on(&client, 110, 91).await != base {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(3), released)
        .await
        .expect("the prefill load is released on all-sent");
    assert_eq!(
        kind(
            client
                .mark_prefill(&held(replica.replica_id(), &prefill_request_id(&id2)))
                .await
        ),
        Some(ErrorKind::UnknownRequest)
    );
    tokio::time::sleep(timeout * 2).await;
    assert_eq!(overdue(), 1, "a complete transfer is never overdue");

    for half in [prefill_id, id, id2] {
        let _ = client.free(&held(replica.replica_id(), &half)).await;
    }
    replica.shutdown().await;
    for f in [silenced, healthy, decode] {
        f.shutdown().await.unwrap();
    }
}

#[tokio::test(start_paused = true)]
async fn with_two_replicas_reports_count_by_reason_and_a_departed_worker_is_not_overdue() {
    let bus = Bus::local();
    let (silenced, healthy, decode) = tp_pools(&bus).await;
    let timeout = Duration::from_millis(600);
    let mut replicas = Vec::new();
    for id in ["ra", "rb"] {
        let r = ready_replica(
            &bus,
            ReplicaConfig {
                replica_id: Some(id.into()),
                transfer_timeout: timeout,
                ..replica_config()
            },
        )
        .await;
        replicas.push(r);
    }
    let client = KvRouterClient::new(bus.clone(), "kvrouter").unwrap();
    let metrics = |r: &Replica| {
        let m = &r.shared().metrics;
        let dropped = |reason| {
            m.transfer_reports_dropped
                .get_or_create(&kvrouter_replica::metrics::ReasonLabels::new(MODEL, reason))
                .get()
        };
        let model = kvrouter_replica::metrics::Metrics::model(MODEL);
        (
            dropped("not_pending"),
            dropped("wrong_rank") + dropped("duplicate"),
            m.transfers_overdue.get_or_create(&model).get(),
            m.transfers_pending.get_or_create(&model).get(),
        )
    };
    let by_id = |id: &str| {
        replicas
            .iter()
            .find(|r| r.replica_id() == id)
            .expect("a decision names one of the replicas")
    };

    // A complete transfer: 2 Sent and 2 Received reports (tp 2 on each side). Every replica
    // hears them; only the one that routed it tracks it, the other counts them as not routed
    // there, and nothing is a wrong rank or a duplicate.
    let mut req = disagg_request(prompt(1, 4), true);
    req.allowed_workers = Some(vec![110, 200]);
    let d = client.route_disagg(&req).await.unwrap();
    let first = (d.replica_id.clone(), req.request_id.clone());
    run_on(&bus, 110, &req.request_id, req.tokens.clone()).await;
    run_on(&bus, 200, &req.request_id, req.tokens.clone()).await;
    let (router, other) = (
        by_id(&d.replica_id),
        by_id(if d.replica_id == "ra" { "rb" } else { "ra" }),
    );
    let settled = async {
        while metrics(other).0 < 4 || metrics(router).3 != 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(3), settled)
        .await
        .expect("the reports reach both replicas");
    assert_eq!(
        metrics(router),
        (0, 0, 0, 0),
        "the router tracked and completed it"
    );
    assert_eq!(metrics(other), (4, 0, 0, 0));

    // A transfer whose prefill worker leaves before its missing tp rank could report is
    // abandoned, not reported overdue.
    let mut req = disagg_request(prompt(2, 4), true);
    req.allowed_workers = Some(vec![100, 200]);
    let d = client.route_disagg(&req).await.unwrap();
    let router = by_id(&d.replica_id);
    run_on(&bus, 100, &req.request_id, req.tokens.clone()).await;
    run_on(&bus, 200, &req.request_id, req.tokens.clone()).await;
    assert_eq!(metrics(router).3, 1, "waiting for tp rank 1's Sent report");
    silenced.shutdown().await.unwrap();
    let forgotten = async {
        while metrics(router).3 != 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(3), forgotten)
        .await
        .expect("the departed worker's transfer is forgotten");
    tokio::time::sleep(timeout * 2).await;
    assert_eq!(metrics(router).2, 0, "never reported overdue");

    // The decode halves are the client's to free; the departed worker's prefill half went
    // with the worker.
    for (replica, id) in [first, (d.replica_id.clone(), req.request_id.clone())] {
        client.free(&held(&replica, &id)).await.unwrap();
    }

    for r in replicas {
        r.shutdown().await;
    }
    for f in [healthy, decode] {
        f.shutdown().await.unwrap();
    }
}

/// A prefill pool wider than the decode pool: the rank offset wraps modulo the decode
/// worker's dp_size, onto its own start rank (prefill ranks 0..4, decode ranks 6..8).
#[tokio::test(start_paused = true)]
async fn the_rank_offset_wraps_onto_a_narrower_decode_pool() {
    let bus = Bus::local();
    let prefill = MockerFleet::start(bus.clone(), pool_config(WorkerRole::Prefill, 100, 4, 0))
        .await
        .unwrap();
    let decode = MockerFleet::start(bus.clone(), pool_config(WorkerRole::Decode, 200, 2, 6))
        .await
        .unwrap();
    let replica = ready_replica(&bus, replica_config()).await;
    let client = KvRouterClient::new(bus.clone(), "kvrouter").unwrap();
    let mut prefill_ranks = std::collections::BTreeSet::new();
    for i in 0..40 {
        let d = client
            .route_disagg(&disagg_request(prompt(i, 4), false))
            .await
            .unwrap();
        assert_eq!(d.decode.dp_rank, 6 + d.prefill.dp_rank % 2, "{d:?}");
        prefill_ranks.insert(d.prefill.dp_rank);
    }
    assert!(
        prefill_ranks.iter().any(|&r| r >= 2),
        "offsets past the decode pool's width were exercised: {prefill_ranks:?}"
    );
    replica.shutdown().await;
    prefill.shutdown().await.unwrap();
    decode.shutdown().await.unwrap();
}

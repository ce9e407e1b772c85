//! A replica and a mocker fleet on the in-process bus: state sync under live traffic, and the
//! busy queue.

use crate::support::{fleet_config, replica_config, MODEL};
use bytes::Bytes;
use kvrouter_bus::Bus;
use kvrouter_client::{Booking, ClientError, GenerateParams, KvRouterClient};
use kvrouter_mocker::{FleetConfig, MockerFleet};
use kvrouter_protocol::{
    decode, encode, hashing::stored_sequence_hashes, Abandon, ErrorKind, KvEvent, Lease, Reply,
    RouteRequest, SeqChange, SequenceHash, StateChunk, StateQuery, Subjects, SyncBatch, WorkerKey,
};
use kvrouter_replica::{Replica, ReplicaConfig, SyncConfig};
use kvrouter_scheduler::SchedulerConfig;
use std::collections::BTreeSet;
use std::time::Duration;

fn prefixes(events: &[KvEvent]) -> BTreeSet<SequenceHash> {
    stored_sequence_hashes(events).into_iter().collect()
}

async fn worker_state(bus: &Bus, key: WorkerKey) -> Vec<KvEvent> {
    let subject = Subjects::new("kvrouter")
        .unwrap()
        .model(MODEL)
        .unwrap()
        .state(key.worker_id);
    let query = encode(&StateQuery {
        dp_rank: key.dp_rank,
    })
    .unwrap();
    let mut stream = bus
        .request_stream(&subject, Bytes::from(query), Duration::from_secs(5))
        .await
        .unwrap();
    let mut events = Vec::new();
    while let Some(chunk) = stream.next().await {
        let chunk: StateChunk = decode::<Reply<StateChunk>>(&chunk.unwrap())
            .unwrap()
            .into_result()
            .unwrap();
        events.extend(chunk.events);
    }
    events
}

/// `blocks` blocks of 16 tokens: the first half shared by every prompt of `prefix`, the rest
/// unique to `suffix`.
fn shared_prefix_prompt(prefix: u32, suffix: u32, blocks: u32) -> Vec<u32> {
    let shared = (0..blocks / 2).map(|i| prefix * 1000 + i);
    let own = (0..blocks - blocks / 2).map(|i| 1_000_000 + suffix * 1000 + i);
    shared
        .chain(own)
        .flat_map(|b| (0..16).map(move |t| b * 16 + t))
        .collect()
}

#[tokio::test(start_paused = true)]
async fn replicas_match_worker_caches_after_syncing_under_traffic_and_loss() {
    let bus = Bus::local();
    // Small caches, so evictions (Removed events) are part of the stream.
    let fleet = MockerFleet::start(bus.clone(), fleet_config(3, 2, 48))
        .await
        .unwrap();
    let early = Replica::start(replica_config(), bus.clone()).await.unwrap();
    assert!(early.wait_ready(Duration::from_secs(5)).await);
    let client = KvRouterClient::new(bus.clone(), "kvrouter").unwrap();

    let traffic = {
        let client = client.clone();
        tokio::spawn(async move {
            let mut tasks = Vec::new();
            for i in 0..240u32 {
                let client = client.clone();
                tasks.push(tokio::spawn(async move {
                    let p = GenerateParams::new(MODEL, shared_prefix_prompt(i % 7, i, 6), 2);
                    client.generate(&p).await.map(|_| ())
                }));
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            for t in tasks {
                t.await.unwrap().unwrap();
            }
        })
    };
    // Mid-traffic: one worker loses two event batches, and a second replica starts.
    tokio::time::sleep(Duration::from_millis(150)).await;
    let drop = Subjects::new("kvrouter")
        .unwrap()
        .model(MODEL)
        .unwrap()
        .drop_events(11);
    bus.request(
        &drop,
        Bytes::from(encode(&2u64).unwrap()),
        Duration::from_secs(2),
    )
    .await
    .unwrap();
    let late = Replica::start(replica_config(), bus.clone()).await.unwrap();
    traffic.await.unwrap();
    assert!(late.wait_ready(Duration::from_secs(5)).await);
    // Requests on every rank after the loss, so the gap shows by the next event id (or, if
    // routing left worker 11 idle and the dropped batches are these requests' own, by the
    // worker's event marks a second or two later; rounds go on until the gap shows).
    let no_gap_seen = |r: &Replica| {
        r.shared()
            .metrics
            .render()
            .contains("kvrouter_kv_event_gaps_total{model=\"m\"} 0\n")
    };
    for round in 0..20u32 {
        for w in 10..13u64 {
            for r in 0..2u32 {
                let suffix = round * 100 + (w * 2) as u32 + r;
                let mut p = GenerateParams::new(MODEL, shared_prefix_prompt(99, suffix, 4), 1);
                p.pin = Some(kvrouter_protocol::Pin {
                    worker_id: w,
                    dp_rank: Some(r),
                });
                client.generate(&p).await.unwrap();
            }
        }
        // Longer than the fleet's 5 ms event batching, so rounds are separate batches.
        tokio::time::sleep(Duration::from_millis(50)).await;
        if !no_gap_seen(&early) {
            break;
        }
    }
    let keys: Vec<WorkerKey> = (10..13u64)
        .flat_map(|w| (0..2).map(move |r| WorkerKey::new(w, r)))
        .collect();
    let mut last_diff = String::new();
    let mut equal = false;
    // Up to 15 s: a state fetch that timed out under load is retried after 0.5, 1, 2, 4 s.
    for _ in 0..300 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        last_diff.clear();
        for &key in &keys {
            let truth = prefixes(&worker_state(&bus, key).await);
            assert!(!truth.is_empty(), "rank {key} caches something");
            for (name, r) in [("early", &early), ("late", &late)] {
                let dump = r.dump_rank(MODEL, key).await;
                let seen = dump.map(|d| prefixes(&d.events)).unwrap_or_default();
                if seen != truth {
                    last_diff += &format!(
                        "{name} replica, rank {key}: {} blocks vs the worker's {}; ",
                        seen.len(),
                        truth.len()
                    );
                }
            }
        }
        if last_diff.is_empty() {
            equal = true;
            break;
        }
    }
    assert!(equal, "index differs from the worker caches: {last_diff}");
    assert!(!no_gap_seen(&early), "the early replica saw the loss");
    early.shutdown().await;
    late.shutdown().await;
    fleet.shutdown().await.unwrap();
}

// Real clock: `wait_ready` has a std `Instant` deadline; on a paused clock its 20 ms sleeps
// jump ahead and the 60 s wait for a second worker ends within its 600 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_initial_workers_holds_routes_until_enough_workers_are_known() {
    let bus = Bus::local();
    let first = MockerFleet::start(bus.clone(), fleet_config(1, 1, 64))
        .await
        .unwrap();
    let config = ReplicaConfig {
        min_initial_workers: 2,
        min_initial_workers_timeout: Duration::from_secs(60),
        ..replica_config()
    };
    let replica = Replica::start(config, bus.clone()).await.unwrap();
    // Past the discovery window with one worker synced: still not taking routes.
    assert!(!replica.wait_ready(Duration::from_millis(600)).await);
    let (ready, why) = replica.shared().readiness();
    assert!(!ready && why.contains("1 of 2 workers known"), "{why}");
    let client = KvRouterClient::new(bus.clone(), "kvrouter")
        .unwrap()
        .with_retries(0);
    let req = kvrouter_client::route_request(MODEL, shared_prefix_prompt(1, 1, 2));
    let err = client.route(&req).await.unwrap_err();
    assert!(matches!(err, ClientError::NoRouter { .. }), "{err:?}");
    let second = MockerFleet::start(
        bus.clone(),
        FleetConfig {
            worker_id_start: 20,
            ..fleet_config(1, 1, 64)
        },
    )
    .await
    .unwrap();
    assert!(replica.wait_ready(Duration::from_secs(5)).await);
    client.route(&req).await.unwrap();
    replica.shutdown().await;
    first.shutdown().await.unwrap();
    second.shutdown().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn min_initial_workers_gives_up_waiting_after_its_timeout() {
    let bus = Bus::local();
    let fleet = MockerFleet::start(bus.clone(), fleet_config(1, 1, 64))
        .await
        .unwrap();
    let config = ReplicaConfig {
        min_initial_workers: 3,
        min_initial_workers_timeout: Duration::from_millis(800),
        ..replica_config()
    };
    let replica = Replica::start(config, bus.clone()).await.unwrap();
    assert!(replica.wait_ready(Duration::from_secs(10)).await);
    let client = KvRouterClient::new(bus.clone(), "kvrouter").unwrap();
    let req = kvrouter_client::route_request(MODEL, shared_prefix_prompt(1, 1, 2));
    assert_eq!(client.route(&req).await.unwrap().worker_id, 10);
    replica.shutdown().await;
    fleet.shutdown().await.unwrap();
}

// A worker's last batch before it goes quiet is lost: no later event id shows the gap, the
// worker's event marks do.
#[tokio::test(start_paused = true)]
async fn a_lost_last_batch_is_found_by_the_workers_marks() {
    let bus = Bus::local();
    let fleet = MockerFleet::start(bus.clone(), fleet_config(1, 1, 64))
        .await
        .unwrap();
    let replica = Replica::start(replica_config(), bus.clone()).await.unwrap();
    assert!(replica.wait_ready(Duration::from_secs(5)).await);
    let client = KvRouterClient::new(bus.clone(), "kvrouter").unwrap();
    let key = WorkerKey::new(10, 0);
    let index_matches = || async {
        let truth = prefixes(&worker_state(&bus, key).await);
        let dump = replica.dump_rank(MODEL, key).await;
        (
            dump.map(|d| prefixes(&d.events)).unwrap_or_default() == truth,
            truth.len(),
        )
    };
    client
        .generate(&GenerateParams::new(
            MODEL,
            shared_prefix_prompt(1, 1, 4),
            1,
        ))
        .await
        .unwrap();
    let drop = Subjects::new("kvrouter")
        .unwrap()
        .model(MODEL)
        .unwrap()
        .drop_events(10);
    let ack = bus
        .request(
            &drop,
            Bytes::from(encode(&1u64).unwrap()),
            Duration::from_secs(2),
        )
        .await
        .unwrap();
    assert!(decode::<Reply<()>>(&ack.payload)
        .unwrap()
        .into_result()
        .is_ok());
    // The last request: its batch is dropped, and nothing follows it.
    client
        .generate(&GenerateParams::new(
            MODEL,
            shared_prefix_prompt(2, 2, 4),
            1,
        ))
        .await
        .unwrap();
    let mut last = (false, 0);
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        last = index_matches().await;
        if last.0 && last.1 == 8 {
            break;
        }
    }
    assert_eq!(
        last,
        (true, 8),
        "the index never caught up with the worker's 8 blocks"
    );
    let metrics = replica.shared().metrics.render();
    assert!(
        !metrics.contains("kvrouter_kv_event_gaps_total{model=\"m\"} 0\n"),
        "the loss was counted: {metrics}"
    );
    replica.shutdown().await;
    fleet.shutdown().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn busy_workers_queue_requests_until_load_drops_then_overload() {
    let bus = Bus::local();
    let fleet = MockerFleet::start(bus.clone(), fleet_config(1, 1, 256))
        .await
        .unwrap();
    // Any prefill in flight makes the only worker busy; one request may wait. No
    // predicted blocks, so the potential loads below are the plain formula's.
    let replica = Replica::start(
        ReplicaConfig {
            scheduler: SchedulerConfig {
                active_prefix_credit: 0.0,
                busy_prefill_tokens: Some(1),
                max_queued_requests: 1,
                queue_timeout: Duration::from_millis(600),
                ..SchedulerConfig::default()
            },
            ..replica_config()
        },
        bus.clone(),
    )
    .await
    .unwrap();
    assert!(replica.wait_ready(Duration::from_secs(5)).await);
    let client = KvRouterClient::new(bus.clone(), "kvrouter").unwrap();
    let req = |id: &str| RouteRequest::new(MODEL, shared_prefix_prompt(1, 1, 4)).booked(id);
    // potential_loads answers for every rank, before and after a request is tracked.
    let overlap = kvrouter_protocol::OverlapRequest {
        model: MODEL.into(),
        tokens: shared_prefix_prompt(1, 1, 4),
        lora: None,
    };
    let before = client.potential_loads(&overlap).await.unwrap();
    assert_eq!(before.len(), 1);
    assert_eq!(before[0].decode_blocks, 4);
    assert_eq!(
        before[0].prefill_blocks, 4.0,
        "64 tokens in blocks of the workers' size (16, learnt from their registration)"
    );
    let a = client.route(&req("a")).await.unwrap();
    let after = client.potential_loads(&overlap).await.unwrap();
    assert_eq!(
        after[0].decode_blocks, 4,
        "a's blocks are active already: counted once"
    );
    assert_eq!(
        after[0].prefill_blocks, 8.0,
        "a's 64 prefill tokens are in flight"
    );
    let waiting = {
        let client = client.clone();
        let r = req("b");
        tokio::spawn(async move { client.route(&r).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!waiting.is_finished(), "b waits while a is in prefill");
    match client.route(&req("c")).await {
        Err(ClientError::Router(e)) => assert_eq!(e.kind, ErrorKind::Overloaded, "{e}"),
        other => panic!("expected overloaded, got {other:?}"),
    }
    client
        .mark_prefill(&Booking::new(&a, MODEL, "a"))
        .await
        .unwrap();
    let b = tokio::time::timeout(Duration::from_secs(2), waiting)
        .await
        .expect("b is answered once a's prefill is done")
        .unwrap()
        .unwrap();
    assert_eq!(b.worker_id, 10);
    // b's prefill keeps the worker busy: d waits out the queue timeout, fails with
    // queue_timeout, and is not left behind as load.
    let started = tokio::time::Instant::now();
    match client.route(&req("d")).await {
        Err(ClientError::Router(e)) => assert_eq!(e.kind, ErrorKind::QueueTimeout, "{e}"),
        other => panic!("expected queue_timeout, got {other:?}"),
    }
    assert!(started.elapsed() >= Duration::from_millis(600));
    assert!(matches!(
        client.free(&Booking::new(&a, MODEL, "d")).await,
        Err(ClientError::Router(e)) if e.kind == ErrorKind::UnknownRequest
    ));
    client.free(&Booking::new(&b, MODEL, "b")).await.unwrap();
    // Freeing an unknown request is an error the client sees.
    client.free(&Booking::new(&a, MODEL, "a")).await.unwrap();
    match client.free(&Booking::new(&a, MODEL, "a")).await {
        Err(ClientError::Router(e)) => assert_eq!(e.kind, ErrorKind::UnknownRequest),
        other => panic!("expected unknown request, got {other:?}"),
    }
    replica.shutdown().await;
    fleet.shutdown().await.unwrap();
}

/// Sum of one gauge over every worker rank, from a replica's metrics.
fn gauge_sum(replica: &Replica, name: &str) -> i64 {
    replica
        .shared()
        .metrics
        .render()
        .lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<i64>().ok())
        .sum()
}

#[tokio::test(start_paused = true)]
async fn synced_replicas_see_every_replicas_load_and_a_late_one_catches_up() {
    let bus = Bus::local();
    let fleet = MockerFleet::start(bus.clone(), fleet_config(3, 1, 256))
        .await
        .unwrap();
    let synced = || ReplicaConfig {
        sync: Some(SyncConfig::default()),
        ..replica_config()
    };
    let a = Replica::start(synced(), bus.clone()).await.unwrap();
    let b = Replica::start(synced(), bus.clone()).await.unwrap();
    assert!(a.wait_ready(Duration::from_secs(5)).await);
    assert!(b.wait_ready(Duration::from_secs(5)).await);
    let client = KvRouterClient::new(bus.clone(), "kvrouter").unwrap();
    let mut decisions = Vec::new();
    for i in 0..12u32 {
        let req = RouteRequest::new(MODEL, shared_prefix_prompt(i, i, 4)).booked(format!("q{i}"));
        decisions.push(client.route(&req).await.unwrap());
    }
    let by: std::collections::HashSet<_> = decisions.iter().map(|d| d.replica_id.clone()).collect();
    assert_eq!(by.len(), 2, "both replicas decided some");
    let settle = || tokio::time::sleep(Duration::from_millis(700));
    settle().await;
    for r in [&a, &b] {
        assert_eq!(gauge_sum(r, "kvrouter_worker_active_requests"), 12);
    }
    // A replica started now catches up from a peer.
    let c = Replica::start(synced(), bus.clone()).await.unwrap();
    assert!(c.wait_ready(Duration::from_secs(5)).await);
    settle().await;
    assert_eq!(gauge_sum(&c, "kvrouter_worker_active_requests"), 12);
    // Prefill done and free reach every replica.
    for (i, d) in decisions.iter().enumerate() {
        let id = format!("q{i}");
        client
            .mark_prefill(&Booking::new(d, MODEL, &id))
            .await
            .unwrap();
        if i % 2 == 0 {
            client.free(&Booking::new(d, MODEL, &id)).await.unwrap();
        }
    }
    settle().await;
    for r in [&a, &b, &c] {
        assert_eq!(gauge_sum(r, "kvrouter_worker_active_requests"), 6);
        assert_eq!(gauge_sum(r, "kvrouter_worker_prefill_tokens"), 0);
        assert_eq!(gauge_sum(r, "kvrouter_replica_sync_peers"), 2);
    }
    // A replica that goes away leaves its unfreed sequences behind; the others drop them
    // once it has been silent past its lease.
    let a_id = a.shared().replica_id.clone();
    let a_left = decisions
        .iter()
        .enumerate()
        .filter(|(i, d)| i % 2 == 1 && d.replica_id == a_id)
        .count() as i64;
    assert!(a_left > 0, "a holds some of the unfreed requests");
    a.shutdown().await;
    let dropped = |r: &Replica| {
        gauge_sum(r, "kvrouter_worker_active_requests") == 6 - a_left
            && gauge_sum(r, "kvrouter_replica_sync_peers") == 1
            && gauge_sum(r, "kvrouter_replica_sync_peers_lost_total") == 1
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(6);
    while !(dropped(&b) && dropped(&c)) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "a's sequences still held: {} and {} active",
            gauge_sum(&b, "kvrouter_worker_active_requests"),
            gauge_sum(&c, "kvrouter_worker_active_requests")
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for r in [b, c] {
        r.shutdown().await;
    }
    fleet.shutdown().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_rank_taken_down_leaves_routing_alone_and_comes_back() {
    let bus = Bus::local();
    // Two workers with ranks 4 and 5 each.
    let fleet = MockerFleet::start(
        bus.clone(),
        FleetConfig {
            dp_start_rank: 4,
            ..fleet_config(2, 2, 256)
        },
    )
    .await
    .unwrap();
    let replica = Replica::start(replica_config(), bus.clone()).await.unwrap();
    assert!(replica.wait_ready(Duration::from_secs(5)).await);
    let client = KvRouterClient::new(bus.clone(), "kvrouter").unwrap();
    let pinned = |w: u64, r: Option<u32>| {
        RouteRequest::new(MODEL, shared_prefix_prompt(3, 3, 4)).with_pin(kvrouter_protocol::Pin {
            worker_id: w,
            dp_rank: r,
        })
    };
    for r in [4, 5] {
        let d = client.route(&pinned(10, Some(r))).await.unwrap();
        assert_eq!(d.key(), WorkerKey::new(10, r), "a pinned rank is honoured");
    }
    let err_kind = |r: Result<_, ClientError>| match r {
        Err(ClientError::Router(e)) => Some(e.kind),
        _ => None,
    };
    assert_eq!(
        err_kind(client.route(&pinned(10, Some(3))).await),
        Some(ErrorKind::InvalidRank),
        "rank 3 is outside 4..6"
    );
    // An allowed-workers list is honoured with every rank of the allowed worker.
    let mut allowed = pinned(0, None);
    allowed.pin = None;
    allowed.allowed_workers = Some(vec![11]);
    for _ in 0..10 {
        assert_eq!(client.route(&allowed).await.unwrap().worker_id, 11);
    }

    fleet.set_rank_live(10, 5, false).await.unwrap();
    let gone = async {
        loop {
            if err_kind(client.route(&pinned(10, Some(5))).await) == Some(ErrorKind::InvalidRank) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(3), gone)
        .await
        .expect("the rank leaves with the next heartbeat");
    // Only that rank: the worker's other rank and the other worker still route.
    assert_eq!(
        client.route(&pinned(10, Some(4))).await.unwrap().key(),
        WorkerKey::new(10, 4)
    );
    assert_eq!(
        client.route(&pinned(10, None)).await.unwrap().key(),
        WorkerKey::new(10, 4)
    );
    tokio::time::sleep(Duration::from_millis(700)).await;
    let metrics = replica.shared().metrics.render();
    assert!(metrics.contains(r#"worker="10",dp_rank="4""#), "{metrics}");
    assert!(!metrics.contains(r#"worker="10",dp_rank="5""#), "{metrics}");

    fleet.set_rank_live(10, 5, true).await.unwrap();
    let back = async {
        loop {
            if client.route(&pinned(10, Some(5))).await.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(3), back)
        .await
        .expect("the rank comes back");
    replica.shutdown().await;
    fleet.shutdown().await.unwrap();
}

/// A replica joins the route queue group only once it can route (NATS knows nothing of
/// readiness probes): while a late one discovers its workers, the ready one answers every
/// route; then both do.
#[tokio::test(start_paused = true)]
async fn a_starting_replica_takes_no_routes_until_it_is_ready() {
    let bus = Bus::local();
    let _fleet = MockerFleet::start(bus.clone(), fleet_config(2, 1, 256))
        .await
        .unwrap();
    let start = |id: &str, window_ms: u64| {
        let config = ReplicaConfig {
            replica_id: Some(id.into()),
            discovery_window: Duration::from_millis(window_ms),
            ..replica_config()
        };
        Replica::start(config, bus.clone())
    };
    let first = start("first", 100).await.unwrap();
    assert!(first.wait_ready(Duration::from_secs(5)).await);
    let late = start("late", 800).await.unwrap();
    let client = KvRouterClient::new(bus.clone(), "kvrouter").unwrap();
    let route = |i: u32| {
        let client = client.clone();
        async move {
            let mut req = kvrouter_client::route_request(MODEL, shared_prefix_prompt(i, i, 2));
            req.update_states = false;
            client.route(&req).await.unwrap().replica_id
        }
    };
    for i in 0..40 {
        assert_eq!(route(i).await, "first", "route {i} during late's discovery");
    }
    let (ready, why) = late.shared().readiness();
    assert!(!ready && why.contains("discovering"), "{why}");
    assert!(late.wait_ready(Duration::from_secs(5)).await);
    let mut by = std::collections::BTreeSet::new();
    for i in 0..40 {
        by.insert(route(i).await);
    }
    assert_eq!(by, ["first".to_string(), "late".to_string()].into());
    late.shutdown().await;
    first.shutdown().await;
}

/// A replica with `--replica-sync`, started and ready.
async fn synced(bus: &Bus) -> Replica {
    let config = ReplicaConfig {
        sync: Some(SyncConfig::default()),
        ..replica_config()
    };
    let r = Replica::start(config, bus.clone()).await.unwrap();
    assert!(r.wait_ready(Duration::from_secs(5)).await);
    r
}

/// Waits until `ok` holds (up to 6 s), or fails with `what`.
async fn eventually(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(6);
    while !ok() {
        assert!(tokio::time::Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A route request of `tokens` booked as `id`.
fn booked_request(id: &str, tokens: Vec<u32>) -> RouteRequest {
    RouteRequest::new(MODEL, tokens).booked(id)
}

/// Expected output counts at once, reported output blocks grow it, and the peers see both;
/// a bad decay fraction or priority jump is refused.
#[tokio::test(start_paused = true)]
async fn output_blocks_count_as_decode_load_on_every_synced_replica() {
    let bus = Bus::local();
    let fleet = MockerFleet::start(bus.clone(), fleet_config(1, 1, 256))
        .await
        .unwrap();
    let (a, b) = (synced(&bus).await, synced(&bus).await);
    let client = KvRouterClient::new(bus.clone(), "kvrouter").unwrap();
    let mut req = booked_request("q", shared_prefix_prompt(1, 1, 4));
    req.expected_output_tokens = Some(20); // 2 blocks of 16
    let d = client.route(&req).await.unwrap();
    assert_eq!(d.block_size, 16);
    let blocks = |r: &Replica| gauge_sum(r, "kvrouter_worker_active_blocks");
    eventually("the expected output counts everywhere", || {
        blocks(&a) == 4 + 2 && blocks(&b) == 4 + 2
    })
    .await;
    for _ in 0..3 {
        client
            .add_output_block(&Booking::new(&d, MODEL, "q"), None)
            .await
            .unwrap();
    }
    eventually("three generated blocks count everywhere", || {
        blocks(&a) == 4 + 3 && blocks(&b) == 4 + 3
    })
    .await;
    client
        .add_output_block(&Booking::new(&d, MODEL, "q"), Some(0.5))
        .await
        .unwrap();
    eventually("half of the four blocks count everywhere", || {
        blocks(&a) == 4 + 2 && blocks(&b) == 4 + 2
    })
    .await;
    let refused = client
        .add_output_block(&Booking::new(&d, MODEL, "q"), Some(1.5))
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, ClientError::Router(e) if e.kind == ErrorKind::InvalidRequest),
        "{refused:?}"
    );
    let unknown = client
        .add_output_block(&Booking::new(&d, MODEL, "nope"), None)
        .await
        .unwrap_err();
    assert!(
        matches!(&unknown, ClientError::Router(e) if e.kind == ErrorKind::UnknownRequest),
        "{unknown:?}"
    );
    let mut jumpy = booked_request("j", shared_prefix_prompt(2, 2, 2));
    jumpy.priority_jump = -1.0;
    let refused = client.route(&jumpy).await.unwrap_err();
    assert!(
        matches!(&refused, ClientError::Router(e) if e.kind == ErrorKind::InvalidRequest
            && e.message.contains("priority_jump")),
        "{refused:?}"
    );
    client.free(&Booking::new(&d, MODEL, "q")).await.unwrap();
    eventually("freed everywhere", || blocks(&a) == 0 && blocks(&b) == 0).await;
    for r in [a, b] {
        r.shutdown().await;
    }
    fleet.shutdown().await.unwrap();
}

/// A peer that sees a gap in a replica's sync batches fetches that replica's own requests
/// again: what it held but the replica does not (here a request it was told of in a batch
/// the replica never sent, standing for one whose `Free` it lost) goes, what it holds stays.
#[tokio::test(start_paused = true)]
async fn a_gap_in_a_peers_sync_batches_fetches_its_requests_again() {
    let bus = Bus::local();
    let fleet = MockerFleet::start(bus.clone(), fleet_config(2, 1, 256))
        .await
        .unwrap();
    let (a, b) = (synced(&bus).await, synced(&bus).await);
    let a_id = a.shared().replica_id.clone();
    let client = KvRouterClient::new(bus.clone(), "kvrouter").unwrap();
    for i in 0..6u32 {
        let req = booked_request(&format!("q{i}"), shared_prefix_prompt(i, i, 4));
        client.route(&req).await.unwrap();
    }
    let active = |r: &Replica| gauge_sum(r, "kvrouter_worker_active_requests");
    eventually("both see the six requests", || {
        active(&a) == 6 && active(&b) == 6
    })
    .await;
    // Learn a's instance and sequence from one of its (idle) heartbeats...
    let subjects = Subjects::new("kvrouter").unwrap();
    let mut sync = bus.subscribe(&subjects.sync_of(&a_id)).await.unwrap();
    let last = loop {
        let msg = tokio::time::timeout(Duration::from_secs(3), sync.next())
            .await
            .expect("a heartbeat within the interval")
            .unwrap();
        let batch: SyncBatch = decode(&msg.payload).unwrap();
        if batch.replica_id == a_id {
            break batch;
        }
    };
    assert!(last.seq > 0, "batches are numbered");
    // ...tell b of a request a never routed, in order...
    let ghost = SeqChange::Add {
        request_id: format!("{a_id}:ghost"),
        key: WorkerKey::new(10, 0),
        sequence_hashes: vec![SequenceHash(77)],
        prefill_tokens: 16,
        output_blocks: 0,
    };
    let forged = |seq, changes| SyncBatch {
        changes,
        seq,
        ..last.clone()
    };
    let publish = |batch: SyncBatch| {
        let bus = bus.clone();
        let subject = subjects.sync_of(&a_id);
        async move {
            bus.publish(&subject, Bytes::from(encode(&batch).unwrap()))
                .await
                .unwrap()
        }
    };
    publish(forged(last.seq + 1, vec![ghost])).await;
    eventually("b believes the ghost", || active(&b) == 7).await;
    assert_eq!(active(&a), 6);
    // ...then let it see two of a's batches go missing.
    publish(forged(last.seq + 4, Vec::new())).await;
    eventually("b fetched a's requests and dropped the ghost", || {
        active(&b) == 6 && gauge_sum(&b, "kvrouter_replica_sync_batches_lost_total") >= 2
    })
    .await;
    // A number too far ahead to believe is counted, and makes nothing stale.
    let jumps = format!(
        "kvrouter_replica_sync_refused_total{{model=\"{MODEL}\",reason=\"sequence_jump\"}}"
    );
    assert_eq!(gauge_sum(&b, &jumps), 0);
    publish(forged(last.seq + 4 + (1 << 22), Vec::new())).await;
    eventually("b counted the jump", || gauge_sum(&b, &jumps) == 1).await;
    for r in [a, b] {
        r.shutdown().await;
    }
    fleet.shutdown().await.unwrap();
}

/// Where a sync batch may come from: one on another replica's subject, one freeing another
/// replica's requests, and one on the previous release's shared subject in an upgraded
/// replica's name are dropped and counted; a previous-release replica's batches on the shared
/// subject still apply, unsequenced (a huge number from it makes nothing stale).
#[tokio::test(start_paused = true)]
async fn sync_batches_count_only_from_their_own_subject_and_for_their_own_requests() {
    let bus = Bus::local();
    let fleet = MockerFleet::start(bus.clone(), fleet_config(2, 1, 256))
        .await
        .unwrap();
    let (a, b) = (synced(&bus).await, synced(&bus).await);
    let (a_id, b_id) = (a.shared().replica_id.clone(), b.shared().replica_id.clone());
    let client = KvRouterClient::new(bus.clone(), "kvrouter").unwrap();
    // Route until b holds a request of its own (the queue group picks the replica).
    let mut b_routed = None;
    let mut routed = 0;
    while b_routed.is_none() {
        assert!(routed < 64, "b never got a route");
        let id = format!("q{routed}");
        let req = booked_request(&id, shared_prefix_prompt(routed, routed, 2));
        let decision = client.route(&req).await.unwrap();
        routed += 1;
        if decision.replica_id == b_id {
            b_routed = Some(format!("{b_id}:{id}"));
        }
    }
    let b_routed = b_routed.unwrap();
    let routed = i64::from(routed);
    let active = |r: &Replica| gauge_sum(r, "kvrouter_worker_active_requests");
    eventually("both see every request", || {
        active(&a) == routed && active(&b) == routed
    })
    .await;
    let subjects = Subjects::new("kvrouter").unwrap();
    let batch = |replica_id: &str, changes: Vec<SeqChange>| SyncBatch {
        replica_id: replica_id.into(),
        model: MODEL.into(),
        changes,
        instance_id: uuid::Uuid::new_v4(),
        seq: 1,
    };
    let free = |id: &str| SeqChange::Free {
        request_id: id.into(),
    };
    let add = |id: &str| SeqChange::Add {
        request_id: id.into(),
        key: WorkerKey::new(10, 0),
        sequence_hashes: vec![SequenceHash(77)],
        prefill_tokens: 16,
        output_blocks: 0,
    };
    let publish = |subject: String, batch: SyncBatch| {
        let bus = bus.clone();
        async move {
            bus.publish(&subject, Bytes::from(encode(&batch).unwrap()))
                .await
                .unwrap()
        }
    };
    let counted = |r: &Replica, subject: &str| {
        gauge_sum(
            r,
            &format!("kvrouter_misattributed_messages_total{{subject=\"{subject}\"}}"),
        )
    };
    // On a's subject in b's name (and in a's name, freeing b's request: a may speak only of
    // its own requests).
    publish(subjects.sync_of(&a_id), batch(&b_id, vec![free(&b_routed)])).await;
    publish(subjects.sync_of(&a_id), batch(&a_id, vec![free(&b_routed)])).await;
    // On the shared legacy subject in a's name (a publishes on its own subject), with a new
    // instance that would otherwise drop every request of a's.
    publish(subjects.legacy_sync(), batch(&a_id, Vec::new())).await;
    eventually("b counted all three", || {
        counted(&b, "sync") == 2 && counted(&b, "sync_change") == 1
    })
    .await;
    assert_eq!(
        active(&b),
        routed,
        "nothing of b's was freed, nothing of a's dropped"
    );
    // A previous-release replica on the shared subject is still heard, whatever its numbers.
    let mut old = batch("old", vec![add("old:x")]);
    old.seq = u64::MAX - 1;
    publish(subjects.legacy_sync(), old).await;
    publish(subjects.legacy_sync(), batch("old", vec![add("old:y")])).await;
    eventually("both of old's batches apply", || {
        active(&a) == routed + 2 && active(&b) == routed + 2
    })
    .await;
    for r in [a, b] {
        r.shutdown().await;
    }
    fleet.shutdown().await.unwrap();
}

/// A replica restarted under its id: its peers drop what its previous instance routed as
/// soon as they hear the new one (no lease to wait out: the peer never looked lost).
#[tokio::test(start_paused = true)]
async fn a_restarted_peer_instance_takes_its_old_requests_with_it() {
    let bus = Bus::local();
    let fleet = MockerFleet::start(bus.clone(), fleet_config(2, 1, 256))
        .await
        .unwrap();
    let named = |id: &str| ReplicaConfig {
        replica_id: Some(id.to_string()),
        sync: Some(SyncConfig::default()),
        ..replica_config()
    };
    let a = Replica::start(named("a"), bus.clone()).await.unwrap();
    let b = Replica::start(named("b"), bus.clone()).await.unwrap();
    assert!(a.wait_ready(Duration::from_secs(5)).await);
    assert!(b.wait_ready(Duration::from_secs(5)).await);
    let client = KvRouterClient::new(bus.clone(), "kvrouter").unwrap();
    let mut on_a = 0;
    for i in 0..8u32 {
        let d = client
            .route(&booked_request(
                &format!("q{i}"),
                shared_prefix_prompt(i, i, 4),
            ))
            .await
            .unwrap();
        on_a += i64::from(d.replica_id == "a");
    }
    assert!(on_a > 0, "a routed some");
    let active = |r: &Replica| gauge_sum(r, "kvrouter_worker_active_requests");
    eventually("b sees all eight", || active(&b) == 8).await;
    a.shutdown().await;
    let a = Replica::start(named("a"), bus.clone()).await.unwrap();
    assert!(a.wait_ready(Duration::from_secs(5)).await);
    eventually("b dropped the old instance's requests", || {
        active(&b) == 8 - on_a
    })
    .await;
    assert_eq!(
        gauge_sum(&b, "kvrouter_replica_sync_peers_lost_total"),
        0,
        "a never looked lost: its new instance told"
    );
    for r in [a, b] {
        r.shutdown().await;
    }
    fleet.shutdown().await.unwrap();
}

/// A caller that abandons a route call (it asked another replica after a timeout) frees the
/// booking everywhere but on the replica it kept, peers included; a copy of the call that
/// arrives after the abandon is turned away, a new call for the same request id is not.
#[tokio::test(start_paused = true)]
async fn an_abandoned_route_call_is_freed_and_a_late_copy_turned_away() {
    let bus = Bus::local();
    let fleet = MockerFleet::start(bus.clone(), fleet_config(2, 1, 256))
        .await
        .unwrap();
    let (a, b) = (synced(&bus).await, synced(&bus).await);
    let client = KvRouterClient::new(bus.clone(), "kvrouter").unwrap();
    let subjects = client.subjects().clone();
    let abandon = |id: &str, call_id: u64, lease: Lease, kept_by: Option<String>| {
        let (bus, subject) = (bus.clone(), subjects.abandon());
        let msg = Abandon {
            model: MODEL.into(),
            request_id: id.into(),
            call_id,
            kept_by,
            lease,
        };
        async move {
            let bytes = encode(&msg).unwrap();
            bus.publish(&subject, bytes.into()).await.unwrap();
        }
    };
    let active = |r: &Replica| gauge_sum(r, "kvrouter_worker_active_requests");
    let mut req = booked_request("q", shared_prefix_prompt(1, 1, 4));
    req.call_id = 7;
    let d = client.route(&req).await.unwrap();
    eventually("both see it", || active(&a) == 1 && active(&b) == 1).await;
    // Kept where it was answered: nothing changes.
    abandon("q", 7, req.lease, Some(d.replica_id.clone())).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!((active(&a), active(&b)), (1, 1));
    // Under another lease (not its caller's): nothing changes either.
    abandon("q", 7, Lease::random(), Some("another".into())).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!((active(&a), active(&b)), (1, 1));
    // Kept elsewhere: the booking goes, on the peer too.
    abandon("q", 7, req.lease, Some("another".into())).await;
    eventually("freed everywhere", || active(&a) == 0 && active(&b) == 0).await;
    let abandoned = |r: &Replica| gauge_sum(r, "kvrouter_replica_routes_abandoned_total");
    assert_eq!(abandoned(&a) + abandoned(&b), 1);

    // Abandoned before it arrives (the copy waited in a stopped replica's socket).
    let mut late = booked_request("late", shared_prefix_prompt(2, 2, 4));
    late.call_id = 9;
    abandon("late", 9, late.lease, None).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let refused = client.route(&late).await.unwrap_err();
    assert!(
        matches!(&refused, ClientError::Router(e) if e.kind == ErrorKind::Unavailable
            && e.message.contains("abandoned")),
        "{refused:?}"
    );
    late.call_id = 10;
    let d = client.route(&late).await.unwrap();
    eventually("the new call is booked everywhere", || {
        active(&a) == 1 && active(&b) == 1
    })
    .await;
    client.free(&Booking::new(&d, MODEL, "late")).await.unwrap();
    eventually("and freed", || active(&a) == 0 && active(&b) == 0).await;
    for r in [a, b] {
        r.shutdown().await;
    }
    fleet.shutdown().await.unwrap();
}

/// A replica that drops one of its own requests by itself (here its request-timeout sweep;
/// likewise when its view of a worker ends) tells its peers, whose own view or timeout may
/// differ: otherwise they would hold the request until their sweep.
#[tokio::test(start_paused = true)]
async fn a_request_a_replica_drops_by_itself_leaves_its_peers_too() {
    let bus = Bus::local();
    let fleet = MockerFleet::start(bus.clone(), fleet_config(2, 1, 256))
        .await
        .unwrap();
    let config = |id: &str, timeout: Duration| ReplicaConfig {
        replica_id: Some(id.to_string()),
        sync: Some(SyncConfig::default()),
        scheduler: SchedulerConfig {
            request_timeout: timeout,
            ..SchedulerConfig::default()
        },
        ..replica_config()
    };
    let a = Replica::start(config("a", Duration::from_secs(1)), bus.clone())
        .await
        .unwrap();
    let b = Replica::start(config("b", Duration::from_secs(300)), bus.clone())
        .await
        .unwrap();
    assert!(a.wait_ready(Duration::from_secs(5)).await);
    assert!(b.wait_ready(Duration::from_secs(5)).await);
    let client = KvRouterClient::new(bus.clone(), "kvrouter").unwrap();
    let active = |r: &Replica| gauge_sum(r, "kvrouter_worker_active_requests");
    // Until `a` decides one (the queue group picks either); `b`'s are freed at once.
    let mut on_a = false;
    for i in 0..64u32 {
        let id = format!("q{i}");
        let d = client
            .route(&booked_request(&id, shared_prefix_prompt(i, i, 4)))
            .await
            .unwrap();
        if d.replica_id == "a" {
            on_a = true;
            break;
        }
        client.free(&Booking::new(&d, MODEL, &id)).await.unwrap();
    }
    assert!(on_a, "replica a decided none of 64 routes");
    eventually("b sees a's request", || active(&b) == 1).await;
    // `a` sweeps it after 1 s; `b` would keep it for 300 s unless told.
    eventually("swept on a, and so gone from b", || {
        active(&a) == 0 && active(&b) == 0
    })
    .await;
    for r in [a, b] {
        r.shutdown().await;
    }
    fleet.shutdown().await.unwrap();
}

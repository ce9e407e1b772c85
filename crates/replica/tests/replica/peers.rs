//! Bounded peers and honest readiness, on the in-process bus: a worker that never answers
//! state queries gets no routes and does not keep the replica unready; a huge registration
//! cannot make a replica fetch without bound, nor an overfull state answer make it hold more
//! than the worker's capacity; undecodable messages are counted per subject.

use crate::support::{fleet_config, replica_config, BLOCK, MODEL};
use bytes::Bytes;
use kvrouter_bus::Bus;
use kvrouter_client::{GenerateParams, KvRouterClient};
use kvrouter_mocker::MockerFleet;
use kvrouter_protocol::{
    encode, EngineKind, Heartbeat, KvEvent, KvEventBatch, KvEventData, Registration, RouteRequest,
    Subjects, Tier, WorkerKey, WorkerRole, WorkerSubject,
};
use kvrouter_replica::{Replica, ReplicaConfig};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use uuid::Uuid;

/// The worker id of the silent worker (the mocker's start at 10).
const SILENT: u64 = 500;

fn subjects() -> kvrouter_protocol::ModelSubjects {
    Subjects::new("kvrouter").unwrap().model(MODEL).unwrap()
}

/// A replica that gives up on a worker's state after 200 ms.
fn short_fetch_config() -> ReplicaConfig {
    ReplicaConfig {
        state_fetch_timeout: Duration::from_millis(200),
        ..replica_config()
    }
}

fn registration(worker_id: u64, instance_id: Uuid, dp_size: u32) -> Registration {
    Registration {
        worker_id,
        instance_id,
        model: MODEL.into(),
        role: WorkerRole::Aggregated,
        block_size: BLOCK,
        dp_size,
        dp_start_rank: 0,
        live_ranks: (0..dp_size).collect(),
        tp_size: 1,
        capacity_blocks: 1024,
        heartbeat_interval_ms: 200,
        engine: EngineKind::Mocker,
        base_url: String::new(),
    }
}

/// A worker that registers, heartbeats and answers roll calls, but never answers a state
/// query; counts the queries it gets. Stops when the returned handle is aborted.
async fn silent_worker(
    bus: &Bus,
    worker_id: u64,
    dp_size: u32,
) -> (Arc<AtomicUsize>, tokio::task::JoinHandle<()>) {
    let s = subjects();
    let queries = Arc::new(AtomicUsize::new(0));
    let mut state = bus.subscribe(&s.state(worker_id)).await.unwrap();
    let mut roll_call = bus.subscribe(&s.who_is_there()).await.unwrap();
    bus.flush().await.unwrap();
    let instance = Uuid::new_v4();
    let reg = Bytes::from(encode(&registration(worker_id, instance, dp_size)).unwrap());
    let hb = Bytes::from(
        encode(&Heartbeat {
            worker_id,
            instance_id: instance,
            live_ranks: (0..dp_size).collect(),
        })
        .unwrap(),
    );
    let (bus, q) = (bus.clone(), queries.clone());
    let task = tokio::spawn(async move {
        let _ = bus.publish(&s.register(worker_id), reg.clone()).await;
        let mut beat = tokio::time::interval(Duration::from_millis(200));
        loop {
            tokio::select! {
                _ = beat.tick() => { let _ = bus.publish(&s.heartbeat(worker_id), hb.clone()).await; }
                Some(_) = roll_call.next() => { let _ = bus.publish(&s.register(worker_id), reg.clone()).await; }
                Some(_) = state.next() => { q.fetch_add(1, Ordering::SeqCst); }
            }
        }
    });
    (queries, task)
}

/// The value of the first metrics line starting with `line_start`, if any.
fn metric_line(replica: &Replica, line_start: &str) -> Option<i64> {
    let text = replica.shared().metrics.render();
    text.lines()
        .find(|l| l.starts_with(line_start))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .map(|v| v as i64)
}

#[tokio::test(start_paused = true)]
async fn a_worker_that_never_syncs_gets_no_routes_and_does_not_hold_readiness() {
    let bus = Bus::local();
    let _fleet = MockerFleet::start(bus.clone(), fleet_config(2, 1, 1024))
        .await
        .unwrap();
    let (queries, silent) = silent_worker(&bus, SILENT, 1).await;
    let replica = Replica::start(short_fetch_config(), bus.clone())
        .await
        .unwrap();
    assert!(
        replica.wait_ready(Duration::from_secs(5)).await,
        "a silent worker kept the replica unready: {}",
        replica.shared().readiness().1
    );
    // Its first fetch has failed by now (else readiness would still wait for it).
    let (ready, body) = replica.shared().readiness();
    assert!(ready);
    assert!(
        body.contains("left out of routing") && body.contains(&format!("{SILENT}/0")),
        "{body}"
    );
    assert_eq!(
        metric_line(&replica, "kvrouter_unroutable_ranks{"),
        Some(1),
        "the metric names it"
    );
    assert!(queries.load(Ordering::SeqCst) >= 1, "it was asked");

    // Routes go to the two synced workers only, whatever the load.
    let client = KvRouterClient::new(bus.clone(), "kvrouter").unwrap();
    for i in 0..30u32 {
        let tokens: Vec<u32> = (0..4 * BLOCK).map(|t| i * 10_000 + t).collect();
        let done = client
            .generate(&GenerateParams::new(MODEL, tokens, 1))
            .await
            .unwrap();
        assert_ne!(
            done.decision.worker_id, SILENT,
            "route {i} went to the silent worker"
        );
    }
    // A pin to it is refused rather than routed blind.
    let pinned = client
        .route(
            &RouteRequest::new(MODEL, (0..2 * BLOCK).collect()).with_allowed_workers(vec![SILENT]),
        )
        .await;
    assert!(pinned.is_err(), "{pinned:?}");
    silent.abort();
    replica.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_registration_with_thousands_of_ranks_is_fetched_a_few_at_a_time() {
    let bus = Bus::local();
    let replica = Replica::start(short_fetch_config(), bus.clone())
        .await
        .unwrap();
    let (queries, silent) = silent_worker(&bus, SILENT, 4096).await;
    // Over one second with a 200 ms fetch timeout: at most 4 at a time, each slot turning
    // over about every 200 ms (plus backoff), so a few dozen at most, not 4,096.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let asked = queries.load(Ordering::SeqCst);
    assert!(asked >= 4, "{asked}: fetches started");
    assert!(asked <= 4 * 6, "{asked} state queries in one second");
    assert!(replica.wait_ready(Duration::from_secs(5)).await);
    silent.abort();
    replica.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn absurd_registrations_are_refused_and_takeovers_counted() {
    let bus = Bus::local();
    let replica = Replica::start(short_fetch_config(), bus.clone())
        .await
        .unwrap();
    assert!(replica.wait_ready(Duration::from_secs(5)).await);
    let s = subjects();
    let publish = |r: Registration| {
        let bus = bus.clone();
        let subject = s.register(r.worker_id);
        async move {
            bus.publish(&subject, Bytes::from(encode(&r).unwrap()))
                .await
                .unwrap()
        }
    };
    let mut huge = registration(1, Uuid::new_v4(), 1);
    huge.capacity_blocks = 1 << 63;
    publish(huge).await;
    let mut no_beat = registration(2, Uuid::new_v4(), 1);
    no_beat.heartbeat_interval_ms = 0;
    publish(no_beat).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    while metric_line(&replica, "kvrouter_refused_registrations_total{") != Some(2) {
        assert!(Instant::now() < deadline, "refusals never counted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(metric_line(&replica, "kvrouter_workers{"), Some(0));

    // The same worker id from a new instance while the first is live: allowed, counted.
    publish(registration(3, Uuid::new_v4(), 1)).await;
    publish(registration(3, Uuid::new_v4(), 1)).await;
    while metric_line(&replica, "kvrouter_worker_instance_takeovers_total{") != Some(1) {
        assert!(Instant::now() < deadline, "the takeover was never counted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(metric_line(&replica, "kvrouter_workers{"), Some(1));
    replica.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_worker_cannot_speak_for_another_on_its_own_subjects() {
    let bus = Bus::local();
    let replica = Replica::start(short_fetch_config(), bus.clone())
        .await
        .unwrap();
    assert!(replica.wait_ready(Duration::from_secs(5)).await);
    let s = subjects();
    let publish = |subject: String, bytes: Vec<u8>| {
        let bus = bus.clone();
        async move { bus.publish(&subject, Bytes::from(bytes)).await.unwrap() }
    };
    // Worker 6's subject, worker 5's registration: dropped and counted.
    let forged = registration(5, Uuid::new_v4(), 1);
    publish(s.register(6), encode(&forged).unwrap()).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    while metric_line(
        &replica,
        "kvrouter_misattributed_messages_total{subject=\"registration\"}",
    ) != Some(1)
    {
        assert!(Instant::now() < deadline, "the forgery was never counted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(metric_line(&replica, "kvrouter_workers{").unwrap_or(0), 0);

    // Worker 5 registered on its own subject; worker 6 then claims a block for it.
    let genuine = registration(5, Uuid::new_v4(), 1);
    publish(s.register(5), encode(&genuine).unwrap()).await;
    while metric_line(&replica, "kvrouter_workers{") != Some(1) {
        assert!(Instant::now() < deadline, "worker 5 never joined");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let claim = KvEventBatch {
        worker_id: 5,
        instance_id: genuine.instance_id,
        events: vec![KvEvent {
            tier: Tier::Device,
            key: WorkerKey::new(5, 0),
            event_id: 0,
            data: KvEventData::Cleared,
        }],
    };
    publish(s.kv_events(6), encode(&claim).unwrap()).await;
    while metric_line(
        &replica,
        "kvrouter_misattributed_messages_total{subject=\"kv_events\"}",
    ) != Some(1)
    {
        assert!(
            Instant::now() < deadline,
            "the forged events were never counted"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Nothing under another id on the model-wide subjects' place either: the worker's own
    // subject with its own id is what counts.
    assert!(s
        .every_worker(WorkerSubject::KvEvents)
        .contains(".worker.*."));
    replica.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn undecodable_messages_are_counted_per_subject_and_requests_answered() {
    let bus = Bus::local();
    let replica = Replica::start(short_fetch_config(), bus.clone())
        .await
        .unwrap();
    assert!(replica.wait_ready(Duration::from_secs(5)).await);
    let s = subjects();
    let garbage = Bytes::from_static(&[1, 0xff, 0xff, 0xff]);
    bus.publish(&s.register(1), garbage.clone()).await.unwrap();
    bus.publish(&s.heartbeat(1), garbage.clone()).await.unwrap();
    let route = Subjects::new("kvrouter").unwrap().route();
    let answer = bus
        .request(&route, garbage.clone(), Duration::from_secs(2))
        .await
        .unwrap();
    let reply: kvrouter_protocol::Reply<kvrouter_protocol::RouteDecision> =
        kvrouter_protocol::decode(&answer.payload).unwrap();
    let err = reply.into_result().unwrap_err();
    assert_eq!(err.kind, kvrouter_protocol::ErrorKind::Malformed);
    let deadline = Instant::now() + Duration::from_secs(5);
    for kind in ["registration", "heartbeat", "route"] {
        let line = format!("kvrouter_undecodable_messages_total{{subject=\"{kind}\"}}");
        while metric_line(&replica, &line) != Some(1) {
            assert!(Instant::now() < deadline, "{line} never reached 1");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    assert_eq!(metric_line(&replica, "kvrouter_bus_connected "), Some(1));
    replica.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn previous_version_peers_are_read_and_answered_in_their_version() {
    use kvrouter_protocol::{
        decode_versioned, encode_as, Reply, RouteDecision, FORMAT_VERSION, MIN_READ_VERSION,
    };
    let bus = Bus::local();
    let _fleet = MockerFleet::start(bus.clone(), fleet_config(2, 1, 1024))
        .await
        .unwrap();
    let replica = Replica::start(short_fetch_config(), bus.clone())
        .await
        .unwrap();
    assert!(replica.wait_ready(Duration::from_secs(5)).await);
    let route = Subjects::new("kvrouter").unwrap().route();
    let req = RouteRequest::new(MODEL, (0..4 * BLOCK).collect());
    for version in [MIN_READ_VERSION, FORMAT_VERSION] {
        let bytes = Bytes::from(encode_as(&req, version).unwrap());
        let answer = bus
            .request(&route, bytes, Duration::from_secs(2))
            .await
            .unwrap();
        assert_eq!(answer.payload[0], version, "answered in another version");
        let (reply, _): (Reply<RouteDecision>, u8) = decode_versioned(&answer.payload).unwrap();
        reply.into_result().unwrap();
    }

    // A worker still on the previous version registers in its bytes, on the model-wide
    // subject of its release.
    let old = Registration {
        worker_id: 77,
        instance_id: Uuid::new_v4(),
        model: MODEL.into(),
        role: WorkerRole::Aggregated,
        block_size: BLOCK,
        dp_size: 1,
        dp_start_rank: 0,
        live_ranks: vec![0],
        tp_size: 1,
        capacity_blocks: 1024,
        heartbeat_interval_ms: 200,
        engine: EngineKind::Vllm,
        base_url: "http://10.0.0.77:8000".into(),
    };
    let bytes = encode_as(&old, MIN_READ_VERSION).unwrap();
    assert_eq!(bytes[0], MIN_READ_VERSION);
    let legacy = subjects().legacy(WorkerSubject::Register).unwrap();
    bus.publish(&legacy, Bytes::from(bytes)).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while metric_line(&replica, "kvrouter_workers{") != Some(3) {
        assert!(
            Instant::now() < deadline,
            "the previous-version registration was not taken"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        metric_line(&replica, "kvrouter_undecodable_messages_total{"),
        None
    );
    replica.shutdown().await;
}

/// A worker whose state answer holds more blocks than its registered capacity explains
/// (1,024 blocks registered, 5,000 sent) is refused as the answer streams in: the fetch
/// fails, the rank stays out of routing, and the replica holds none of it.
#[tokio::test(start_paused = true)]
async fn a_state_answer_beyond_the_registered_capacity_is_refused() {
    use kvrouter_protocol::{EngineBlockHash, LocalBlockHash, Reply, StateChunk, StoredBlock};
    const OVERFULL: u64 = 600;
    let bus = Bus::local();
    let _fleet = MockerFleet::start(bus.clone(), fleet_config(1, 1, 1024))
        .await
        .unwrap();
    let s = subjects();
    let mut state = bus.subscribe(&s.state(OVERFULL)).await.unwrap();
    let mut roll_call = bus.subscribe(&s.who_is_there()).await.unwrap();
    bus.flush().await.unwrap();
    let instance = Uuid::new_v4();
    let reg = Bytes::from(encode(&registration(OVERFULL, instance, 1)).unwrap());
    let hb = Bytes::from(
        encode(&Heartbeat {
            worker_id: OVERFULL,
            instance_id: instance,
            live_ranks: vec![0],
        })
        .unwrap(),
    );
    let key = WorkerKey::new(OVERFULL, 0);
    let chunk = move |first: u64| StateChunk {
        key,
        instance_id: instance,
        last_event_id: Some(9),
        events: vec![KvEvent {
            key,
            event_id: 0,
            tier: Tier::Device,
            data: KvEventData::Stored {
                parent: (first > 0).then_some(EngineBlockHash(first - 1)),
                blocks: (first..first + 500)
                    .map(|i| StoredBlock {
                        engine_hash: EngineBlockHash(i),
                        local_hash: LocalBlockHash(i),
                    })
                    .collect(),
            },
        }],
    };
    let worker_bus = bus.clone();
    let worker = tokio::spawn(async move {
        let bus = worker_bus;
        let _ = bus.publish(&s.register(OVERFULL), reg.clone()).await;
        let mut beat = tokio::time::interval(Duration::from_millis(200));
        loop {
            tokio::select! {
                _ = beat.tick() => { let _ = bus.publish(&s.heartbeat(OVERFULL), hb.clone()).await; }
                Some(_) = roll_call.next() => { let _ = bus.publish(&s.register(OVERFULL), reg.clone()).await; }
                Some(q) = state.next() => {
                    let Some(reply) = q.reply else { continue };
                    for c in 0..10 {
                        let bytes = encode(&Reply::Ok(chunk(c * 500))).unwrap();
                        let _ = bus.publish(&reply, Bytes::from(bytes)).await;
                    }
                    let _ = bus.end_stream(&reply).await;
                }
            }
        }
    });
    let replica = Replica::start(short_fetch_config(), bus.clone())
        .await
        .unwrap();
    assert!(replica.wait_ready(Duration::from_secs(5)).await);
    let deadline = Instant::now() + Duration::from_secs(5);
    while metric_line(&replica, "kvrouter_unroutable_ranks{") != Some(1) {
        assert!(Instant::now() < deadline, "the overfull rank was taken");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(metric_line(&replica, "kvrouter_state_recovery_failures_total{").unwrap_or(0) >= 1);
    assert_eq!(
        replica.dump_rank(MODEL, key).await.map(|d| d.events.len()),
        None,
        "nothing of it is held"
    );
    let (_, body) = replica.shared().readiness();
    assert!(body.contains(&format!("{OVERFULL}/0")), "{body}");
    worker.abort();
    replica.shutdown().await;
}

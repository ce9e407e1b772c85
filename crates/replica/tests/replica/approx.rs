//! Approximate mode (`no_kv_events`) on the in-process bus with a mocker fleet: the replica
//! turns ready without fetching worker state, consumes no KV events, and its index is fed by
//! its own state-updating route decisions, which expire after the router TTL.

use crate::support::{fleet_config, model_metric, replica_config, seeded_tokens, BLOCK, MODEL};
use kvrouter_bus::{Bus, Subscription};
use kvrouter_client::{Booking, GenerateParams, KvRouterClient};
use kvrouter_mocker::MockerFleet;
use kvrouter_protocol::{OverlapRequest, RouteDecision, RouteRequest, Subjects, WorkerKey};
use kvrouter_replica::{IndexSource, Replica, ReplicaConfig};
use std::time::Duration;
// The runtime's clock, as the replica's TTL expiry reads it (paused in most tests here).
use tokio::time::Instant;

const WORKERS: u64 = 3;

fn approx_config(ttl: Duration) -> ReplicaConfig {
    ReplicaConfig {
        index: IndexSource::Approx { ttl, serve: false },
        ..replica_config()
    }
}

/// `blocks` full blocks of tokens unique to `id`, plus a partial block (never hashed).
fn prompt_with_tail(id: u32, blocks: u32) -> Vec<u32> {
    seeded_tokens(id, blocks * BLOCK + BLOCK / 2)
}

fn route_req(id: &str, tokens: Vec<u32>, update_states: bool) -> RouteRequest {
    RouteRequest::new(MODEL, tokens)
        .with_request_id(id)
        .with_update_states(update_states)
}

async fn overlaps(client: &KvRouterClient, tokens: &[u32]) -> Vec<(WorkerKey, u32)> {
    client
        .overlap_scores(&OverlapRequest {
            model: MODEL.into(),
            tokens: tokens.to_vec(),
            lora: None,
        })
        .await
        .unwrap()
        .scores
}

/// Polls the overlap scores until `done` holds or `timeout` passes; returns the last scores.
async fn wait_overlaps(
    client: &KvRouterClient,
    tokens: &[u32],
    timeout: Duration,
    done: impl Fn(&[(WorkerKey, u32)]) -> bool,
) -> Vec<(WorkerKey, u32)> {
    let deadline = Instant::now() + timeout;
    loop {
        let scores = overlaps(client, tokens).await;
        if done(&scores) || Instant::now() >= deadline {
            return scores;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Every worker's state subject, to see whether anyone asks for worker state.
async fn watch_state_queries(bus: &Bus) -> Vec<Subscription> {
    let subjects = Subjects::new("kvrouter").unwrap().model(MODEL).unwrap();
    let mut subs = Vec::new();
    for w in 10..10 + WORKERS {
        subs.push(bus.subscribe(&subjects.state(w)).await.unwrap());
    }
    subs
}

async fn no_state_queries(subs: &mut [Subscription]) {
    for sub in subs {
        let got = tokio::time::timeout(Duration::from_millis(50), sub.next()).await;
        assert!(
            got.is_err(),
            "a state query was sent in approximate mode: {got:?}"
        );
    }
}

async fn start(ttl: Duration) -> (Bus, MockerFleet, Replica, KvRouterClient, Vec<Subscription>) {
    let bus = Bus::local();
    let fleet = MockerFleet::start(bus.clone(), fleet_config(WORKERS as u32, 1, 256))
        .await
        .unwrap();
    let state_queries = watch_state_queries(&bus).await;
    let replica = Replica::start(approx_config(ttl), bus.clone())
        .await
        .unwrap();
    assert!(
        replica.wait_ready(Duration::from_secs(5)).await,
        "{}",
        replica.shared().readiness().1
    );
    let client = KvRouterClient::new(bus.clone(), "kvrouter").unwrap();
    (bus, fleet, replica, client, state_queries)
}

fn key(d: &RouteDecision) -> WorkerKey {
    WorkerKey::new(d.worker_id, d.dp_rank)
}

#[tokio::test(start_paused = true)]
async fn decisions_feed_the_index_without_kv_events_or_state_fetches() {
    let (_bus, fleet, replica, client, mut state_queries) = start(Duration::from_secs(120)).await;
    // (1) Ready without any state fetch: every rank counts as synced once it joins.
    let status = &replica.shared().models[MODEL].status;
    assert_eq!(
        status.ranks.load(std::sync::atomic::Ordering::Relaxed),
        WORKERS as usize
    );
    assert_eq!(model_metric(&replica, "kvrouter_state_recoveries_total"), 0);
    no_state_queries(&mut state_queries).await;

    // (2) A state-updating decision is recorded on the chosen worker key...
    let a = prompt_with_tail(1, 4);
    let first = client
        .route(&route_req("a", a.clone(), true))
        .await
        .unwrap();
    assert_eq!(first.overlap_blocks, 0, "nothing is cached yet");
    let scores = wait_overlaps(&client, &a, Duration::from_secs(2), |s| !s.is_empty()).await;
    assert_eq!(
        scores,
        vec![(key(&first), 4)],
        "only full blocks are recorded"
    );
    // ...and once a's load is gone, a query for the same prompt goes there on overlap alone.
    client
        .mark_prefill(&Booking::new(&first, MODEL, "a"))
        .await
        .unwrap();
    client
        .free(&Booking::new(&first, MODEL, "a"))
        .await
        .unwrap();
    for i in 0..5 {
        let again = client
            .route(&route_req(&format!("q{i}"), a.clone(), false))
            .await
            .unwrap();
        assert_eq!(key(&again), key(&first));
        assert_eq!(again.overlap_blocks, 4);
    }

    // (4) Decisions that do not update state are queries: they record nothing.
    let b = prompt_with_tail(2, 3);
    let query = client
        .route(&route_req("b", b.clone(), false))
        .await
        .unwrap();
    assert_eq!(query.overlap_blocks, 0);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(overlaps(&client, &b).await.is_empty());
    let again = client
        .route(&route_req("b2", b.clone(), false))
        .await
        .unwrap();
    assert_eq!(again.overlap_blocks, 0, "a query left nothing behind");
    assert_eq!(
        model_metric(&replica, "kvrouter_approx_decisions_recorded_total"),
        1
    );

    // Workers that really run requests publish KV events; the replica does not consume them.
    let out = client
        .generate(&GenerateParams::new(MODEL, prompt_with_tail(3, 2), 2))
        .await
        .unwrap();
    assert!(out.output_tokens >= 1);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        model_metric(&replica, "kvrouter_kv_events_applied_total"),
        0
    );
    assert_eq!(
        model_metric(&replica, "kvrouter_approx_record_failures_total"),
        0
    );
    // The generate's routing decision was recorded like any other.
    let c = wait_overlaps(
        &client,
        &prompt_with_tail(3, 2),
        Duration::from_secs(2),
        |s| !s.is_empty(),
    )
    .await;
    assert_eq!(c, vec![(key(&out.decision), 2)]);
    no_state_queries(&mut state_queries).await;
    assert_eq!(model_metric(&replica, "kvrouter_state_recoveries_total"), 0);

    replica.shutdown().await;
    fleet.shutdown().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn recorded_decisions_expire_after_the_router_ttl() {
    let ttl = Duration::from_secs(2);
    let (_bus, fleet, replica, client, _state_queries) = start(ttl).await;
    let a = prompt_with_tail(7, 3);
    let decision = client
        .route(&route_req("a", a.clone(), true))
        .await
        .unwrap();
    let recorded = Instant::now();
    let scores = wait_overlaps(&client, &a, Duration::from_secs(2), |s| !s.is_empty()).await;
    assert_eq!(scores, vec![(key(&decision), 3)]);
    client
        .mark_prefill(&Booking::new(&decision, MODEL, "a"))
        .await
        .unwrap();
    client
        .free(&Booking::new(&decision, MODEL, "a"))
        .await
        .unwrap();
    // Still there well within the TTL (queries do not renew it)...
    let q = client
        .route(&route_req("q", a.clone(), false))
        .await
        .unwrap();
    assert_eq!((key(&q), q.overlap_blocks), (key(&decision), 3));
    // ...gone after it (expiry runs about once a second).
    let scores = wait_overlaps(&client, &a, ttl * 3, |s| s.is_empty()).await;
    assert!(scores.is_empty(), "not expired: {scores:?}");
    assert!(
        recorded.elapsed() >= ttl - Duration::from_millis(100),
        "expired after {:?}, before the TTL",
        recorded.elapsed()
    );
    let q = client
        .route(&route_req("q2", a.clone(), false))
        .await
        .unwrap();
    assert_eq!(q.overlap_blocks, 0);
    replica.shutdown().await;
    fleet.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_zero_router_ttl_is_refused() {
    let config = approx_config(Duration::ZERO);
    let err = Replica::start(config, Bus::local()).await.err().unwrap();
    assert!(err.to_string().contains("--router-ttl-secs"), "{err}");
}

/// The overlaps a replica's own index gives a prompt, sorted.
fn index_overlaps(replica: &Replica, tokens: &[u32]) -> Vec<(WorkerKey, u32)> {
    let local = kvrouter_protocol::local_block_hashes(tokens, BLOCK as usize, None).unwrap();
    let mut scores = replica.shared().models[MODEL]
        .index
        .find_matches(&local)
        .scores;
    scores.sort_unstable();
    scores
}

#[tokio::test(start_paused = true)]
async fn a_late_serving_indexer_loads_a_peers_approximate_index() {
    // A small payload limit, so that the dump travels in several chunks.
    let bus = Bus::from(kvrouter_bus::LocalBus::with_max_payload(80 << 10));
    let _fleet = MockerFleet::start(bus.clone(), fleet_config(WORKERS as u32, 1, 256))
        .await
        .unwrap();
    let serving = |id: &str| ReplicaConfig {
        replica_id: Some(id.into()),
        index: IndexSource::Approx {
            ttl: Duration::from_secs(120),
            serve: true,
        },
        max_prompt_tokens: 4096,
        ..approx_config(Duration::from_secs(120))
    };
    let s1 = Replica::start(serving("s1"), bus.clone()).await.unwrap();
    assert!(s1.wait_ready(Duration::from_secs(5)).await);
    let client = KvRouterClient::new(bus.clone(), "kvrouter").unwrap();

    // s1 learns 16 decisions of 64 blocks each (1,024 entries: more than one chunk).
    const PROMPTS: u32 = 16;
    let prompts: Vec<Vec<u32>> = (0..PROMPTS)
        .map(|i| prompt_with_tail(100 + i, 64))
        .collect();
    for (i, p) in prompts.iter().enumerate() {
        client
            .route(&route_req(&format!("r{i}"), p.clone(), true))
            .await
            .unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while model_metric(&s1, "kvrouter_served_indexer_records_total") < PROMPTS as u64 {
        assert!(
            Instant::now() < deadline,
            "s1 did not record every decision"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // s2 starts later: once ready, its index answers like s1's.
    let s2 = Replica::start(serving("s2"), bus.clone()).await.unwrap();
    assert!(
        s2.wait_ready(Duration::from_secs(5)).await,
        "{}",
        s2.shared().readiness().1
    );
    for p in &prompts {
        let want = index_overlaps(&s1, p);
        assert_eq!(want.len(), 1, "{want:?}");
        assert_eq!(want[0].1, 64);
        assert_eq!(index_overlaps(&s2, p), want);
    }
    assert_eq!(
        model_metric(&s2, "kvrouter_approx_record_failures_total"),
        0
    );

    // Later decisions reach both, as before.
    let late = prompt_with_tail(999, 5);
    client
        .route(&route_req("late", late.clone(), true))
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (a, b) = (index_overlaps(&s1, &late), index_overlaps(&s2, &late));
        if !a.is_empty() && a == b {
            break;
        }
        assert!(Instant::now() < deadline, "{a:?} against {b:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // A third one loads from either of them.
    let s3 = Replica::start(serving("s3"), bus.clone()).await.unwrap();
    assert!(s3.wait_ready(Duration::from_secs(5)).await);
    for p in prompts.iter().chain([&late]) {
        assert_eq!(index_overlaps(&s3, p), index_overlaps(&s1, p));
    }
    s3.shutdown().await;
    s2.shutdown().await;
    s1.shutdown().await;
}

/// A serving indexer records published decisions only for registered workers' ranks: one
/// for a worker that left (or that never was) would bring its index state back for good.
#[tokio::test(start_paused = true)]
async fn published_decisions_for_unregistered_ranks_are_not_recorded() {
    let bus = Bus::local();
    let fleet = MockerFleet::start(bus.clone(), fleet_config(WORKERS as u32, 1, 256))
        .await
        .unwrap();
    let s1 = Replica::start(
        ReplicaConfig {
            index: IndexSource::Approx {
                ttl: Duration::from_secs(120),
                serve: true,
            },
            ..approx_config(Duration::from_secs(120))
        },
        bus.clone(),
    )
    .await
    .unwrap();
    assert!(s1.wait_ready(Duration::from_secs(5)).await);
    let subject = Subjects::new("kvrouter")
        .unwrap()
        .model(MODEL)
        .unwrap()
        .indexer_record();
    let publish = |key: WorkerKey, tokens: &[u32]| {
        let local = kvrouter_protocol::local_block_hashes(tokens, BLOCK as usize, None).unwrap();
        let record = kvrouter_protocol::IndexerRecord {
            key,
            sequence_hashes: kvrouter_protocol::sequence_hashes(&local),
            local_hashes: local,
        };
        let (bus, subject) = (bus.clone(), subject.clone());
        async move {
            bus.publish(&subject, kvrouter_protocol::encode(&record).unwrap().into())
                .await
                .unwrap()
        }
    };
    let settled = |records: u64, failures: u64| {
        let s1 = &s1;
        async move {
            let deadline = Instant::now() + Duration::from_secs(5);
            while (
                model_metric(s1, "kvrouter_served_indexer_records_total"),
                model_metric(s1, "kvrouter_approx_record_failures_total"),
            ) != (records, failures)
            {
                assert!(
                    Instant::now() < deadline,
                    "records {records}, failures {failures}"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    let (live, stranger, bad_rank) = (
        WorkerKey::new(10, 0),
        WorkerKey::new(77, 0),
        WorkerKey::new(10, 5),
    );
    publish(live, &prompt_with_tail(1, 3)).await;
    publish(stranger, &prompt_with_tail(2, 3)).await;
    publish(bad_rank, &prompt_with_tail(3, 3)).await;
    settled(1, 2).await;
    assert_eq!(
        index_overlaps(&s1, &prompt_with_tail(1, 3)),
        vec![(live, 3)]
    );
    assert!(index_overlaps(&s1, &prompt_with_tail(2, 3)).is_empty());
    assert!(index_overlaps(&s1, &prompt_with_tail(3, 3)).is_empty());

    // The fleet leaves: its entries go, and a late decision for it does not bring it back.
    fleet.shutdown().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !index_overlaps(&s1, &prompt_with_tail(1, 3)).is_empty() {
        assert!(
            Instant::now() < deadline,
            "the departed worker's entries stay"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    publish(live, &prompt_with_tail(4, 3)).await;
    settled(1, 3).await;
    assert!(index_overlaps(&s1, &prompt_with_tail(4, 3)).is_empty());
    s1.shutdown().await;
}

//! Served and remote indexers on the in-process bus: start-up refusals, a remote replica that
//! routes on load alone while no serving indexer exists, and overlap once one does.

use crate::support::{fleet_config, model_metric, replica_config, BLOCK, MODEL};
use kvrouter_bus::Bus;
use kvrouter_client::{GenerateParams, KvRouterClient};
use kvrouter_mocker::MockerFleet;
use kvrouter_protocol::RouteRequest;
use kvrouter_replica::{
    IndexFlags, IndexSource, RemoteIndex, Replica, ReplicaConfig, ReplicaError,
};
use kvrouter_scheduler::SchedulerConfig;
use std::time::{Duration, Instant};

/// A replica of [`MODEL`] with the id `id`.
fn named_config(id: &str) -> ReplicaConfig {
    ReplicaConfig {
        replica_id: Some(id.into()),
        ..replica_config()
    }
}

async fn refused(config: ReplicaConfig) -> String {
    match Replica::start(config, Bus::local()).await {
        Ok(_) => panic!("started"),
        Err(e) => {
            assert!(matches!(
                e,
                ReplicaError::ServeAndUseRemoteIndexer
                    | ReplicaError::ServeIndexerWithoutOverlap
                    | ReplicaError::ZeroRemoteIndexerTimeout
                    | ReplicaError::ZeroBreakerCooldown
            ));
            e.to_string()
        }
    }
}

#[tokio::test]
async fn conflicting_indexer_settings_are_refused() {
    let e = IndexFlags {
        serve_indexer: true,
        use_remote_indexer: true,
        ..IndexFlags::default()
    }
    .source()
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("--serve-indexer") && e.contains("--use-remote-indexer"),
        "{e}"
    );
    let mut c = named_config("a");
    c.index = IndexSource::Events { serve: true };
    c.scheduler = SchedulerConfig {
        overlap_credit: 0.0,
        ..SchedulerConfig::default()
    };
    let e = refused(c).await;
    assert!(e.contains("--overlap-credit 0"), "{e}");
    let mut c = named_config("a");
    c.index = IndexSource::Remote(RemoteIndex {
        timeout: Duration::ZERO,
        ..RemoteIndex::default()
    });
    let e = refused(c).await;
    assert!(e.contains("--remote-indexer-timeout-ms"), "{e}");
    let mut c = named_config("a");
    c.index = IndexSource::Remote(RemoteIndex {
        breaker_cooldown: Duration::ZERO,
        ..RemoteIndex::default()
    });
    let e = refused(c).await;
    assert!(e.contains("--remote-indexer-breaker-cooldown-ms"), "{e}");
}

/// Two simulated workers (ids 10 and 11) of [`BLOCK`]-token blocks.
async fn two_workers(bus: &Bus) -> MockerFleet {
    MockerFleet::start(bus.clone(), fleet_config(2, 1, 256))
        .await
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_remote_replica_routes_on_load_until_a_serving_indexer_appears() {
    let bus = Bus::local();
    let _fleet = two_workers(&bus).await;
    let mut c = named_config("remote");
    c.index = IndexSource::Remote(RemoteIndex::default());
    let remote = Replica::start(c, bus.clone()).await.unwrap();
    assert!(remote.wait_ready(Duration::from_secs(5)).await);
    let client = KvRouterClient::new(bus.clone(), "kvrouter").unwrap();
    let tokens: Vec<u32> = (0..6 * BLOCK).collect();
    let done = client
        .generate(&GenerateParams::new(MODEL, tokens.clone(), 2))
        .await
        .unwrap();
    let holder = done.decision.key();

    // No serving indexer: routed on load alone (the generate's route too), counted, never
    // failed.
    for _ in 0..5 {
        let d = client
            .route(&RouteRequest::new(MODEL, tokens.clone()))
            .await
            .unwrap();
        assert_eq!(d.overlap_blocks, 0);
    }
    let text = remote.shared().metrics.render();
    assert!(
        text.contains(r#"kvrouter_remote_indexer_fallbacks_total{model="m"} 6"#),
        "{text}"
    );

    // A serving indexer fetches the workers' state; the remote replica's routes find the
    // prefix through it.
    let mut c = named_config("serving");
    c.index = IndexSource::Events { serve: true };
    let serving = Replica::start(c, bus.clone()).await.unwrap();
    assert!(serving.wait_ready(Duration::from_secs(5)).await);
    let remote_index = remote.shared().models[MODEL].remote_index.clone().unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let local = kvrouter_protocol::local_block_hashes(&tokens, BLOCK as usize, None).unwrap();
        if remote_index.find_matches(BLOCK, &local).await.scores == vec![(holder, 6)] {
            break;
        }
        assert!(Instant::now() < deadline, "overlap never came back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!remote_index.is_down());
    serving.shutdown().await;
    remote.shutdown().await;
}

/// Serving indexers share find_matches as a queue group: each lookup is answered by one of
/// them (not by every one), and both take a share.
#[tokio::test(start_paused = true)]
async fn each_lookup_is_answered_by_one_of_the_serving_indexers() {
    let bus = Bus::local();
    let _fleet = two_workers(&bus).await;
    let mut serving = Vec::new();
    for id in ["s1", "s2"] {
        let mut c = named_config(id);
        c.index = IndexSource::Events { serve: true };
        let r = Replica::start(c, bus.clone()).await.unwrap();
        assert!(r.wait_ready(Duration::from_secs(5)).await);
        serving.push(r);
    }
    let mut c = named_config("remote");
    c.index = IndexSource::Remote(RemoteIndex::default());
    let remote = Replica::start(c, bus.clone()).await.unwrap();
    assert!(remote.wait_ready(Duration::from_secs(5)).await);
    let remote_index = remote.shared().models[MODEL].remote_index.clone().unwrap();
    let local = kvrouter_protocol::local_block_hashes(
        &(0..2 * BLOCK).collect::<Vec<_>>(),
        BLOCK as usize,
        None,
    )
    .unwrap();
    let answered = |r: &Replica| model_metric(r, "kvrouter_served_indexer_queries_total");
    // Both subscribe a moment after they turn ready.
    let deadline = Instant::now() + Duration::from_secs(5);
    while serving.iter().any(|r| answered(r) == 0) {
        remote_index.find_matches(BLOCK, &local).await;
        assert!(Instant::now() < deadline, "both serving indexers answer");
    }
    let before: Vec<u64> = serving.iter().map(answered).collect();
    let fallbacks = model_metric(&remote, "kvrouter_remote_indexer_fallbacks_total");
    for _ in 0..40 {
        remote_index.find_matches(BLOCK, &local).await;
    }
    let share: Vec<u64> = serving
        .iter()
        .zip(&before)
        .map(|(r, b)| answered(r) - b)
        .collect();
    assert_eq!(
        share.iter().sum::<u64>(),
        40,
        "one answer per lookup: {share:?}"
    );
    assert!(share.iter().all(|&n| n > 0), "both take a share: {share:?}");
    assert_eq!(
        model_metric(&remote, "kvrouter_remote_indexer_fallbacks_total"),
        fallbacks
    );
    remote.shutdown().await;
    for r in serving {
        r.shutdown().await;
    }
}

#[tokio::test(start_paused = true)]
async fn a_hung_serving_indexer_costs_only_a_few_timeouts_then_overlap_returns() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let bus = Bus::local();
    let _fleet = two_workers(&bus).await;
    // A "serving indexer" that takes every query and never answers.
    let subject = kvrouter_protocol::Subjects::new("kvrouter")
        .unwrap()
        .model(MODEL)
        .unwrap()
        .indexer_find_matches();
    let mut hung_sub = bus
        .queue_subscribe(&subject, kvrouter_protocol::subjects::INDEXER_QUEUE_GROUP)
        .await
        .unwrap();
    let asked = Arc::new(AtomicUsize::new(0));
    let n = asked.clone();
    let hung = tokio::spawn(async move {
        while hung_sub.next().await.is_some() {
            n.fetch_add(1, Ordering::SeqCst);
        }
    });

    let cooldown = Duration::from_millis(800);
    let mut c = named_config("remote");
    c.index = IndexSource::Remote(RemoteIndex {
        timeout: Duration::from_millis(200),
        breaker_failures: 3,
        breaker_cooldown: cooldown,
        publish_decisions: false,
    });
    let remote = Replica::start(c, bus.clone()).await.unwrap();
    assert!(remote.wait_ready(Duration::from_secs(5)).await);
    let client = KvRouterClient::new(bus.clone(), "kvrouter").unwrap();
    let tokens: Vec<u32> = (0..6 * BLOCK).collect();

    // Only the first few routes wait for the timeout; then the breaker skips the lookup.
    const ROUTES: usize = 30;
    let started = Instant::now();
    for _ in 0..ROUTES {
        let d = client
            .route(&RouteRequest::new(MODEL, tokens.clone()))
            .await
            .unwrap();
        assert_eq!(d.overlap_blocks, 0);
    }
    // Three failures, plus at most one probe per cooldown that passed (the margins absorb a
    // slow machine; no wall-clock bound is asserted).
    let probes = (started.elapsed().as_millis() / cooldown.as_millis()) as usize + 1;
    let hits = asked.load(Ordering::SeqCst);
    assert!(hits >= 3, "{hits} lookups reached the hung indexer");
    assert!(
        hits <= 3 + probes && hits < ROUTES / 2,
        "{hits} of {ROUTES} lookups reached the hung indexer ({probes} probes allowed)"
    );
    assert_eq!(
        model_metric(&remote, "kvrouter_remote_indexer_fallbacks_total"),
        ROUTES as u64
    );
    assert_eq!(
        model_metric(&remote, "kvrouter_remote_indexer_skipped_total"),
        (ROUTES - hits) as u64
    );
    assert_eq!(
        model_metric(&remote, "kvrouter_remote_indexer_breaker_open"),
        1
    );

    // The hung indexer is replaced by a real one: a probe is answered and overlap returns.
    hung.abort();
    let _ = hung.await;
    let done = client
        .generate(&GenerateParams::new(MODEL, tokens.clone(), 2))
        .await
        .unwrap();
    let holder = done.decision.key();
    let mut s = named_config("serving");
    s.index = IndexSource::Events { serve: true };
    let serving = Replica::start(s, bus.clone()).await.unwrap();
    assert!(serving.wait_ready(Duration::from_secs(5)).await);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let d = client
            .route(&RouteRequest::new(MODEL, tokens.clone()))
            .await
            .unwrap();
        // The serving replica routes too, from its own index: wait for the remote's answer.
        if d.replica_id == "remote" && (d.key(), d.overlap_blocks) == (holder, 6) {
            break;
        }
        assert!(Instant::now() < deadline, "overlap never came back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        model_metric(&remote, "kvrouter_remote_indexer_breaker_open"),
        0
    );
    assert!(!remote.shared().models[MODEL]
        .remote_index
        .as_ref()
        .unwrap()
        .breaker_open());
    serving.shutdown().await;
    remote.shutdown().await;
}

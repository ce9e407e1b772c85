//! Served and remote indexers on the in-process bus: start-up refusals, a remote replica that
//! routes on load alone while no serving indexer exists, and overlap once one does.

use kvrouter_bus::Bus;
use kvrouter_client::{GenerateParams, KvRouterClient};
use kvrouter_mocker::{EngineConfig, FleetConfig, MockerFleet};
use kvrouter_protocol::RouteRequest;
use kvrouter_replica::{Replica, ReplicaConfig, ReplicaError};
use kvrouter_scheduler::SchedulerConfig;
use std::time::{Duration, Instant};

const MODEL: &str = "m";
const BLOCK: u32 = 16;

fn config(id: &str) -> ReplicaConfig {
    ReplicaConfig {
        replica_id: Some(id.into()),
        models: vec![MODEL.into()],
        discovery_window: Duration::from_millis(100),
        ..ReplicaConfig::default()
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
            ));
            e.to_string()
        }
    }
}

#[tokio::test]
async fn conflicting_indexer_settings_are_refused() {
    let mut c = config("a");
    c.serve_indexer = true;
    c.use_remote_indexer = true;
    let e = refused(c).await;
    assert!(
        e.contains("--serve-indexer") && e.contains("--use-remote-indexer"),
        "{e}"
    );
    let mut c = config("a");
    c.serve_indexer = true;
    c.scheduler = SchedulerConfig {
        overlap_credit: 0.0,
        ..SchedulerConfig::default()
    };
    let e = refused(c).await;
    assert!(e.contains("--overlap-credit 0"), "{e}");
    let mut c = config("a");
    c.use_remote_indexer = true;
    c.remote_indexer_timeout = Duration::ZERO;
    let e = refused(c).await;
    assert!(e.contains("--remote-indexer-timeout-ms"), "{e}");
}

fn route_req(tokens: Vec<u32>) -> RouteRequest {
    RouteRequest {
        model: MODEL.into(),
        request_id: String::new(),
        tokens,
        lora: None,
        allowed_workers: None,
        pin: None,
        update_states: false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_replica_routes_on_load_until_a_serving_indexer_appears() {
    let bus = Bus::local();
    let _fleet = MockerFleet::start(
        bus.clone(),
        FleetConfig {
            model: MODEL.into(),
            workers: 2,
            worker_id_start: 10,
            engine: EngineConfig {
                block_size: BLOCK as usize,
                capacity_blocks: 256,
                ..EngineConfig::default()
            },
            speedup: 1000.0,
            heartbeat_interval: Duration::from_millis(200),
            ..FleetConfig::default()
        },
    )
    .await
    .unwrap();
    let mut c = config("remote");
    c.use_remote_indexer = true;
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
        let d = client.route(&route_req(tokens.clone())).await.unwrap();
        assert_eq!(d.overlap_blocks, 0);
    }
    let text = remote.shared().metrics.render();
    assert!(
        text.contains(r#"kvrouter_remote_indexer_fallbacks_total{model="m"} 6"#),
        "{text}"
    );

    // A serving indexer fetches the workers' state; the remote replica's routes find the
    // prefix through it.
    let mut c = config("serving");
    c.serve_indexer = true;
    let serving = Replica::start(c, bus.clone()).await.unwrap();
    assert!(serving.wait_ready(Duration::from_secs(5)).await);
    let remote_index = remote.shared().models[MODEL].remote_index.clone().unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let local = kvrouter_protocol::local_block_hashes(&tokens, BLOCK as usize, None).unwrap();
        if remote_index.find_matches(BLOCK, &local).await == vec![(holder, 6)] {
            break;
        }
        assert!(Instant::now() < deadline, "overlap never came back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!remote_index.is_down());
    serving.shutdown().await;
    remote.shutdown().await;
}

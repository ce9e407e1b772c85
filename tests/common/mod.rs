//! Helpers for end-to-end tests: the real binary and a real nats-server.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

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

/// A nats-server on a free loopback port, stopped by PID when dropped.
pub struct NatsServer {
    child: Child,
    pub port: u16,
}

impl NatsServer {
    pub fn start() -> Self {
        Self::start_with_args(&[])
    }

    /// Like [`NatsServer::start`], with extra nats-server arguments (e.g. `["--auth", "s3cret"]`).
    /// A free port can be taken by another test before nats-server binds it: then it exits,
    /// and we try again on another port.
    pub fn start_with_args(args: &[&str]) -> Self {
        for _ in 0..5 {
            if let Some(server) = Self::try_start(free_port(), args) {
                return server;
            }
        }
        panic!("nats-server did not start on any of 5 free ports");
    }

    /// A nats-server on the given loopback port (e.g. to restart one where a stopped one ran).
    pub fn start_on_port(port: u16, args: &[&str]) -> Self {
        Self::try_start(port, args).unwrap_or_else(|| panic!("nats-server did not start on {port}"))
    }

    /// Starts nats-server and waits until it, not some other process, answers on `port`
    /// (it is alive and the port speaks NATS); `None` if it exited or never answered.
    fn try_start(port: u16, args: &[&str]) -> Option<Self> {
        let child = Command::new("nats-server")
            .args(["-a", "127.0.0.1", "-p", &port.to_string()])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nats-server on PATH (scripts/test.sh installs it)");
        let mut server = Self { child, port };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if !matches!(server.child.try_wait(), Ok(None)) {
                return None;
            }
            if server.try_info().is_some_and(|l| l.starts_with("INFO")) {
                // The probe is alive and answered: the port is ours unless the child just died.
                if matches!(server.child.try_wait(), Ok(None)) {
                    return Some(server);
                }
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None // Drop kills it.
    }

    fn try_info(&self) -> Option<String> {
        let stream = TcpStream::connect(("127.0.0.1", self.port)).ok()?;
        stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        let mut line = String::new();
        BufReader::new(stream).read_line(&mut line).ok()?;
        Some(line)
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The server's INFO line, as a client sees it on connect.
    pub fn info(&self) -> String {
        self.try_info().expect("the INFO line")
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .arg(self.child.id().to_string())
            .status();
        let _ = self.child.wait();
    }
}

/// A free loopback TCP port (for admin addresses).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// A running `kvrouter` process, killed (SIGKILL) by PID when dropped.
pub struct Proc {
    pub child: Child,
    pub name: String,
}

impl Proc {
    /// Starts `kvrouter ARGS`; stdout is piped (read it with [`Proc::first_line`]).
    pub fn start(name: &str, args: &[&str]) -> Self {
        let child = kvrouter()
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("kvrouter starts");
        Self {
            child,
            name: name.to_string(),
        }
    }

    /// Starts a prepared `kvrouter` command (from [`kvrouter`], with its own env or stderr);
    /// stdout is piped.
    pub fn spawn(name: &str, mut cmd: Command) -> Self {
        let child = cmd.stdout(Stdio::piped()).spawn().expect("kvrouter starts");
        Self {
            child,
            name: name.to_string(),
        }
    }

    /// Waits up to `timeout` for the process to exit (after a signal, say).
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Whether the process is still running.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The first line the process prints on stdout.
    pub fn first_line(&mut self) -> String {
        let out = self.child.stdout.take().expect("stdout piped");
        let mut line = String::new();
        BufReader::new(out).read_line(&mut line).expect("a line");
        line
    }

    /// The first line the process prints on stdout, as JSON.
    pub fn first_json(&mut self) -> serde_json::Value {
        let line = self.first_line();
        serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("{}: first line {line:?} is not JSON: {e}", self.name))
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn signal(&self, sig: &str) {
        let _ = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status();
    }

    /// SIGKILL, then reap.
    pub fn kill(mut self) {
        self.signal("-KILL");
        let _ = self.child.wait();
    }

    /// SIGTERM, then wait up to `timeout` for the exit status.
    pub fn terminate(mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        self.signal("-TERM");
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.signal("-KILL");
            let _ = self.child.wait();
        }
    }
}

/// `GET path` on a loopback port: (status code, body). (0, "") when nothing listens.
pub fn http_get(port: u16, path: &str) -> (u16, String) {
    http_call(
        port,
        &format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"),
    )
}

/// `POST path` with a JSON body and extra headers on a loopback port: (status, body).
/// (0, "") when nothing listens.
pub fn http_post(port: u16, path: &str, headers: &[(&str, &str)], body: &str) -> (u16, String) {
    let mut req = format!(
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    http_call(port, &req)
}

/// Sends one raw HTTP/1.1 request (with `Connection: close`) and reads the whole answer.
fn http_call(port: u16, request: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return (0, String::new());
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
    if s.write_all(request.as_bytes()).is_err() {
        return (0, String::new());
    }
    let mut resp = String::new();
    let _ = s.read_to_string(&mut resp);
    let status = resp
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = resp
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// The first of `n` consecutive free loopback ports (engines that offset ports by rank).
pub fn free_ports(n: u16) -> u16 {
    loop {
        let p = free_port();
        if p < 60000 && (1..n).all(|i| TcpListener::bind(("127.0.0.1", p + i)).is_ok()) {
            return p;
        }
    }
}

/// Gives nats-server time to read the EOF of a process just killed and drop its
/// subscriptions: core request-reply has no redelivery, so a request handed to a dead queue
/// member in that window is lost and its caller times out.
pub fn let_nats_notice() {
    std::thread::sleep(Duration::from_millis(300));
}

/// Polls `f` every 50 ms until it returns true or `timeout` passes; returns the last answer.
pub fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
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
    Proc::start(id, &args)
}

/// `kvrouter mocker --nats URL ARGS...`, named `name` in logs; waits for its start line.
pub fn mocker_with(nats: &NatsServer, name: &str, args: &[&str]) -> Proc {
    let url = nats.url();
    let mut all = vec!["mocker", "--nats", &url];
    all.extend_from_slice(args);
    let mut p = Proc::start(name, &all);
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
    metrics(port)
        .lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
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
    kvrouter_protocol::RouteRequest {
        model: E2E_MODEL.into(),
        request_id: String::new(),
        tokens: tokens.to_vec(),
        lora: None,
        allowed_workers: None,
        pin: None,
        update_states: false,
        extras: None,
        excluded_workers: Vec::new(),
        overrides: None,
        priority_jump: 0.0,
        expected_output_tokens: None,
        call_id: 0,
    }
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

/// `kvrouter bridge` for [`E2E_MODEL`] (block size [`E2E_BLOCK`]) beside an engine, with an
/// admin port and 200 ms heartbeats; returns it and its worker id once it has started.
pub fn bridge(nats: &NatsServer, e: &EngineAt, admin: u16) -> (Proc, u64) {
    bridge_with(nats, e, admin, &[])
}

/// [`bridge`] with more arguments.
pub fn bridge_with(nats: &NatsServer, e: &EngineAt, admin: u16, extra: &[&str]) -> (Proc, u64) {
    let url = nats.url();
    let zmq = format!("tcp://127.0.0.1:{}", e.zmq);
    let base = format!("http://127.0.0.1:{}", e.http);
    let admin = format!("127.0.0.1:{admin}");
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
        &zmq,
        "--dp-size",
        &dp,
        "--capacity-blocks",
        &cap,
        "--base-url",
        &base,
        "--admin-addr",
        &admin,
        "--heartbeat-ms",
        "200",
    ];
    let replay = e.replay.map(|p| format!("tcp://127.0.0.1:{p}"));
    if let Some(r) = &replay {
        args.extend_from_slice(&["--replay-endpoint", r]);
    }
    args.extend_from_slice(extra);
    let mut p = Proc::start("bridge", &args);
    let id = p.first_json()["worker_id"].as_u64().expect("worker_id");
    (p, id)
}

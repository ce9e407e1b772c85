//! One engine's outside for the tests (tests/engines/engine.py): per rank the KV event
//! publisher a pinned vLLM or SGLang release runs, its own classes taken from its wheel
//! (tests/engines/engines.py), or the stand-in for malformed frames; driven by JSON lines.

use super::{free_port, free_ports, repo_file, EngineAt};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

/// The releases the bridge is checked against (docs/operations.md names them).
pub const RELEASES: [&str; 4] = [
    "vllm-0.33.0",
    "vllm-0.26.0",
    "sglang-0.5.23",
    "sglang-0.5.3",
];

/// The current vLLM release: what the bridge's own tests publish with.
pub const VLLM: &str = RELEASES[0];

/// The stand-in publisher: only for what no release sends (malformed frames and payloads).
pub const STANDIN: &str = "standin";

/// Block size the engines publish with (the bridge's `--block-size`).
pub const ENGINE_BLOCK: usize = 16;

pub struct Engine {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    pub release: &'static str,
    pub zmq: u16,
    pub replay: u16,
    pub http: u16,
    pub dp: u32,
}

impl Engine {
    /// `release` with `dp` ranks on free ports, binding its sockets (`tcp://*`).
    pub fn start(release: &'static str, dp: u32) -> Self {
        let ports = [free_ports(dp as u16), free_ports(dp as u16), free_port()];
        Self::spawn(release, ports, dp, &[]).unwrap_or_else(|e| panic!("{release}: {e}"))
    }

    /// `release` with `dp` ranks on these publisher, replay and HTTP ports (rank 0's; the
    /// engine offsets them per rank), with engine.py's `extra` arguments (`--zmq-connect`,
    /// `--ipc-dir=D`, `--hash=bytes`). `Err` with the engine's own error when
    /// it refused the configuration.
    pub fn spawn(
        release: &'static str,
        [zmq, replay, http]: [u16; 3],
        dp: u32,
        extra: &[String],
    ) -> Result<Self, String> {
        let mut child = Command::new("python3")
            .arg(repo_file("tests/engines/engine.py"))
            .args(["--engine", release])
            .args(["--zmq-port", &zmq.to_string()])
            .args(["--replay-port", &replay.to_string()])
            .args(["--http-port", &http.to_string()])
            .args(["--dp-size", &dp.to_string()])
            .args(["--block-size", &ENGINE_BLOCK.to_string()])
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3 runs (source scripts/setup.sh: msgspec, pyzmq, the engines)");
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        let ready: Value = serde_json::from_str(&line).unwrap_or(Value::Null);
        if ready["ready"] != true {
            let _ = child.kill();
            let _ = child.wait();
            return Err(ready["error"].as_str().unwrap_or(&line).to_string());
        }
        Ok(Self {
            child,
            stdin,
            stdout,
            release,
            zmq,
            replay,
            http,
            dp,
        })
    }

    /// `vllm` or `sglang`, as the bridge's `--engine` names it.
    pub fn kind(&self) -> &'static str {
        if self.release.starts_with("sglang") {
            "sglang"
        } else {
            "vllm"
        }
    }

    /// How a bridge finds it (with its replay endpoint or not).
    pub fn at(&self, replay: bool) -> EngineAt {
        EngineAt {
            kind: self.kind(),
            zmq: self.zmq,
            replay: replay.then_some(self.replay),
            http: self.http,
            dp: self.dp,
            capacity_blocks: 1000,
        }
    }

    /// One command and its answer.
    pub fn cmd(&mut self, c: Value) -> Value {
        writeln!(self.stdin, "{c}").unwrap();
        self.stdin.flush().unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{line:?}: {e}"))
    }

    /// A run of full blocks stored (with `with`'s fields: parent, lora, salt, lookahead,
    /// medium), its block hashes as the engine published them.
    pub fn store_with(&mut self, rank: u32, tokens: &[u32], with: Value) -> Vec<Value> {
        let mut c = json!({"rank": rank, "tokens": tokens, "parent": null});
        if let Value::Object(m) = with {
            c.as_object_mut().unwrap().extend(m);
        }
        let v = self.cmd(json!({ "store": c }));
        match v["hashes"].as_array() {
            Some(h) => h.clone(),
            None => panic!("{}: store refused: {v}", self.release),
        }
    }

    /// [`Engine::store_with`] a plain run with no parent.
    pub fn store(&mut self, rank: u32, tokens: &[u32]) -> Vec<Value> {
        self.store_with(rank, tokens, json!({}))
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An engine hash from JSON as the router keeps it (SGLang's are signed 64-bit).
pub fn engine_hash(v: &Value) -> Option<u64> {
    v.as_u64().or_else(|| v.as_i64().map(|i| i as u64))
}

/// A pinned release's own classes reading a KV event stream (tests/engines/decode.py): one
/// JSON value per message, each batch strictly decoded or an `{"error"}`.
pub struct ReleaseReader {
    child: Child,
    lines: std::sync::mpsc::Receiver<Value>,
}

impl ReleaseReader {
    /// Subscribed to `endpoint` once this returns.
    pub fn start(release: &str, endpoint: &str) -> Self {
        let mut child = Command::new("python3")
            .arg(repo_file("tests/engines/decode.py"))
            .args(["--engine", release, "--endpoint", endpoint])
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3 runs");
        let out = BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for l in out.lines().map_while(Result::ok) {
                let v = serde_json::from_str(&l).unwrap_or_else(|_| json!({ "error": l }));
                if tx.send(v).is_err() {
                    return;
                }
            }
        });
        let first = lines.recv_timeout(std::time::Duration::from_secs(20));
        assert!(
            first.as_ref().is_ok_and(|v| v["ready"] == true),
            "decode.py {release}: {first:?}"
        );
        Self { child, lines }
    }

    /// The next message read, if one comes within `wait`.
    pub fn next(&self, wait: std::time::Duration) -> Option<Value> {
        self.lines.recv_timeout(wait).ok()
    }
}

impl Drop for ReleaseReader {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

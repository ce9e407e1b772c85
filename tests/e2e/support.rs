//! What several modules of this suite share: `kvrouter mocker --emulate` engines, and the
//! `openai` SDK as a client.

use crate::common::{kvrouter_proc, repo_file, EngineAt, Proc, E2E_MODEL};
use serde_json::Value;
use std::process::Command;

/// `kvrouter mocker --emulate KIND`: an emulated vLLM or SGLang engine of [`E2E_MODEL`] with
/// 16-token blocks, publishing on `zmq` (a port a rank, then the replay ports) and serving
/// HTTP on `http`.
pub(crate) struct EmulatedEngine {
    pub(crate) proc: Proc,
    pub(crate) http: u16,
    pub(crate) zmq: u16,
    pub(crate) dp: u32,
    pub(crate) kind: &'static str,
    pub(crate) capacity_blocks: u32,
}

/// An emulated engine of 512 blocks a rank at speedup 100, reporting its cached tokens;
/// waits for its start line.
pub(crate) fn emulated_engine(
    kind: &'static str,
    wire: &str,
    dp: u32,
    zmq: u16,
    http: u16,
) -> EmulatedEngine {
    emulated_engine_with(kind, wire, dp, zmq, http, 512, 100, &["--cache-report"])
}

/// [`emulated_engine`] with its capacity, speedup and more arguments.
#[allow(clippy::too_many_arguments)]
pub(crate) fn emulated_engine_with(
    kind: &'static str,
    wire: &str,
    dp: u32,
    zmq: u16,
    http: u16,
    capacity_blocks: u32,
    speedup: u32,
    extra: &[&str],
) -> EmulatedEngine {
    let (z, h, d, c, s) = (
        zmq.to_string(),
        http.to_string(),
        dp.to_string(),
        capacity_blocks.to_string(),
        speedup.to_string(),
    );
    let mut args = vec![
        "mocker",
        "--emulate",
        kind,
        "--zmq-port",
        &z,
        "--http-port",
        &h,
        "--zmq-wire",
        wire,
        "--model",
        E2E_MODEL,
        "--dp-size",
        &d,
        "--block-size",
        "16",
        "--capacity-blocks",
        &c,
        "--speedup",
        &s,
    ];
    args.extend_from_slice(extra);
    let mut p = kvrouter_proc("engine", &args);
    let v = p.first_json();
    assert_eq!(v["base_url"], format!("http://127.0.0.1:{http}"));
    EmulatedEngine {
        proc: p,
        http,
        zmq,
        dp,
        kind,
        capacity_blocks,
    }
}

impl EmulatedEngine {
    /// How a bridge finds it.
    pub(crate) fn at(&self) -> EngineAt {
        EngineAt {
            kind: self.kind,
            zmq: self.zmq,
            replay: Some(self.zmq + self.dp as u16),
            http: self.http,
            dp: self.dp,
            capacity_blocks: self.capacity_blocks,
        }
    }
}

/// Runs one scenario of tests/engines/openai_client.py (the `openai` SDK) against the
/// OpenAI door on `port` and returns its JSON.
pub(crate) fn sdk(scenario: &str, port: u16, args: &[&str]) -> Value {
    let out = Command::new("python3")
        .arg(repo_file("tests/engines/openai_client.py"))
        .args([scenario, &format!("http://127.0.0.1:{port}"), E2E_MODEL])
        .args(args)
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "openai_client.py {scenario} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "openai_client.py {scenario}: not JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

//! `kvrouter bridge` and `kvrouter mocker --emulate` refuse bad flags at once, with one clear
//! line, before touching NATS or binding anything.

use crate::common;

use common::*;
use std::time::{Duration, Instant};

fn bridge_args(zmq: &str, base: &str) -> Vec<String> {
    [
        "bridge",
        "--nats",
        "nats://127.0.0.1:1",
        "--engine",
        "vllm",
        "--model",
        "m",
        "--block-size",
        "16",
        "--zmq-endpoint",
        zmq,
        "--capacity-blocks",
        "1000",
        "--base-url",
        base,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

#[test]
fn bad_bridge_flags_are_refused_before_the_bus() {
    for (zmq, base, says) in [
        ("tcp://*:5557", "http://127.0.0.1:8000", "tcp://HOST:PORT"),
        (
            "tcp://127.0.0.1:5557",
            "https://127.0.0.1:8000",
            "http://HOST",
        ),
    ] {
        let args = bridge_args(zmq, base);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let t = Instant::now();
        let out = run(&args);
        assert!(!out.status.success());
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "took {:?}",
            t.elapsed()
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }
    let out = run(&["bridge", "--engine", "tgi", "--model", "m"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("tgi"));
}

#[test]
fn emulate_needs_its_ports_and_a_known_wire() {
    let out = run(&["mocker", "--emulate", "vllm", "--model", "m"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--zmq-port"));
    let out = run(&[
        "mocker",
        "--emulate",
        "vllm",
        "--model",
        "m",
        "--zmq-port",
        "1",
        "--http-port",
        "2",
        "--zmq-wire",
        "xml",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("array-batch"));
}

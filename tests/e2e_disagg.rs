//! Disaggregated prefill and decode end to end over a real nats-server with the real binary:
//! a prefill pool and a decode pool (data-parallel, tensor-parallel), `kvrouter route
//! --disagg` and `kvrouter generate --disagg`.

mod common;

use common::{free_port, kvrouter, ready, serve, NatsServer, Proc, E2E_MODEL as MODEL};
use serde_json::Value;

/// A mocker pool of one role (block size 16, speedup 100); waits for its start line.
fn pool(nats: &NatsServer, role: &str, first_id: u64, workers: u32, dp: u32, start: u32) -> Proc {
    let url = nats.url();
    let (first, workers, dp, start) = (
        first_id.to_string(),
        workers.to_string(),
        dp.to_string(),
        start.to_string(),
    );
    let mut p = Proc::start(
        role,
        &[
            "mocker",
            "--nats",
            &url,
            "--model",
            MODEL,
            "--role",
            role,
            "--workers",
            &workers,
            "--dp-size",
            &dp,
            "--dp-start-rank",
            &start,
            "--tp-size",
            "2",
            "--block-size",
            "16",
            "--capacity-blocks",
            "512",
            "--speedup",
            "100",
            "--worker-id-start",
            &first,
        ],
    );
    let line = p.first_line();
    assert!(
        line.contains("worker_ids"),
        "{role} pool start line: {line:?}"
    );
    p
}

fn json_of(args: &[&str]) -> Value {
    let out = kvrouter().args(args).output().expect("kvrouter runs");
    assert!(
        out.status.success(),
        "kvrouter {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

#[test]
fn prefill_and_decode_pools_through_the_cli() {
    let nats = NatsServer::start();
    // Prefill: workers 10-11, ranks 2-3. Decode: workers 20-21, ranks 0-3.
    let _prefill = pool(&nats, "prefill", 10, 2, 2, 2);
    let _decode = pool(&nats, "decode", 20, 2, 4, 0);
    let port = free_port();
    let _replica = serve(&nats, "r1", port, &[]);
    assert!(ready(port));
    let url = nats.url();
    let tokens: Vec<String> = (0..128u32).map(|t| (5000 + t).to_string()).collect();
    let tokens = tokens.join(",");
    let base = [
        "--nats",
        url.as_str(),
        "--model",
        MODEL,
        "--tokens",
        tokens.as_str(),
    ];

    let offset_rule = |v: &Value| {
        let (p, d) = (&v["prefill"], &v["decode"]);
        let pw = p["worker_id"].as_u64().unwrap();
        let dw = d["worker_id"].as_u64().unwrap();
        assert!((10..12).contains(&pw), "prefill from the prefill pool: {v}");
        assert!((20..22).contains(&dw), "decode from the decode pool: {v}");
        let pr = p["dp_rank"].as_u64().unwrap();
        assert_eq!(
            d["dp_rank"].as_u64().unwrap(),
            (pr - 2) % 4,
            "rank offset carried over: {v}"
        );
        (pw, pr)
    };

    let mut args = vec!["generate"];
    args.extend_from_slice(&base);
    args.extend_from_slice(&["--disagg", "--max-tokens", "4"]);
    let first = json_of(&args);
    let (pw, pr) = offset_rule(&first);
    assert_eq!(
        first["prefill"]["output_tokens"], 0,
        "prefill computes no tokens"
    );
    assert_eq!(first["decode"]["output_tokens"], 4);
    assert_eq!(first["replica_id"], "r1");

    // The prefix is now cached on the prefill rank: a disaggregated route goes back there.
    let mut args = vec!["route"];
    args.extend_from_slice(&base);
    args.extend_from_slice(&["--disagg", "--no-update-states"]);
    let ok = common::wait_until(std::time::Duration::from_secs(10), || {
        let v = json_of(&args);
        offset_rule(&v);
        v["prefill"]["worker_id"].as_u64() == Some(pw)
            && v["prefill"]["dp_rank"].as_u64() == Some(pr)
            && v["prefill"]["overlap_blocks"].as_u64() == Some(8)
    });
    assert!(
        ok,
        "the repeated prefix goes to the prefill rank that holds it"
    );

    // A plain route of a disaggregated-only model goes to some worker; the aggregated path
    // still answers.
    let mut args = vec!["route"];
    args.extend_from_slice(&base);
    args.push("--no-update-states");
    let plain = json_of(&args);
    assert!(plain["worker_id"].as_u64().is_some(), "{plain}");
}

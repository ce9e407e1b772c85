//! Disaggregated prefill and decode end to end over a real nats-server with the real binary:
//! a prefill pool and a decode pool (data-parallel, tensor-parallel), `kvrouter route
//! --disagg` and `kvrouter generate --disagg`.

use crate::common;

use common::{
    free_port, kvrouter, metrics, ready, serve, E2eClient, NatsServer, Proc, E2E_MODEL as MODEL,
};
use kvrouter_protocol::{DisaggRouteRequest, GenerateEvent, GenerateRequest};
use serde_json::Value;
use std::time::Duration;

/// A mocker pool of one role (tp 2, block size 16, speedup 100) with extra flags; waits for
/// its start line.
fn pool_with(
    nats: &NatsServer,
    role: &str,
    first_id: u64,
    (workers, dp, start): (u32, u32, u32),
    extra: &[&str],
) -> Proc {
    let (first, workers, dp, start) = (
        first_id.to_string(),
        workers.to_string(),
        dp.to_string(),
        start.to_string(),
    );
    let mut args = vec![
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
    ];
    args.extend_from_slice(extra);
    common::mocker_with(nats, role, &args)
}

/// A mocker pool of one role (tp 2, block size 16, speedup 100); waits for its start line.
fn pool(nats: &NatsServer, role: &str, first_id: u64, workers: u32, dp: u32, start: u32) -> Proc {
    pool_with(nats, role, first_id, (workers, dp, start), &[])
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

/// The value of the first `/metrics` sample whose line starts with `series`, 0 if none.
fn sample(port: u16, series: &str) -> f64 {
    metrics(port)
        .lines()
        .find_map(|l| l.strip_prefix(series))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

impl E2eClient {
    /// Routes a disaggregated request (update_states) to `prefill` and decode worker 20, then
    /// runs it on both to its end; returns its request id.
    fn disagg_run(&self, prefill: u64, tokens: Vec<u32>) -> String {
        let req = DisaggRouteRequest {
            model: MODEL.into(),
            request_id: kvrouter_client::new_request_id(),
            tokens,
            lora: None,
            allowed_workers: Some(vec![prefill, 20]),
            update_states: true,
            lease: kvrouter_protocol::Lease::random(),
            trace: None,
        };
        let d = self
            .rt
            .block_on(self.client.route_disagg(&req))
            .expect("route_disagg");
        assert_eq!((d.prefill.worker_id, d.decode.worker_id), (prefill, 20));
        for w in [d.prefill, d.decode] {
            let subject = self
                .client
                .subjects()
                .model(MODEL)
                .unwrap()
                .generate(w.worker_id);
            let run = GenerateRequest {
                request_id: req.request_id.clone(),
                tokens: req.tokens.clone(),
                max_tokens: 2,
                dp_rank: w.dp_rank,
            };
            let payload = kvrouter_protocol::encode(&run).unwrap();
            let done = self.rt.block_on(async {
                let mut s = self
                    .bus()
                    .request_stream(&subject, payload.into(), Duration::from_secs(5))
                    .await
                    .expect("generate");
                let mut done = false;
                while let Some(ev) = s.next().await {
                    let ev: GenerateEvent = kvrouter_protocol::decode(&ev.expect("event")).unwrap();
                    done |= matches!(ev, GenerateEvent::Done { .. });
                }
                done
            });
            assert!(done, "the request ran on worker {}", w.worker_id);
        }
        req.request_id
    }
}

#[test]
fn a_silenced_prefill_tp_rank_holds_the_prefill_load_and_is_overdue() {
    let nats = NatsServer::start();
    // Worker 10's tp rank 1 never reports a KV sent; worker 11 is healthy.
    let _silenced = pool_with(&nats, "prefill", 10, (1, 1, 0), &["--silence-tp-rank", "1"]);
    let _healthy = pool(&nats, "prefill", 11, 1, 1, 0);
    let _decode = pool(&nats, "decode", 20, 1, 1, 0);
    let port = free_port();
    let _replica = serve(&nats, "r1", port, &["--transfer-timeout-secs", "0.5"]);
    assert!(ready(port));
    let client = E2eClient::new(&nats);
    let series = |worker: u64, what: &str| {
        format!(r#"kvrouter_worker_{what}{{model="{MODEL}",worker="{worker}",dp_rank="0"}}"#)
    };
    let overdue = format!(r#"kvrouter_transfers_overdue_total{{model="{MODEL}"}}"#);

    client.disagg_run(10, common::e2e_tokens(1, 4));
    // Load gauges are refreshed periodically.
    let held = || {
        sample(port, &series(10, "active_blocks")) == 4.0
            && sample(port, &series(10, "prefill_tokens")) == 64.0
    };
    assert!(
        common::wait_until(Duration::from_secs(3), held),
        "the prefill half is held:\n{}",
        metrics(port)
    );
    assert!(
        common::wait_until(Duration::from_secs(5), || sample(port, &overdue) == 1.0),
        "the missing Sent report is counted overdue:\n{}",
        metrics(port)
    );
    std::thread::sleep(Duration::from_millis(1000));
    assert_eq!(sample(port, &overdue), 1.0, "reported once");
    assert!(held(), "the prefill half is still held");

    client.disagg_run(11, common::e2e_tokens(2, 4));
    assert!(
        common::wait_until(Duration::from_secs(5), || {
            sample(port, &series(11, "active_blocks")) == 0.0
                && sample(port, &series(11, "prefill_tokens")) == 0.0
        }),
        "all-sent releases the prefill half:\n{}",
        metrics(port)
    );
    std::thread::sleep(Duration::from_millis(1000));
    assert_eq!(
        sample(port, &overdue),
        1.0,
        "a complete transfer is not overdue"
    );
}

//! End to end over a real nats-server with the real binary: serving indexers
//! (`--serve-indexer`) and remote-indexer replicas (`--use-remote-indexer`), losing and
//! regaining serving indexers, approximate mode through published decisions, and the
//! start-up refusals.

use crate::common;

use common::{
    e2e_tokens as tokens, free_port, let_nats_notice, metrics, ready, serve, wait_until,
    E2eClient as Client, NatsServer, E2E_BLOCK as BLOCK, E2E_MODEL as MODEL,
};
use kvrouter_protocol::{RouteRequest, WorkerKey};
use std::collections::HashSet;
use std::time::Duration;

/// The value of a counter series (0 when absent).
fn counter(port: u16, series: &str) -> f64 {
    metrics(port)
        .lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

impl Client {}

fn request(tokens: &[u32], request_id: &str) -> RouteRequest {
    RouteRequest::new(MODEL, tokens.to_vec())
        .with_request_id(request_id)
        .with_update_states(!request_id.is_empty())
}

/// Routes `n` times; every answer must go to `holder` with `overlap`; returns who answered.
fn routes_like_one_replica(
    c: &Client,
    prompt: &[u32],
    n: usize,
    holder: WorkerKey,
    overlap: u32,
) -> HashSet<String> {
    let mut answered_by = HashSet::new();
    for _ in 0..n {
        let d = c.route(prompt);
        assert_eq!(
            (d.key(), d.overlap_blocks),
            (holder, overlap),
            "answer of {}",
            d.replica_id
        );
        answered_by.insert(d.replica_id);
    }
    answered_by
}

fn set(ids: &[&str]) -> HashSet<String> {
    ids.iter().map(|s| s.to_string()).collect()
}

/// The disconnect of a killed process reaches the NATS server a moment after the process is
/// reaped; give it that moment before asserting that its queue-group share moved on.
const FALLBACKS: &str = r#"kvrouter_remote_indexer_fallbacks_total{model="Qwen/Qwen3-0.6B"}"#;
const QUERIES: &str = r#"kvrouter_remote_indexer_queries_total{model="Qwen/Qwen3-0.6B"}"#;

#[test]
fn remote_replicas_route_like_one_and_survive_losing_serving_indexers() {
    let nats = NatsServer::start();
    let _fleet = common::mocker(&nats, 100, 2, 2, BLOCK);
    let (ps1, pr1, pr2, ps2, ps3) = (
        free_port(),
        free_port(),
        free_port(),
        free_port(),
        free_port(),
    );
    let s1 = serve(&nats, "s1", ps1, &["--serve-indexer"]);
    let _r1 = serve(&nats, "r1", pr1, &["--use-remote-indexer"]);
    let _r2 = serve(&nats, "r2", pr2, &["--use-remote-indexer"]);
    assert!(
        ready(ps1) && ready(pr1) && ready(pr2),
        "replicas turn ready"
    );
    let c = Client::new(&nats);

    // One serving and two remote replicas route a repeated prefix to its holder with its
    // overlap, like a single replica.
    let prompt = tokens(1, 8);
    let holder = c.generate(&prompt, None).decision.key();
    assert!(
        wait_until(Duration::from_secs(10), || (0..10)
            .all(|_| c.route(&prompt).overlap_blocks == 8)),
        "the repeated prefix is seen with its full overlap"
    );
    let fallbacks = counter(pr1, FALLBACKS) + counter(pr2, FALLBACKS);
    let by = routes_like_one_replica(&c, &prompt, 40, holder, 8);
    assert!(
        by.contains("r1") && by.contains("r2"),
        "both remote replicas answered: {by:?}"
    );
    assert!(counter(pr1, QUERIES) + counter(pr2, QUERIES) > 0.0);
    assert_eq!(
        counter(pr1, FALLBACKS) + counter(pr2, FALLBACKS),
        fallbacks,
        "every query was answered"
    );
    // A remote replica consumes no KV events and fetches no worker state.
    let m = metrics(pr1);
    assert!(
        !m.contains(r#"kvrouter_kv_events_applied_total{model="Qwen/Qwen3-0.6B"}"#),
        "{m}"
    );
    assert!(
        !m.contains(r#"kvrouter_state_recoveries_total{model="Qwen/Qwen3-0.6B"}"#),
        "{m}"
    );

    // Without a serving indexer the remote replicas keep routing, on load alone.
    s1.kill();
    let_nats_notice();
    for _ in 0..20 {
        let d = c.route(&prompt);
        assert_eq!(d.overlap_blocks, 0, "no overlap without an index");
        assert!(d.replica_id == "r1" || d.replica_id == "r2");
    }
    assert!(counter(pr1, FALLBACKS) + counter(pr2, FALLBACKS) >= fallbacks + 20.0);
    assert!(
        ready(pr1) && ready(pr2),
        "a lost indexer does not make them unready"
    );

    // New serving replicas sync the workers' state; overlap comes back by itself.
    let s2 = serve(&nats, "s2", ps2, &["--serve-indexer"]);
    let _s3 = serve(&nats, "s3", ps3, &["--serve-indexer"]);
    assert!(ready(ps2) && ready(ps3));
    assert!(
        wait_until(Duration::from_secs(10), || (0..10)
            .all(|_| c.route(&prompt).overlap_blocks == 8)),
        "overlap-aware routing resumes"
    );
    let by = routes_like_one_replica(&c, &prompt, 40, holder, 8);
    assert!(by.contains("r1") || by.contains("r2"), "{by:?}");

    // With two serving indexers, losing one costs nothing.
    let fallbacks = counter(pr1, FALLBACKS) + counter(pr2, FALLBACKS);
    s2.kill();
    let_nats_notice();
    let by = routes_like_one_replica(&c, &prompt, 40, holder, 8);
    assert!(by.is_subset(&set(&["r1", "r2", "s3"])), "{by:?}");
    assert_eq!(
        counter(pr1, FALLBACKS) + counter(pr2, FALLBACKS),
        fallbacks,
        "no query fell back"
    );
}

#[test]
fn approximate_mode_decisions_reach_every_serving_indexer() {
    let nats = NatsServer::start();
    let _fleet = common::mocker(&nats, 100, 2, 1, BLOCK);
    let (ps1, ps2, pr1) = (free_port(), free_port(), free_port());
    let approx_serve = ["--serve-indexer", "--no-kv-events"];
    let s1 = serve(&nats, "s1", ps1, &approx_serve);
    let s2 = serve(&nats, "s2", ps2, &approx_serve);
    let _r1 = serve(
        &nats,
        "r1",
        pr1,
        &["--use-remote-indexer", "--no-kv-events"],
    );
    assert!(ready(ps1) && ready(ps2) && ready(pr1));
    let c = Client::new(&nats);

    // One decision that updates state, made by whichever replica: published, it is recorded
    // on both serving indexers.
    let prompt = tokens(7, 6);
    let first = c.route_req(request(&prompt, "req-1")).expect("route");
    let holder = first.key();
    // Finished: its load would otherwise cancel what the cached prefix saves.
    let booking = kvrouter_client::Booking::new(&first, MODEL, "req-1");
    c.rt.block_on(c.client.free(&booking)).expect("free");
    let records = r#"kvrouter_served_indexer_records_total{model="Qwen/Qwen3-0.6B"}"#;
    assert!(
        wait_until(Duration::from_secs(5), || counter(ps1, records) >= 1.0
            && counter(ps2, records) >= 1.0),
        "both serving indexers recorded the decision"
    );
    assert!(
        wait_until(Duration::from_secs(5), || (0..10)
            .all(|_| c.route(&prompt).overlap_blocks == 6)),
        "every replica sees the decision"
    );
    let fallbacks = counter(pr1, FALLBACKS);
    let by = routes_like_one_replica(&c, &prompt, 30, holder, 6);
    assert!(by.contains("r1"), "{by:?}");

    // Either serving indexer alone knows it.
    s1.kill();
    let_nats_notice();
    let by = routes_like_one_replica(&c, &prompt, 20, holder, 6);
    assert!(by.is_subset(&set(&["s2", "r1"])), "{by:?}");
    assert_eq!(counter(pr1, FALLBACKS), fallbacks, "no query fell back");

    // A serving indexer started now loads s2's entries (it saw no decision itself), so the
    // decision survives losing s2 too.
    let ps3 = free_port();
    let _s3 = serve(&nats, "s3", ps3, &approx_serve);
    assert!(ready(ps3));
    s2.kill();
    let_nats_notice();
    let by = routes_like_one_replica(&c, &prompt, 20, holder, 6);
    assert!(by.is_subset(&set(&["s3", "r1"])), "{by:?}");
    assert_eq!(counter(pr1, FALLBACKS), fallbacks, "no query fell back");
}

#[test]
fn conflicting_indexer_flags_are_refused_at_start() {
    // Nothing listens there: the flags must be refused before the replica needs the bus.
    let url = format!("nats://127.0.0.1:{}", free_port());
    let run = |extra: &[&str]| {
        let mut args = vec!["serve", "--nats", &url, "--model", MODEL];
        args.extend_from_slice(extra);
        common::run(&args)
    };
    let refused = |extra: &[&str], names: &[&str]| {
        let out = run(extra);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{extra:?} was accepted");
        assert!(!err.contains("cannot connect"), "{extra:?}: {err}");
        for name in names {
            assert!(err.contains(name), "{extra:?}: {err}");
        }
    };
    refused(
        &["--serve-indexer", "--use-remote-indexer"],
        &["--serve-indexer", "--use-remote-indexer"],
    );
    refused(
        &["--serve-indexer", "--overlap-credit", "0"],
        &["--serve-indexer", "--overlap-credit 0"],
    );
    refused(
        &["--use-remote-indexer", "--remote-indexer-timeout-ms", "0"],
        &["--remote-indexer-timeout-ms"],
    );
    // A valid combination gets as far as the bus (so the refusals above are the flags').
    let out = run(&["--serve-indexer"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("cannot connect"),
        "{err}"
    );
}

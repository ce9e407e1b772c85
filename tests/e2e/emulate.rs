//! `kvrouter mocker --emulate` as a vLLM or SGLang engine, behind a real `kvrouter bridge`,
//! feeding real `serve` replicas over a real nats-server: the whole engine-facing path with
//! the real binaries only.

use crate::common;

use crate::support::{emulated_engine, emulated_engine_with, EmulatedEngine};
use common::engine::{engine_hash, ReleaseReader};
use common::*;
use kvrouter_protocol::{OverlapRequest, RouteOverrides, TierBlocks, WorkerKey};
use serde_json::{json, Value};
use std::process::Command;
use std::time::{Duration, Instant};

/// A completion on rank `rank` of the engine, as a frontend sends it after a route.
fn complete(e: &EmulatedEngine, rank: u32, prompt: &[u32]) -> Value {
    complete_n(e, rank, prompt, 2)
}

fn complete_n(e: &EmulatedEngine, rank: u32, prompt: &[u32], max_tokens: u32) -> Value {
    let r = rank.to_string();
    let (headers, body) = match e.kind {
        "sglang" => (
            vec![],
            json!({"model": E2E_MODEL, "prompt": prompt, "max_tokens": max_tokens, "routed_dp_rank": rank}),
        ),
        _ => (
            vec![("X-data-parallel-rank", r.as_str())],
            json!({"model": E2E_MODEL, "prompt": prompt, "max_tokens": max_tokens}),
        ),
    };
    let (status, body) = http_post(e.http, "/v1/completions", &headers, &body.to_string());
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// Blocks as `[engine hash, parent engine hash, local hash]`, sorted.
fn blocks_of(body: &str) -> Vec<Value> {
    let v: Value = serde_json::from_str(body).unwrap_or(Value::Null);
    let mut b = v["blocks"].as_array().cloned().unwrap_or_default();
    b.sort_by_key(|x| x.to_string());
    b
}

/// What the engine caches on `rank` (its test hook).
fn engine_cache(e: &EmulatedEngine, rank: u32) -> Vec<Value> {
    blocks_of(&http_get(e.http, &format!("/kvrouter/test/cache?dp_rank={rank}")).1)
}

/// What a replica's index holds for `rank` (its admin `/debug/rank`).
fn index_of(admin: u16, worker: u64, rank: u32) -> Vec<Value> {
    let model = E2E_MODEL.replace('/', "%2F");
    let path = format!("/debug/rank?model={model}&worker={worker}&dp_rank={rank}");
    blocks_of(&http_get(admin, &path).1)
}

/// The emulated engines' frames read by each release's own classes (strictly: every field's
/// type checked): the emulation cannot drift from what the engines send. Each form the
/// mocker offers for a release decodes, and the blocks read are the blocks the engine holds.
#[test]
fn emulated_frames_decode_with_the_engines_own_classes() {
    for (kind, wire, release) in [
        ("vllm", "array-batch", "vllm-0.33.0"),
        ("vllm", "array-batch", "vllm-0.26.0"),
        ("sglang", "array-batch", "sglang-0.5.23"),
        ("sglang", "array", "sglang-0.5.3"),
    ] {
        let (zmq, http) = (free_ports(2), free_port());
        let e = emulated_engine(kind, wire, 1, zmq, http);
        let reader = ReleaseReader::start(release, &format!("tcp://127.0.0.1:{zmq}"));
        let a = e2e_tokens(1, 4);
        complete(&e, 0, &a);
        let held: Vec<u64> = engine_cache(&e, 0)
            .iter()
            .map(|b| engine_hash(&b[0]).unwrap())
            .collect();
        assert_eq!(held.len(), 4, "{release}");
        let mut stored = Vec::new();
        while stored.len() < held.len() {
            let Some(m) = reader.next(Duration::from_secs(10)) else {
                panic!("{release}: {} of the blocks read", stored.len())
            };
            assert!(m.get("error").is_none(), "{kind} {wire} as {release}: {m}");
            assert_eq!(m["rank"], 0, "{release}: {m}");
            for ev in m["events"].as_array().unwrap() {
                if ev["type"] == "BlockStored" {
                    assert_eq!(ev["block_size"], 16, "{release}: {ev}");
                    let hashes = ev["hashes"].as_array().unwrap();
                    stored.extend(hashes.iter().map(|h| engine_hash(h).unwrap()));
                }
            }
        }
        let (mut stored, mut held) = (stored, held);
        stored.sort_unstable();
        held.sort_unstable();
        assert_eq!(stored, held, "{release}");
    }
}

#[test]
fn emulated_vllm_behind_a_bridge_routes_replays_restarts_and_dies_cleanly() {
    scenario("vllm", "array-batch");
}

#[test]
fn emulated_sglang_the_same() {
    scenario("sglang", "array");
}

/// A repeated prefix goes to its holder; dropped batches are replayed and every replica then
/// equals the engine; a killed engine leaves routing within about a second of its health
/// check; a restarted one's old blocks disappear on every rank; a killed bridge's worker
/// leaves within its lease.
fn scenario(kind: &'static str, wire: &str) {
    let nats = NatsServer::start();
    let (zmq, http) = (free_ports(4), free_port());
    let mut e = emulated_engine(kind, wire, 2, zmq, http);
    let (a1, a2) = (free_port(), free_port());
    let _r1 = serve(&nats, "r1", a1, &[]);
    let _r2 = serve(&nats, "r2", a2, &[]);
    let (b, worker, ab) = bridge(&nats, &e.at());
    assert!(ready(ab), "bridge: {:?}", http_get(ab, "/readyz"));
    assert!(ready(a1) && ready(a2));
    let client = E2eClient::new(&nats);
    let (k0, k1) = (WorkerKey::new(worker, 0), WorkerKey::new(worker, 1));

    // A prompt served by rank 1: every replica sees its blocks there; a repeat of it is
    // routed to its holder with full overlap, with the engine's address.
    let a = e2e_tokens(1, 4);
    let first = complete(&e, 1, &a);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert!(client.overlap_becomes(&a, k1, 4));
    let d = client.route_tokens(&a).expect("a route");
    assert_eq!((d.worker_id, d.dp_rank, d.overlap_blocks), (worker, 1, 4));
    assert_eq!(d.base_url, format!("http://127.0.0.1:{http}"));
    let again = complete(&e, d.dp_rank, &a);
    // Cached: every block but the last, which the engine computes again (as vLLM does, so
    // that at least one token is prefilled).
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"], 48,
        "{again}"
    );

    // Streaming through a real HTTP client.
    let out = Command::new("curl")
        .args(["-sN", "-H", "X-data-parallel-rank: 0", "-d"])
        .arg(json!({"model": E2E_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": true}).to_string())
        .arg(format!("http://127.0.0.1:{http}/v1/chat/completions"))
        .output()
        .expect("curl runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.matches("chat.completion.chunk").count(), 4, "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");

    // Rank 0's next two batches are lost on the wire; the one after reveals the gap and the
    // bridge replays both.
    let warm = e2e_tokens(9, 1);
    complete(&e, 0, &warm);
    assert!(client.overlap_becomes(&warm, k0, 1));
    let drop = json!({"dp_rank": 0, "count": 2}).to_string();
    let (status, body) = http_post(http, "/kvrouter/test/drop", &[], &drop);
    assert_eq!(status, 200, "{body}");
    let (pb, pc, pd) = (e2e_tokens(2, 3), e2e_tokens(3, 2), e2e_tokens(4, 2));
    complete(&e, 0, &pb);
    complete(&e, 0, &pc);
    complete(&e, 0, &pd);
    assert!(client.overlap_becomes(&pb, k0, 3), "replayed");
    assert!(client.overlap_becomes(&pc, k0, 2), "replayed");
    assert!(client.overlap_becomes(&pd, k0, 2));
    let m = http_get(ab, "/metrics").1;
    assert!(
        m.contains("kvrouter_bridge_gaps_replayed_total{dp_rank=\"0\"} 1"),
        "{m}"
    );
    // And every replica's index now holds exactly what the engine caches, rank by rank.
    for rank in 0..2 {
        for admin in [a1, a2] {
            assert!(
                wait_until(Duration::from_secs(10), || {
                    let (engine_side, index_side) =
                        (engine_cache(&e, rank), index_of(admin, worker, rank));
                    !engine_side.is_empty() && engine_side == index_side
                }),
                "rank {rank}: engine {:?} vs replica {:?}",
                engine_cache(&e, rank),
                index_of(admin, worker, rank)
            );
        }
    }

    // The engine is killed: within about a second of its health check failing nobody
    // routes to it.
    e.proc.signal(libc::SIGKILL);
    let t = Instant::now();
    assert!(wait_until(Duration::from_secs(5), || client
        .route_tokens(&a)
        .is_none()));
    let took = t.elapsed();
    assert!(
        took < Duration::from_millis(1500),
        "still routable {took:?} after the kill"
    );

    // It comes back on the same ports (a restart: new process, sequence numbers from 0,
    // an empty cache): the old blocks are gone everywhere, the new ones arrive.
    // Its first batch may go out before the bridge has reconnected; the next one shows the
    // restart and the bridge replays what it missed from the new process's buffer.
    let mut e = emulated_engine(kind, wire, 2, zmq, http);
    let fresh = e2e_tokens(5, 2);
    assert!(wait_until(Duration::from_secs(10), || client
        .route_tokens(&fresh)
        .is_some()));
    complete(&e, 1, &fresh);
    // New prompts until one shows up (an engine publishes only what it newly caches).
    let mut seed = 100;
    assert!(wait_until(Duration::from_secs(10), || {
        seed += 1;
        let next = e2e_tokens(seed, 1);
        complete(&e, 1, &next);
        std::thread::sleep(Duration::from_millis(100));
        client.overlap(&next, k1) == 1
    }));
    assert!(client.overlap_becomes(&fresh, k1, 2));
    assert!(
        client.overlap_becomes(&a, k1, 0),
        "the dead engine's blocks"
    );
    // Its other rank's blocks went with it, though that rank has published nothing since.
    assert!(
        client.overlap_becomes(&pb, k0, 0),
        "the other rank's old blocks"
    );
    let m = http_get(ab, "/metrics").1;
    assert!(m.contains("kvrouter_bridge_engine_restarts_total 1"), "{m}");

    // A killed bridge's worker leaves within its lease.
    b.kill();
    assert!(wait_until(Duration::from_secs(10), || client
        .route_tokens(&fresh)
        .is_none()));
    e.proc.signal(libc::SIGTERM);
}

#[test]
fn emulated_sglang_behind_a_bridge() {
    let nats = NatsServer::start();
    let (zmq, http) = (free_ports(4), free_port());
    // The third wire form: a map batch of map events.
    let e = emulated_engine("sglang", "map", 2, zmq, http);
    let a1 = free_port();
    let _r1 = serve(&nats, "r1", a1, &[]);
    let (_b, worker, ab) = bridge(&nats, &e.at());
    assert!(ready(ab) && ready(a1));
    let client = E2eClient::new(&nats);
    let a = e2e_tokens(7, 3);
    complete(&e, 1, &a);
    assert!(client.overlap_becomes(&a, WorkerKey::new(worker, 1), 3));
    let d = client.route_tokens(&a).expect("a route");
    assert_eq!((d.dp_rank, d.overlap_blocks), (1, 3));
    // SGLang's metric names reach the bridge's load figures.
    let m = http_get(e.http, "/metrics").1;
    assert!(m.contains("sglang:num_queue_reqs{dp_rank=\"1\""), "{m}");
}

/// What every replica answering overlap queries says `key` holds of `tokens`, by tier.
fn tiers(c: &E2eClient, tokens: &[u32], key: WorkerKey) -> TierBlocks {
    let req = OverlapRequest {
        model: E2E_MODEL.into(),
        tokens: tokens.to_vec(),
        lora: None,
    };
    let reply =
        c.rt.block_on(c.client.overlap_scores(&req))
            .expect("overlap_scores");
    // Ranks a lower tier extends are listed by tier; the others have their device overlap
    // (and the model's shared-storage overlap).
    let device = reply
        .scores
        .iter()
        .find(|(k, _)| *k == key)
        .map_or(0, |s| s.1);
    reply
        .tier_overlap_blocks
        .iter()
        .find(|(k, _)| *k == key)
        .map_or(
            TierBlocks {
                shared: reply.shared_blocks,
                ..TierBlocks::on_device(device)
            },
            |t| t.1,
        )
}

fn route_with(
    c: &E2eClient,
    tokens: &[u32],
    overrides: Option<RouteOverrides>,
) -> kvrouter_protocol::RouteDecision {
    c.route_req(plain_route(tokens).with_overrides(overrides))
        .expect("a route")
}

/// An emulated vLLM with a host tier behind a bridge: a prefix the device evicted is
/// reported with medium CPU, still routed to its holder, credited by the host weight (a lower
/// weight per request sends it to a shorter device prefix instead), reported by tier in the
/// decision, loaded back by the engine, and counted in the replica's tier metrics.
#[test]
fn emulated_vllm_with_a_host_tier_routes_offloaded_prefixes_to_their_holder() {
    let nats = NatsServer::start();
    let (zmq, http) = (free_ports(4), free_port());
    // 16 device blocks a rank, 64 in host memory.
    let e = emulated_engine_with(
        "vllm",
        "array-batch",
        2,
        zmq,
        http,
        16,
        100,
        &["--host-capacity-blocks", "64", "--cache-report"],
    );
    let a1 = free_port();
    let _r1 = serve(&nats, "r1", a1, &[]);
    let (_b, worker, ab) = bridge_with(&nats, &e.at(), &["--host-capacity-blocks", "64"]);
    assert!(ready(ab) && ready(a1));
    let c = E2eClient::new(&nats);
    let (k0, k1) = (WorkerKey::new(worker, 0), WorkerKey::new(worker, 1));

    // A (8 blocks) on rank 1, then B fills rank 1's device and pushes A to its host memory.
    let a = e2e_tokens(1, 8);
    complete(&e, 1, &a);
    assert!(c.overlap_becomes(&a, k1, 8));
    complete_n(&e, 1, &e2e_tokens(2, 16), 1);
    let on_host = TierBlocks {
        host: 8,
        ..TierBlocks::default()
    };
    assert!(
        wait_until(Duration::from_secs(10), || tiers(&c, &a, k1) == on_host),
        "A on rank 1's host: {:?}",
        tiers(&c, &a, k1)
    );
    // Rank 0 holds A's first 4 blocks on its device.
    complete(&e, 0, &a[..4 * E2E_BLOCK + 3]);
    assert!(c.overlap_becomes(&a, k0, 4));

    // 8 host blocks at 0.75 (6) beat 4 device blocks: A goes to its holder, reported by tier.
    let d = route_with(&c, &a, None);
    assert_eq!(
        (d.worker_id, d.dp_rank, d.overlap_blocks),
        (worker, 1, 0),
        "{d:?}"
    );
    assert_eq!(d.tier_overlap_blocks, on_host);
    // At 0.25 (2) they do not.
    let low = RouteOverrides {
        host_cache_hit_weight: Some(0.25),
        ..RouteOverrides::default()
    };
    let d = route_with(&c, &a, Some(low));
    assert_eq!((d.dp_rank, d.overlap_blocks), (0, 4), "{d:?}");
    assert_eq!(d.tier_overlap_blocks, TierBlocks::on_device(4));

    // The engine loads A back from its host memory (all but the last block, which it
    // computes again) and the replica sees it back on the device.
    let out = complete(&e, 1, &a);
    assert_eq!(
        out["usage"]["prompt_tokens_details"]["cached_tokens"],
        7 * E2E_BLOCK,
        "{out}"
    );
    assert!(
        wait_until(Duration::from_secs(10), || tiers(&c, &a, k1)
            == TierBlocks::on_device(8)),
        "A back on rank 1's device: {:?}",
        tiers(&c, &a, k1)
    );
    let m = http_get(a1, "/metrics").1;
    assert!(
        m.lines().any(
            |l| l.starts_with("kvrouter_route_tier_hits_total") && l.contains(r#"tier="host""#)
        ),
        "{m}"
    );
    let bridge_metrics = http_get(ab, "/metrics").1;
    let skipped = bridge_metrics
        .lines()
        .filter(|l| l.starts_with("kvrouter_bridge_events_skipped_total") && !l.ends_with(" 0"))
        .collect::<Vec<_>>();
    assert!(skipped.is_empty(), "{skipped:?}");
    // Every tier the engine holds, the replica holds (the engine's hook and the replica's
    // debug endpoint list device and lower-tier blocks alike, with their tier).
    for rank in 0..2 {
        assert!(
            wait_until(Duration::from_secs(10), || engine_cache(&e, rank)
                == index_of(a1, worker, rank)),
            "rank {rank}: engine {:?} vs replica {:?}",
            engine_cache(&e, rank),
            index_of(a1, worker, rank)
        );
    }
    assert!(
        engine_cache(&e, 1).iter().any(|b| b[3] == "host"),
        "B's evicted blocks are on the host"
    );
}

/// A bridge killed and started again beside an engine that kept running (and caching): the
/// new bridge knows nothing of the engine's cache, and the engine publishes nothing until it
/// caches something new. It catches up from the engine's replay buffer at once, so with no
/// further traffic every replica again holds exactly what the engine caches on every rank.
#[test]
fn a_bridge_restarted_beside_a_running_engine_rebuilds_its_cache_from_the_replay_buffer() {
    let nats = NatsServer::start();
    let (zmq, http) = (free_ports(4), free_port());
    let e = emulated_engine("vllm", "array-batch", 2, zmq, http);
    let (a1, a2) = (free_port(), free_port());
    let _r1 = serve(&nats, "r1", a1, &[]);
    let _r2 = serve(&nats, "r2", a2, &[]);
    let (b, worker, ab) = bridge(&nats, &e.at());
    assert!(ready(ab) && ready(a1) && ready(a2));
    let client = E2eClient::new(&nats);
    // Both ranks cache something while the first bridge listens.
    for (rank, seed) in [(0, 1), (1, 2), (0, 3)] {
        complete(&e, rank, &e2e_tokens(seed, 3));
    }
    let same = |admin: u16, rank: u32| {
        let engine_side = engine_cache(&e, rank);
        !engine_side.is_empty() && engine_side == index_of(admin, worker, rank)
    };
    for rank in 0..2 {
        assert!(wait_until(Duration::from_secs(10), || same(a1, rank)));
    }
    b.kill();
    // The worker leaves within its lease, so the new bridge's worker starts from nothing.
    let probe = e2e_tokens(1, 3);
    assert!(wait_until(Duration::from_secs(10), || client
        .route_tokens(&probe)
        .is_none()));
    // And the engine caches more while no bridge listens.
    complete(&e, 1, &e2e_tokens(4, 2));
    let (_b, again, ab) = bridge(&nats, &e.at());
    assert_eq!(
        again, worker,
        "the worker id derives from the engine's address"
    );
    assert!(ready(ab));
    for rank in 0..2 {
        for admin in [a1, a2] {
            assert!(
                wait_until(Duration::from_secs(10), || same(admin, rank)),
                "rank {rank}: engine {:?} vs replica {:?}",
                engine_cache(&e, rank),
                index_of(admin, worker, rank)
            );
        }
    }
    let m = http_get(ab, "/metrics").1;
    let caught_up: u64 = m
        .lines()
        .filter(|l| l.starts_with("kvrouter_bridge_batches_caught_up_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum();
    assert!(caught_up >= 4, "{m}");
    // The repeat of a prefix cached before the restart is routed to its holder.
    let d = client.route_tokens(&probe).expect("a route");
    assert_eq!((d.worker_id, d.dp_rank, d.overlap_blocks), (worker, 0, 3));
}

/// Usage as the engines send it: cached tokens only from an engine started to report them
/// (vLLM's `--enable-prompt-tokens-details`, SGLang's `--enable-cache-report`; otherwise
/// `prompt_tokens_details` is null), and a streamed answer's usage only when the request
/// asked for it, in a chunk of its own with no choices.
#[test]
fn emulated_engines_report_usage_as_the_engines_do() {
    for (kind, wire) in [("vllm", "array-batch"), ("sglang", "map")] {
        let (zmq, http) = (free_ports(4), free_port());
        let quiet = emulated_engine_with(kind, wire, 1, zmq, http, 512, 100, &[]);
        let a = e2e_tokens(1, 2);
        let whole = complete(&quiet, 0, &a);
        assert_eq!(whole["usage"]["prompt_tokens"], 32, "{kind}: {whole}");
        assert!(
            whole["usage"]["prompt_tokens_details"].is_null(),
            "{kind}: {whole}"
        );
        let stream = |options: Value| {
            let mut body =
                json!({"model": E2E_MODEL, "prompt": a, "max_tokens": 2, "stream": true});
            if !options.is_null() {
                body["stream_options"] = options;
            }
            let (status, text) = http_post(quiet.http, "/v1/completions", &[], &body.to_string());
            assert_eq!(status, 200, "{kind}: {text}");
            let events: Vec<Value> = text
                .lines()
                .filter_map(|l| l.strip_prefix("data: "))
                .filter_map(|d| serde_json::from_str(d).ok())
                .collect();
            assert!(text.contains("data: [DONE]"), "{kind}: {text}");
            events
        };
        for options in [Value::Null, json!({"include_usage": false})] {
            let events = stream(options);
            assert!(events.len() >= 3, "{kind}: {events:?}");
            assert!(
                events.iter().all(|e| e.get("usage").is_none()),
                "{kind}: usage nobody asked for: {events:?}"
            );
        }
        let events = stream(json!({"include_usage": true}));
        let with_usage: Vec<&Value> = events.iter().filter(|e| e.get("usage").is_some()).collect();
        assert_eq!(with_usage.len(), 1, "{kind}: {events:?}");
        assert_eq!(with_usage[0]["choices"], json!([]), "{kind}");
        assert_eq!(with_usage[0]["usage"]["completion_tokens"], 2, "{kind}");
        assert!(
            std::ptr::eq(with_usage[0], events.last().unwrap()),
            "{kind}: the usage chunk comes last"
        );
    }
}

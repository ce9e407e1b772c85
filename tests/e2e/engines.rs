//! Conformance: the KV event publishers of the vLLM and SGLang releases the bridge supports
//! (their own classes, from their wheels: tests/engines/engine.py), publishing into the real
//! bridge, read back from a real replica. What each release can say is said: chains across
//! runs, removals, AllBlocksCleared, LoRA names, salts, lookahead hashing, vLLM's offloading
//! placeholders, replay after a lost batch, a restart, data-parallel port offsets, ipc://.

use crate::common;

use common::engine::{engine_hash, Engine, RELEASES};
use common::*;
use kvrouter_protocol::{PromptExtras, RouteDecision, WorkerKey};
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::time::Duration;

/// `[hash, parent]` of every device block a replica's index holds for `rank`.
fn indexed(admin: u16, worker: u64, rank: u32) -> BTreeSet<(u64, Option<u64>)> {
    let model = E2E_MODEL.replace('/', "%2F");
    let path = format!("/debug/rank?model={model}&worker={worker}&dp_rank={rank}");
    let v: Value = serde_json::from_str(&http_get(admin, &path).1).unwrap_or(Value::Null);
    let blocks = v["blocks"].as_array().cloned().unwrap_or_default();
    blocks
        .iter()
        .filter(|b| b[3] == "device")
        .map(|b| (engine_hash(&b[0]).unwrap(), engine_hash(&b[1])))
        .collect()
}

/// `[hash, parent]` of every device block the engine holds on `rank`.
fn published(engine: &mut Engine, rank: u32) -> BTreeSet<(u64, Option<u64>)> {
    let v = engine.cmd(json!({"cache": {"rank": rank}}));
    v["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| (engine_hash(&b[0]).unwrap(), engine_hash(&b[1])))
        .collect()
}

/// The route of `tokens` restricted to nothing, with these extras and LoRA.
fn route_as(
    client: &E2eClient,
    tokens: &[u32],
    lora: Option<&str>,
    salt: Option<&str>,
) -> RouteDecision {
    let mut req = plain_route(tokens);
    req.lora = lora.map(str::to_string);
    req.extras = salt.map(|s| PromptExtras {
        block_extras: vec![],
        cache_salt: Some(s.to_string()),
    });
    client.route_req(req).expect("route")
}

/// Waits until a route of `tokens` goes to `key` with `blocks` cached there.
fn routes_to(
    client: &E2eClient,
    tokens: &[u32],
    lora: Option<&str>,
    salt: Option<&str>,
    key: WorkerKey,
    blocks: u32,
) -> bool {
    wait_until(Duration::from_secs(10), || {
        let d = route_as(client, tokens, lora, salt);
        d.key() == key && d.overlap_blocks == blocks
    })
}

/// A run of `tokens` stored after the block `parent`.
fn continued(parent: &Value, with: Value) -> Value {
    let mut v = json!({ "parent": parent });
    if let Value::Object(m) = with {
        v.as_object_mut().unwrap().extend(m);
    }
    v
}

fn release_follows_its_engine(release: &'static str) {
    let nats = NatsServer::start();
    let mut engine = Engine::start(release, 2);
    let a1 = free_port();
    let _r1 = serve(&nats, "r1", a1, &[]);
    let (_bridge, worker, ab) = bridge(&nats, &engine.at(true));
    assert!(
        ready(ab),
        "{release}: bridge /readyz: {:?}",
        http_get(ab, "/readyz")
    );
    assert!(ready(a1));
    let client = E2eClient::new(&nats);
    let (k0, k1) = (WorkerKey::new(worker, 0), WorkerKey::new(worker, 1));
    let vllm = release.starts_with("vllm");
    let current = release != "sglang-0.5.3";

    // A conversation cached in two runs on rank 1 (its port offset by the engine's own rule),
    // the second extending the first: the whole of it matches there, nothing on rank 0, and
    // the replica holds exactly what the engine published.
    let a = e2e_tokens(1, 4);
    let first = engine.store(1, &a[..32]);
    let second = engine.store_with(1, &a[32..], continued(&first[1], json!({})));
    assert!(client.overlap_becomes(&a, k1, 4), "{release}");
    assert_eq!(client.overlap(&a, k0), 0, "{release}");
    assert!(
        wait_until(Duration::from_secs(5), || indexed(a1, worker, 1)
            == published(&mut engine, 1)),
        "{release}: index {:?} != engine {:?}",
        indexed(a1, worker, 1),
        published(&mut engine, 1)
    );
    // The last block removed: three left.
    engine.cmd(json!({"remove": {"rank": 1, "hashes": [second[1]]}}));
    assert!(client.overlap_becomes(&a, k1, 3), "{release}: removal");

    // Two batches of rank 0 lost on the wire: the next one shows the gap, the bridge replays
    // them from the engine's buffer.
    let warm = e2e_tokens(9, 1);
    engine.store(0, &warm);
    assert!(client.overlap_becomes(&warm, k0, 1), "{release}");
    engine.cmd(json!({"drop": {"rank": 0, "count": 2}}));
    let (b, c, d) = (e2e_tokens(2, 3), e2e_tokens(3, 2), e2e_tokens(4, 2));
    engine.store(0, &b);
    engine.store(0, &c);
    engine.store(0, &d);
    assert!(client.overlap_becomes(&b, k0, 3), "{release}: replayed");
    assert!(client.overlap_becomes(&c, k0, 2), "{release}: replayed");
    assert!(client.overlap_becomes(&d, k0, 2), "{release}");
    let m = http_get(ab, "/metrics").1;
    assert_eq!(
        metric_sum_in(&m, "kvrouter_bridge_gaps_replayed_total"),
        1.0,
        "{release}: {m}"
    );

    if current {
        // A LoRA adapter's blocks match only prompts for that adapter.
        let l = e2e_tokens(5, 2);
        engine.store_with(0, &l, json!({"lora": "ad1"}));
        assert!(
            routes_to(&client, &l, Some("ad1"), None, k0, 2),
            "{release}: lora"
        );
        assert_eq!(
            client.overlap(&l, k0),
            0,
            "{release}: lora blocks matched without it"
        );

        // A salted conversation in two runs, as each engine reports one (vLLM salts the
        // request's first block; SGLang names the salt on every run): as much overlap as the
        // same conversation unsalted, and none under another salt or none.
        let s = e2e_tokens(6, 4);
        let first = engine.store_with(0, &s[..32], json!({"salt": "tenant-a"}));
        engine.store_with(
            0,
            &s[32..],
            continued(&first[1], json!({"salt": "tenant-a"})),
        );
        assert!(
            routes_to(&client, &s, None, Some("tenant-a"), k0, 4),
            "{release}: salted conversation: {:?}",
            route_as(&client, &s, None, Some("tenant-a"))
        );
        assert_eq!(
            route_as(&client, &s, None, Some("tenant-b")).overlap_blocks,
            0
        );
        assert_eq!(
            client.overlap(&s, k0),
            0,
            "{release}: salted blocks matched unsalted"
        );
    }

    if vllm {
        // vLLM's offloading connector: by default one placeholder per offloaded block (no
        // tokens, block size 0, no parent); with self-describing events, the blocks' full
        // payloads. Then the device copies go. The blocks stay routable on the host tier,
        // under their prefix; a hash announced again (as chunks overlapping a shared prefix
        // do) is counted, so only its last removal takes it away.
        for (seed, self_describing) in [(7, false), (11, true)] {
            let how = if self_describing {
                "self-describing"
            } else {
                "placeholders"
            };
            let o = e2e_tokens(seed, 3);
            let hashes = engine.store(0, &o);
            assert!(client.overlap_becomes(&o, k0, 3), "{release}");
            let offload = |hashes: Value, removed: bool| {
                json!({"offload": {"rank": 0, "hashes": hashes, "medium": "CPU",
                    "removed": removed, "self_describing": self_describing}})
            };
            engine.cmd(offload(json!(hashes), false));
            engine.cmd(offload(json!([hashes[2]]), false));
            engine.cmd(json!({"remove": {"rank": 0, "hashes": hashes}}));
            assert!(
                client.overlap_becomes(&o, k0, 0),
                "{release} {how}: device copy gone"
            );
            let host = || route_as(&client, &o, None, None).tier_overlap_blocks.host;
            assert!(
                wait_until(Duration::from_secs(10), || host() == 3),
                "{release} {how}: offloaded blocks: {:?}",
                route_as(&client, &o, None, None)
            );
            engine.cmd(offload(json!([hashes[2]]), true));
            std::thread::sleep(Duration::from_millis(300));
            assert_eq!(host(), 3, "{release} {how}: removed at its first removal");
            engine.cmd(offload(json!([hashes[2]]), true));
            assert!(
                wait_until(Duration::from_secs(10), || host() == 2),
                "{release} {how}: the last removal"
            );
        }
    }

    if vllm {
        // Blocks an image overlaps carry (identifier, offset) in their extra keys: a prompt
        // naming the same image at the same place matches them, another image does not.
        let i = e2e_tokens(12, 2);
        let mm = json!([["img-abc", 0], ["img-abc", -16]]);
        engine.store_with(0, &i, json!({ "mm": mm }));
        let with_image = |id: &str| {
            let mut req = plain_route(&i);
            req.extras = Some(PromptExtras {
                block_extras: vec![vec![id.into(), "0".into()], vec![id.into(), "-16".into()]],
                cache_salt: None,
            });
            req
        };
        assert!(
            wait_until(Duration::from_secs(10), || {
                let d = client.route_req(with_image("img-abc")).unwrap();
                d.key() == k0 && d.overlap_blocks == 2
            }),
            "{release}: multimodal blocks"
        );
        let other = client.route_req(with_image("img-xyz")).unwrap();
        assert_eq!(other.overlap_blocks, 0, "{release}: another image matched");
        assert_eq!(
            client.overlap(&i, k0),
            0,
            "{release}: image blocks matched plain"
        );
    }

    if release == "vllm-0.33.0" {
        // A block hashed with tokens after it (speculative decoding's lookahead) cannot be
        // matched from the prompt's own tokens: the block before it still is.
        let k = e2e_tokens(8, 2);
        engine.store_with(0, &k, json!({"lookahead": [[], [1, 2, 3]]}));
        assert!(client.overlap_becomes(&k, k0, 1), "{release}: lookahead");
    }

    // AllBlocksCleared on rank 0 empties it; rank 1 keeps its blocks.
    engine.cmd(json!({"clear": {"rank": 0}}));
    assert!(client.overlap_becomes(&b, k0, 0), "{release}: cleared");
    assert_eq!(client.overlap(&a, k1), 3, "{release}");

    // The engine restarts (a new publisher on rank 1, sequence numbers from 0): the old
    // blocks go, on every rank, and the new ones land.
    engine.cmd(json!({"restart": {"rank": 1}}));
    let e = e2e_tokens(10, 2);
    assert!(
        wait_until(Duration::from_secs(10), || {
            engine.store(1, &e);
            client.overlap(&e, k1) == 2
        }),
        "{release}: after the restart"
    );
    assert!(client.overlap_becomes(&a, k1, 0), "{release}: old blocks");
    let m = http_get(ab, "/metrics").1;
    assert_eq!(
        metric_sum_in(&m, "kvrouter_bridge_engine_restarts_total"),
        1.0,
        "{release}: {m}"
    );
}

#[test]
fn vllm_0_33_follows_its_engine() {
    release_follows_its_engine("vllm-0.33.0");
}

#[test]
fn vllm_0_26_follows_its_engine() {
    release_follows_its_engine("vllm-0.26.0");
}

#[test]
fn sglang_0_5_23_follows_its_engine() {
    release_follows_its_engine("sglang-0.5.23");
}

#[test]
fn sglang_0_5_3_follows_its_engine() {
    release_follows_its_engine("sglang-0.5.3");
}

/// Socket files: every release binds `ipc://` endpoints and the bridge follows them at rank
/// 0; past rank 0 the engines refuse an `ipc://` endpoint (they offset only tcp ports), and
/// so does the bridge, before it starts.
#[test]
fn ipc_endpoints_at_rank_0_only_as_every_release_has_them() {
    let nats = NatsServer::start();
    let a1 = free_port();
    let _r1 = serve(&nats, "r1", a1, &[]);
    let client = E2eClient::new(&nats);
    for release in RELEASES {
        let dir = tempfile::tempdir().unwrap();
        let ipc = format!("--ipc-dir={}", dir.path().display());
        let ports = [free_port(), free_port(), free_port()];
        let refused = Engine::spawn(release, ports, 2, std::slice::from_ref(&ipc)).err();
        assert!(
            refused
                .as_deref()
                .is_some_and(|e| e.contains("Invalid endpoint")),
            "{release} with ipc:// at 2 ranks: {refused:?}"
        );
        let mut engine = Engine::spawn(release, ports, 1, &[ipc]).unwrap();
        let events = format!("ipc://{}/events", dir.path().display());
        let replay = format!("ipc://{}/replay", dir.path().display());
        let mut at = engine.at(false);
        let out = kvrouter()
            .args(["bridge", "--nats", &nats.url(), "--engine", at.kind])
            .args([
                "--model",
                E2E_MODEL,
                "--block-size",
                "16",
                "--capacity-blocks",
                "100",
            ])
            .args(["--zmq-endpoint", &events, "--dp-size", "2"])
            .args(["--base-url", "http://127.0.0.1:1"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("ipc"),
            "{release}: {err}"
        );
        at.dp = 1;
        let (_bridge, worker, ab) = bridge_at(&nats, &at, &events, &["--replay-endpoint", &replay]);
        assert!(
            ready(ab),
            "{release}: bridge /readyz: {:?}",
            http_get(ab, "/readyz")
        );
        let t = e2e_tokens(1, 3);
        engine.store(0, &t);
        assert!(
            client.overlap_becomes(&t, WorkerKey::new(worker, 0), 3),
            "{release} over ipc"
        );
    }
}

/// vLLM with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0` publishes 32-byte hashes: chains,
/// removals and salts hold the same.
#[test]
fn vllm_bytes_hashes_chain_and_remove() {
    let nats = NatsServer::start();
    let ports = [free_ports(1), free_ports(1), free_port()];
    let mut engine = Engine::spawn(RELEASES[0], ports, 1, &["--hash=bytes".into()]).unwrap();
    let a1 = free_port();
    let _r1 = serve(&nats, "r1", a1, &[]);
    let (_bridge, worker, ab) = bridge(&nats, &engine.at(true));
    assert!(ready(ab) && ready(a1));
    let client = E2eClient::new(&nats);
    let k0 = WorkerKey::new(worker, 0);
    let s = e2e_tokens(1, 4);
    let first = engine.store_with(0, &s[..32], json!({"salt": "t"}));
    assert!(first[0].is_string(), "{first:?}");
    let second = engine.store_with(0, &s[32..], continued(&first[1], json!({})));
    assert!(routes_to(&client, &s, None, Some("t"), k0, 4));
    engine.cmd(json!({"remove": {"rank": 0, "hashes": [second[1]]}}));
    assert!(routes_to(&client, &s, None, Some("t"), k0, 3));
}

/// An engine's ranks split between bridges (`--dp-start-rank`), each rank on the port the
/// engine's own offset gives it.
#[test]
fn bridges_for_ranks_past_the_first_find_the_engines_offset_ports() {
    for release in ["vllm-0.33.0", "sglang-0.5.23"] {
        let nats = NatsServer::start();
        let mut engine = Engine::start(release, 3);
        let a1 = free_port();
        let _r1 = serve(&nats, "r1", a1, &[]);
        // Ranks 1 and 2 of 3: the bridge adds its start rank to the endpoints' ports.
        let mut at = engine.at(true);
        at.dp = 2;
        let (_b, worker, ab) = bridge_with(&nats, &at, &["--dp-start-rank", "1"]);
        assert!(
            ready(ab),
            "{release}: bridge /readyz: {:?}",
            http_get(ab, "/readyz")
        );
        let client = E2eClient::new(&nats);
        let t = e2e_tokens(1, 2);
        engine.store(2, &t);
        assert!(
            client.overlap_becomes(&t, WorkerKey::new(worker, 2), 2),
            "{release}: rank 2"
        );
        assert_eq!(client.overlap(&t, WorkerKey::new(worker, 1)), 0);
        let u = e2e_tokens(2, 1);
        engine.store(1, &u);
        assert!(
            client.overlap_becomes(&u, WorkerKey::new(worker, 1), 1),
            "{release}: rank 1"
        );
    }
}

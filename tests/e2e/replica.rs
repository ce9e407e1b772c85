//! End to end over a real nats-server with the real binary: `kvrouter serve` replicas and
//! `kvrouter mocker` fleets, driven through the client library and the CLI.

use crate::common;

use bytes::Bytes;
use common::{
    e2e_tokens as tokens, free_port, http_get, kvrouter, let_nats_notice, metrics, ready, serve,
    wait_until, E2eClient as Client, NatsServer, E2E_BLOCK as BLOCK, E2E_MODEL as MODEL,
};
use kvrouter_client::ClientError;
use kvrouter_protocol::{
    decode, encode, hashing::stored_sequence_hashes, local_block_hashes, sequence_hashes,
    ErrorKind, OverlapRequest, Pin, RankLiveness, Reply, RouteDecision, RouteRequest, SequenceHash,
    StateChunk, StateQuery, Subjects, WorkerKey,
};
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

impl Client {
    fn overlaps(&self, tokens: &[u32]) -> HashMap<WorkerKey, u32> {
        let req = OverlapRequest {
            model: MODEL.into(),
            tokens: tokens.to_vec(),
            lora: None,
        };
        self.rt
            .block_on(self.client.overlap_scores(&req))
            .expect("overlap_scores")
            .scores
            .into_iter()
            .collect()
    }

    /// A raw route call: the decoded reply to arbitrary bytes.
    fn raw_route(&self, payload: Vec<u8>) -> Reply<RouteDecision> {
        let subject = Subjects::new("kvrouter").unwrap().route();
        let msg = self
            .rt
            .block_on(
                self.bus()
                    .request(&subject, Bytes::from(payload), Duration::from_secs(5)),
            )
            .expect("a reply");
        decode(&msg.payload).expect("a decodable reply")
    }

    /// The sequence hashes a worker rank caches, from its own state query.
    fn worker_cache(&self, key: WorkerKey) -> HashSet<SequenceHash> {
        let subject = Subjects::new("kvrouter")
            .unwrap()
            .model(MODEL)
            .unwrap()
            .state(key.worker_id);
        let query = encode(&StateQuery {
            dp_rank: key.dp_rank,
        })
        .unwrap();
        let mut stream = self
            .rt
            .block_on(self.bus().request_stream(
                &subject,
                Bytes::from(query),
                Duration::from_secs(5),
            ))
            .expect("state stream");
        let mut events = Vec::new();
        while let Some(chunk) = self.rt.block_on(stream.next()) {
            let chunk: StateChunk = decode::<Reply<StateChunk>>(&chunk.expect("chunk"))
                .expect("decodable")
                .into_result()
                .expect("state");
            events.extend(chunk.events);
        }
        stored_sequence_hashes(&events)
    }
}

fn route_request(tokens: &[u32], pin: Option<Pin>) -> RouteRequest {
    RouteRequest::new(MODEL, tokens.to_vec()).with_pin(pin)
}

/// Leading blocks of `tokens` present in a cache given as sequence hashes.
fn cached_prefix(cache: &HashSet<SequenceHash>, tokens: &[u32]) -> u32 {
    let local = local_block_hashes(tokens, BLOCK, None).unwrap();
    sequence_hashes(&local)
        .iter()
        .take_while(|s| cache.contains(s))
        .count() as u32
}

#[test]
fn replicas_route_repeated_prefixes_to_the_holder_and_survive_each_other() {
    let nats = NatsServer::start();
    let _fleet = common::mocker(&nats, 100, 2, 2, BLOCK);
    let (p1, p2, p3) = (free_port(), free_port(), free_port());
    let r1 = serve(&nats, "r1", p1, &[]);
    let r2 = serve(&nats, "r2", p2, &[]);
    assert!(ready(p1) && ready(p2), "replicas turn ready");
    let c = Client::new(&nats);

    let prompt = tokens(1, 8);
    let first = c.generate(&prompt, None);
    let holder = first.decision.key();
    assert!(first.cached_blocks == 0);
    // Both replicas learn the blocks from the event stream.
    assert!(
        wait_until(Duration::from_secs(10), || (0..10)
            .all(|_| c.route(&prompt).overlap_blocks == 8)),
        "the repeated prefix is seen with its full overlap"
    );
    let mut answered_by = HashSet::new();
    for _ in 0..30 {
        let d = c.route(&prompt);
        assert_eq!(d.key(), holder, "routed to the rank holding the prefix");
        assert_eq!(d.overlap_blocks, 8);
        answered_by.insert(d.replica_id);
    }
    assert_eq!(
        answered_by,
        HashSet::from(["r1".to_string(), "r2".to_string()]),
        "both replicas answer"
    );
    // The second run finds its prefix in the worker's cache.
    let again = c.generate(&prompt, None);
    assert_eq!(again.decision.key(), holder);
    assert!(again.cached_blocks >= 7, "cached {}", again.cached_blocks);

    // A replica started after the traffic syncs the state and routes the same way.
    let r3 = serve(&nats, "r3", p3, &[]);
    assert!(ready(p3));
    let m3 = metrics(p3);
    assert!(m3.contains("kvrouter_state_recoveries_total"), "{m3}");
    assert!(
        m3.contains(r#"kvrouter_worker_ranks{model="Qwen/Qwen3-0.6B"} 4"#),
        "{m3}"
    );
    r1.kill();
    let_nats_notice();
    for _ in 0..10 {
        let d = c.route(&prompt);
        assert_eq!((d.key(), d.overlap_blocks), (holder, 8));
        assert_ne!(d.replica_id, "r1");
    }
    r2.kill();
    let_nats_notice();
    for _ in 0..5 {
        let d = c.route(&prompt);
        assert_eq!(
            (d.key(), d.overlap_blocks, d.replica_id.as_str()),
            (holder, 8, "r3")
        );
    }
    // SIGTERM drains and exits cleanly.
    let status = r3
        .terminate(Duration::from_secs(15))
        .expect("exits after SIGTERM");
    assert!(status.success(), "{status:?}");
}

#[test]
fn workers_leave_restart_and_lost_events_are_recovered() {
    let nats = NatsServer::start();
    let _a = common::mocker(&nats, 1, 1, 1, BLOCK);
    let b = common::mocker(&nats, 2, 1, 1, BLOCK);
    let port = free_port();
    let _r = serve(&nats, "r1", port, &[]);
    assert!(ready(port));
    let c = Client::new(&nats);
    let on = |w: u64| {
        Some(Pin {
            worker_id: w,
            dp_rank: Some(0),
        })
    };
    let (k1, k2) = (WorkerKey::new(1, 0), WorkerKey::new(2, 0));

    // Warm worker 2, then restart it at once (a new instance, well within its lease): the
    // replica drops the old instance's blocks and syncs the new, empty one.
    let pb = tokens(2, 6);
    c.generate(&pb, on(2));
    assert!(wait_until(Duration::from_secs(10), || c
        .overlaps(&pb)
        .get(&k2)
        == Some(&6)));
    b.kill();
    let b = common::mocker(&nats, 2, 1, 1, BLOCK);
    assert!(
        wait_until(Duration::from_secs(10), || !c
            .overlaps(&pb)
            .contains_key(&k2)),
        "the old instance's blocks are gone"
    );
    // The new instance becomes routable once its (empty) state is synced, a moment after
    // the takeover drops the old one.
    assert!(
        wait_until(Duration::from_secs(10), || c
            .route_req(route_request(&pb, on(2)))
            .is_ok()),
        "the new instance is routable"
    );
    c.generate(&pb, on(2));
    assert!(wait_until(Duration::from_secs(10), || c
        .overlaps(&pb)
        .get(&k2)
        == Some(&6)));

    // A killed worker leaves routing within its lease, and its metric series go.
    assert!(metrics(port).contains(r#"worker="2""#));
    let killed = Instant::now();
    b.kill();
    assert!(wait_until(Duration::from_secs(10), || matches!(
        c.route_req(route_request(&pb, on(2))),
        Err(ClientError::Router(e)) if e.kind == ErrorKind::UnknownWorker
    )));
    assert!(
        killed.elapsed() < Duration::from_secs(6),
        "removed after {:?} (lease 3 s)",
        killed.elapsed()
    );
    assert!(!c.overlaps(&pb).contains_key(&k2));
    assert!(wait_until(Duration::from_secs(2), || !metrics(port)
        .contains(r#"worker="2""#)));
    for _ in 0..10 {
        assert_eq!(c.route(&pb).worker_id, 1, "only worker 1 is left");
    }

    // Lost events: worker 1 drops its next event batch; the following one shows a gap, the
    // replica fetches the rank's state, and its index then matches the worker's cache.
    let pa = tokens(3, 5);
    c.generate(&pa, on(1));
    let drop_subject = Subjects::new("kvrouter")
        .unwrap()
        .model(MODEL)
        .unwrap()
        .drop_events(1);
    c.rt.block_on(
        c.bus()
            .publish(&drop_subject, Bytes::from(encode(&1u64).unwrap())),
    )
    .unwrap();
    c.rt.block_on(c.bus().flush()).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let px = tokens(4, 7);
    c.generate(&px, on(1));
    std::thread::sleep(Duration::from_millis(300));
    let py = tokens(5, 3);
    c.generate(&py, on(1));
    let prompts = [&pa, &px, &py];
    let matches = || {
        let cache = c.worker_cache(k1);
        prompts
            .iter()
            .all(|p| c.overlaps(p).get(&k1).copied().unwrap_or(0) == cached_prefix(&cache, p))
    };
    assert!(
        wait_until(Duration::from_secs(10), matches),
        "after recovery the index equals the worker's cache"
    );
    assert_eq!(
        c.overlaps(&px).get(&k1),
        Some(&7),
        "the dropped blocks are back"
    );
    let m = metrics(port);
    let gaps = m
        .lines()
        .find(|l| l.starts_with("kvrouter_kv_event_gaps_total"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(gaps >= 1.0, "gap counted: {m}");
}

#[test]
fn bad_input_gets_an_error_and_the_replica_keeps_routing() {
    let nats = NatsServer::start();
    let _fleet = common::mocker(&nats, 7, 1, 2, BLOCK);
    let port = free_port();
    let _r = serve(&nats, "r1", port, &["--max-prompt-tokens", "1000"]);
    assert!(ready(port));
    assert_eq!(http_get(port, "/healthz").0, 200);
    let c = Client::new(&nats);
    let good = tokens(9, 4);
    let still_routes = || assert_eq!(c.route(&good).worker_id, 7);
    still_routes();

    let err = |r: Reply<RouteDecision>| r.into_result().expect_err("an error reply").kind;
    assert_eq!(err(c.raw_route(b"garbage".to_vec())), ErrorKind::Malformed);
    still_routes();
    let mut wrong_version = encode(&route_request(&good, None)).unwrap();
    wrong_version[0] = 99;
    assert_eq!(err(c.raw_route(wrong_version)), ErrorKind::Malformed);
    assert_eq!(err(c.raw_route(Vec::new())), ErrorKind::Malformed);
    still_routes();
    let cases: Vec<(RouteRequest, ErrorKind)> = vec![
        (
            RouteRequest::new("no/such-model", good.clone()),
            ErrorKind::UnknownModel,
        ),
        (route_request(&[], None), ErrorKind::EmptyPrompt),
        (
            route_request(&vec![1; 1001], None),
            ErrorKind::PromptTooLong,
        ),
        (
            route_request(
                &good,
                Some(Pin {
                    worker_id: 8,
                    dp_rank: Some(0),
                }),
            ),
            ErrorKind::UnknownWorker,
        ),
        (
            route_request(
                &good,
                Some(Pin {
                    worker_id: 7,
                    dp_rank: Some(5),
                }),
            ),
            ErrorKind::InvalidRank,
        ),
    ];
    for (req, kind) in cases {
        assert_eq!(err(c.raw_route(encode(&req).unwrap())), kind, "{req:?}");
        still_routes();
    }
    // A prompt shorter than one block is routed on load alone.
    let d = c.route(&[1, 2, 3]);
    assert_eq!((d.worker_id, d.overlap_blocks), (7, 0));
    // A pinned rank is honoured.
    let d = c
        .route_req(route_request(
            &good,
            Some(Pin {
                worker_id: 7,
                dp_rank: Some(1),
            }),
        ))
        .unwrap();
    assert_eq!(d.key(), WorkerKey::new(7, 1));

    // A worker whose block size differs from the model's is refused, and logged.
    let _odd = common::mocker(&nats, 8, 1, 1, 32);
    assert!(wait_until(Duration::from_secs(5), || metrics(port)
        .contains(
            r#"kvrouter_refused_registrations_total{model="Qwen/Qwen3-0.6B"}"#
        )));
    assert!(matches!(
        c.route_req(route_request(&good, Some(Pin { worker_id: 8, dp_rank: None }))),
        Err(ClientError::Router(e)) if e.kind == ErrorKind::UnknownWorker
    ));

    let m = metrics(port);
    for kind in [
        "malformed",
        "unknown_model",
        "empty_prompt",
        "prompt_too_long",
        "unknown_worker",
        "invalid_rank",
    ] {
        assert!(
            m.contains(&format!(r#"kind="{kind}""#)),
            "{kind} counted: {m}"
        );
    }
    assert!(m.contains("kvrouter_route_decision_seconds_bucket"));

    // The CLI: JSON on success, the error on stderr and a non-zero exit on failure.
    let url = nats.url();
    let toks: Vec<String> = good.iter().map(u32::to_string).collect();
    let toks = toks.join(",");
    let out = kvrouter()
        .args(["route", "--nats", &url, "--model", MODEL, "--tokens", &toks])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["worker_id"], 7);
    assert_eq!(v["replica_id"], "r1");
    // The whole decision, as the JSON API's /v1/route answers it.
    let keys: std::collections::BTreeSet<&str> =
        v.as_object().unwrap().keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        std::collections::BTreeSet::from([
            "worker_id",
            "dp_rank",
            "overlap_blocks",
            "tier_overlap_blocks",
            "base_url",
            "request_id",
            "replica_id",
            "block_size",
            "lease",
            "fallbacks"
        ]),
        "{v}"
    );
    assert_eq!(v["fallbacks"], serde_json::json!([]), "none asked for: {v}");
    assert_eq!(
        v["tier_overlap_blocks"]["device"], v["overlap_blocks"],
        "{v}"
    );
    assert!(v["tier_overlap_blocks"]["host"].is_u64(), "{v}");
    assert!(
        v["request_id"].as_str().is_some_and(|id| !id.is_empty()),
        "a booked route names its request: {v}"
    );
    assert!(v["block_size"].as_u64().is_some_and(|b| b > 0), "{v}");
    let out = kvrouter()
        .args([
            "route", "--nats", &url, "--model", "nope", "--tokens", &toks,
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("nope"));
    let out = kvrouter()
        .args([
            "generate",
            "--nats",
            &url,
            "--model",
            MODEL,
            "--tokens",
            &toks,
            "--max-tokens",
            "3",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["worker_id"], 7);
    assert_eq!(v["output_tokens"], 3);
}

/// Data-parallel ranks from rank 4 end to end through the real binaries: each rank has its
/// metric series and its own cache; a rank taken down through the mocker's `rank_live` hook
/// leaves routing and the metrics alone (the other rank stays), and comes back.
#[test]
fn a_rank_taken_down_leaves_alone_and_comes_back() {
    let nats = NatsServer::start();
    let _fleet = common::mocker_with(
        &nats,
        "mocker",
        &[
            "--model",
            MODEL,
            "--workers",
            "1",
            "--dp-size",
            "2",
            "--dp-start-rank",
            "4",
            "--block-size",
            "16",
            "--capacity-blocks",
            "512",
            "--speedup",
            "100",
            "--worker-id-start",
            "300",
        ],
    );
    let port = free_port();
    let _r = serve(&nats, "r1", port, &[]);
    assert!(ready(port));
    let c = Client::new(&nats);
    let series = |rank: u32| {
        format!(r#"kvrouter_worker_active_blocks{{model="{MODEL}",worker="300",dp_rank="{rank}"}}"#)
    };
    let has = |rank: u32| metrics(port).contains(&series(rank));
    assert!(wait_until(Duration::from_secs(10), || has(4) && has(5)));
    let pin = |rank| {
        Some(Pin {
            worker_id: 300,
            dp_rank: Some(rank),
        })
    };

    // The cache is per rank: a prompt run on rank 5 is found there, not on rank 4.
    let prompt = tokens(7, 6);
    assert_eq!(
        c.generate(&prompt, pin(5)).decision.key(),
        WorkerKey::new(300, 5)
    );
    assert!(wait_until(Duration::from_secs(5), || c.overlaps(&prompt)
        == HashMap::from([(WorkerKey::new(300, 5), 6)])));
    let again = c.generate(&prompt, None);
    assert_eq!(again.decision.key(), WorkerKey::new(300, 5));
    assert!(again.cached_blocks >= 5, "cached {}", again.cached_blocks);

    // Rank 5 down: it leaves the index, the routes and the metrics; rank 4 stays.
    let set_live = |live: bool| {
        let subject = Subjects::new("kvrouter")
            .unwrap()
            .model(MODEL)
            .unwrap()
            .rank_live(300);
        let payload = encode(&RankLiveness { dp_rank: 5, live }).unwrap();
        let reply =
            c.rt.block_on(
                c.bus()
                    .request(&subject, Bytes::from(payload), Duration::from_secs(5)),
            )
            .expect("the mocker answers");
        assert_eq!(decode::<Reply<()>>(&reply.payload).unwrap(), Reply::Ok(()));
    };
    set_live(false);
    assert!(
        wait_until(Duration::from_secs(5), || !has(5) && has(4)),
        "{}",
        metrics(port)
    );
    assert!(
        wait_until(Duration::from_secs(5), || c.overlaps(&prompt).is_empty()),
        "rank 5's blocks left the index"
    );
    for _ in 0..10 {
        assert_eq!(c.route(&prompt).key(), WorkerKey::new(300, 4));
    }
    let pinned = route_request(&prompt, pin(5));
    assert!(
        c.route_req(pinned.clone()).is_err(),
        "no route to a rank that is down"
    );
    // A rank the worker never had is refused by the mocker's hook.
    let subject = Subjects::new("kvrouter")
        .unwrap()
        .model(MODEL)
        .unwrap()
        .rank_live(300);
    let bad = encode(&RankLiveness {
        dp_rank: 9,
        live: false,
    })
    .unwrap();
    let reply =
        c.rt.block_on(
            c.bus()
                .request(&subject, Bytes::from(bad), Duration::from_secs(5)),
        )
        .unwrap();
    assert!(matches!(
        decode::<Reply<()>>(&reply.payload).unwrap(),
        Reply::Err(e) if e.kind == ErrorKind::InvalidRank
    ));

    // Back up: it is routable again (its cache was kept, so its blocks come back with the
    // state the replica fetches for the returning rank).
    set_live(true);
    assert!(wait_until(Duration::from_secs(5), || has(5)));
    assert!(wait_until(Duration::from_secs(5), || c
        .route_req(pinned.clone())
        .is_ok_and(|d| d.key() == WorkerKey::new(300, 5))));
    assert!(wait_until(Duration::from_secs(5), || c.overlaps(&prompt)
        == HashMap::from([(WorkerKey::new(300, 5), 6)])));
    assert_eq!(c.route(&prompt).key(), WorkerKey::new(300, 5));
}

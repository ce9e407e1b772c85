//! The mocker fleet on the in-process bus: discovery, generate, KV events, state sync.

use bytes::Bytes;
use kvrouter_bus::{Bus, LocalBus, Subscription};
use kvrouter_mocker::{EngineConfig, FleetConfig, MockerFleet};
use kvrouter_protocol::{
    decode, decode_versioned, encode, encode_as, Deregistration, EngineKind, ErrorKind, EventId,
    FromWorker, GenerateEvent, GenerateRequest, Heartbeat, KvEvent, KvEventBatch, KvEventData,
    LoadReport, ModelSubjects, Registration, Reply, StateChunk, StateQuery, WhoIsThere, Wire,
    WorkerKey, WorkerRole, WorkerSubject, FORMAT_VERSION, MIN_READ_VERSION,
};
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;
use tokio::time::{timeout, Instant};

const MODEL: &str = "test/model-1";
const WAIT: Duration = Duration::from_secs(5);

fn fast_fleet_config(worker_id_start: u64) -> FleetConfig {
    FleetConfig {
        worker_id_start,
        speedup: 1000.0,
        engine: EngineConfig {
            block_size: 16,
            capacity_blocks: 1000,
            ..EngineConfig::default()
        },
        ..FleetConfig::new(MODEL)
    }
}

/// The next message of a worker's own subjects, checked to be about that worker.
async fn next_from_worker<T: Wire + FromWorker>(sub: &mut Subscription, s: &ModelSubjects) -> T {
    let msg = timeout(WAIT, sub.next())
        .await
        .expect("timed out waiting for a message")
        .expect("subscription closed");
    let v: T = decode(&msg.payload).expect("decodes");
    assert_eq!(
        s.worker_of(&msg.subject),
        Some(v.worker_id()),
        "{}",
        msg.subject
    );
    v
}

async fn collect_stream<T: Wire>(bus: &Bus, subject: &str, payload: Vec<u8>) -> Vec<T> {
    let mut stream = bus
        .request_stream(subject, Bytes::from(payload), WAIT)
        .await
        .expect("request sent");
    let mut out = Vec::new();
    while let Some(item) = stream.next().await {
        let bytes = item.expect("stream item");
        out.push(decode(&bytes).expect("decodes"));
    }
    out
}

async fn worker_generate(
    bus: &Bus,
    subjects: &ModelSubjects,
    worker_id: u64,
    dp_rank: u32,
    request_id: &str,
    tokens: Vec<u32>,
    max_tokens: u32,
) -> Vec<GenerateEvent> {
    let req = GenerateRequest {
        request_id: request_id.into(),
        tokens,
        max_tokens,
        dp_rank,
    };
    collect_stream(bus, &subjects.generate(worker_id), encode(&req).unwrap()).await
}

async fn state(
    bus: &Bus,
    subjects: &ModelSubjects,
    worker_id: u64,
    dp_rank: u32,
) -> Vec<Reply<StateChunk>> {
    let q = StateQuery { dp_rank };
    collect_stream(bus, &subjects.state(worker_id), encode(&q).unwrap()).await
}

/// PrefillDone fields, inter-token latencies, Done fields of a successful stream.
fn summarize(events: &[GenerateEvent]) -> ((u64, u32, u32), Vec<u32>, (u32, u64)) {
    let mut prefill = None;
    let mut itl = Vec::new();
    let mut done = None;
    for (i, ev) in events.iter().enumerate() {
        match ev {
            GenerateEvent::PrefillDone {
                ttft_us,
                cached_blocks,
                prompt_blocks,
                ..
            } => {
                assert_eq!(i, 0, "PrefillDone comes first");
                prefill = Some((*ttft_us, *cached_blocks, *prompt_blocks));
            }
            GenerateEvent::Tokens { itl_us } => {
                assert!(prefill.is_some() && done.is_none());
                assert!(!itl_us.is_empty() && itl_us.len() <= 16);
                itl.extend(itl_us);
            }
            GenerateEvent::Done {
                output_tokens,
                e2e_us,
            } => {
                assert_eq!(i, events.len() - 1, "Done comes last");
                done = Some((*output_tokens, *e2e_us));
            }
            GenerateEvent::Error(e) => panic!("unexpected error {e}"),
        }
    }
    (prefill.expect("PrefillDone"), itl, done.expect("Done"))
}

fn error_of(events: &[GenerateEvent]) -> ErrorKind {
    match events {
        [GenerateEvent::Error(e)] => e.kind,
        other => panic!("expected a single error, got {other:?}"),
    }
}

/// Applies events to a block set (engine hash → local hash).
fn apply_event(blocks: &mut HashMap<u64, u64>, ev: &KvEvent) {
    match &ev.data {
        KvEventData::Stored { blocks: b, .. } => {
            for s in b {
                blocks.insert(s.engine_hash.0, s.local_hash.0);
            }
        }
        KvEventData::Removed { engine_hashes } => {
            for h in engine_hashes {
                blocks.remove(&h.0);
            }
        }
        KvEventData::Cleared => blocks.clear(),
    }
}

/// Drains KV event batches until `until` (or the timeout), keyed by rank.
async fn drain_events(
    sub: &mut Subscription,
    per_rank: &mut BTreeMap<WorkerKey, Vec<KvEvent>>,
    until: impl Fn(&BTreeMap<WorkerKey, Vec<KvEvent>>) -> bool,
) {
    let deadline = Instant::now() + WAIT;
    while !until(per_rank) {
        let msg = match tokio::time::timeout_at(deadline, sub.next()).await {
            Ok(Some(m)) => m,
            _ => return,
        };
        let batch: KvEventBatch = decode(&msg.payload).unwrap();
        for ev in batch.events {
            assert_eq!(ev.key.worker_id, batch.worker_id);
            per_rank.entry(ev.key).or_default().push(ev);
        }
    }
}

fn prompt_tokens(seed: u32, len: u32) -> Vec<u32> {
    (0..len).map(|i| seed * 100_000 + i).collect()
}

#[tokio::test]
async fn discovery_registration_heartbeat_deregistration() {
    let bus = Bus::local();
    let cfg = FleetConfig {
        workers: 2,
        dp_size: 2,
        dp_start_rank: 4,
        tp_size: 8,
        role: WorkerRole::Prefill,
        heartbeat_interval: Duration::from_millis(100),
        ..fast_fleet_config(100)
    };
    let subjects = kvrouter_protocol::Subjects::new("kvrouter")
        .unwrap()
        .model(MODEL)
        .unwrap();
    let every = |what| subjects.every_worker(what);
    let mut reg = bus
        .subscribe(&every(WorkerSubject::Register))
        .await
        .unwrap();
    let mut hb = bus
        .subscribe(&every(WorkerSubject::Heartbeat))
        .await
        .unwrap();
    let mut dereg = bus
        .subscribe(&every(WorkerSubject::Deregister))
        .await
        .unwrap();
    let fleet = MockerFleet::start(bus.clone(), cfg).await.unwrap();
    assert_eq!(fleet.worker_ids(), vec![100, 101]);

    let mut seen = Vec::new();
    for _ in 0..2 {
        let r: Registration = next_from_worker(&mut reg, &subjects).await;
        assert_eq!(
            r,
            Registration {
                worker_id: r.worker_id,
                instance_id: fleet.instance_id(r.worker_id).unwrap(),
                model: MODEL.into(),
                role: WorkerRole::Prefill,
                block_size: 16,
                dp_size: 2,
                dp_start_rank: 4,
                live_ranks: vec![4, 5],
                tp_size: 8,
                capacity_blocks: 1000,
                heartbeat_interval_ms: 100,
                engine: EngineKind::Mocker,
                base_url: String::new(),
            }
        );
        seen.push(r.worker_id);
    }
    seen.sort();
    assert_eq!(seen, vec![100, 101]);
    assert_ne!(fleet.instance_id(100), fleet.instance_id(101));

    // A roll call is answered at once (well before the next heartbeat).
    let t0 = Instant::now();
    let who = encode(&WhoIsThere {
        replica_id: "r1".into(),
    })
    .unwrap();
    bus.publish(&subjects.who_is_there(), who.into())
        .await
        .unwrap();
    for _ in 0..2 {
        let r: Registration = next_from_worker(&mut reg, &subjects).await;
        assert_eq!(r.live_ranks, vec![4, 5]);
    }
    assert!(t0.elapsed() < Duration::from_millis(500));

    // Heartbeats, then a dead rank leaves live_ranks.
    let h: Heartbeat = next_from_worker(&mut hb, &subjects).await;
    assert_eq!(h.live_ranks, vec![4, 5]);
    assert_eq!(fleet.instance_id(h.worker_id), Some(h.instance_id));
    fleet.set_rank_live(101, 5, false).await.unwrap();
    let r: Registration = next_from_worker(&mut reg, &subjects).await;
    assert_eq!((r.worker_id, r.live_ranks), (101, vec![4]));
    let deadline = Instant::now() + WAIT;
    loop {
        let h: Heartbeat = next_from_worker(&mut hb, &subjects).await;
        if h.worker_id == 101 && h.live_ranks == vec![4] {
            break;
        }
        assert!(Instant::now() < deadline);
    }
    assert!(fleet.set_rank_live(101, 6, false).await.is_err());
    assert!(fleet.set_rank_live(7, 4, false).await.is_err());

    let ids: Vec<_> = [100, 101]
        .iter()
        .map(|&w| (w, fleet.instance_id(w).unwrap()))
        .collect();
    fleet.shutdown().await.unwrap();
    let mut got = Vec::new();
    for _ in 0..2 {
        let d: Deregistration = next_from_worker(&mut dereg, &subjects).await;
        got.push((d.worker_id, d.instance_id));
    }
    got.sort();
    assert_eq!(got, ids);
}

#[tokio::test]
async fn generate_streams_and_reuses_the_cache() {
    let bus = Bus::local();
    let fleet = MockerFleet::start(bus.clone(), fast_fleet_config(7))
        .await
        .unwrap();
    let s = fleet.subjects().clone();
    let mut loads = bus
        .subscribe(&s.every_worker(WorkerSubject::Load))
        .await
        .unwrap();

    let tokens = prompt_tokens(1, 256);
    let first = worker_generate(&bus, &s, 7, 0, "a", tokens.clone(), 40).await;
    let ((ttft1, cached1, blocks1), itl, (out, e2e)) = summarize(&first);
    assert_eq!((cached1, blocks1), (0, 16));
    assert_eq!(itl.len(), 39, "PrefillDone carries the first token");
    assert_eq!(out, 40);
    assert!(first.len() >= 2 + 39usize.div_ceil(16));
    assert!(e2e > ttft1 && ttft1 > 0);

    let second = worker_generate(&bus, &s, 7, 0, "b", tokens.clone(), 1).await;
    let ((ttft2, cached2, blocks2), itl2, (out2, _)) = summarize(&second);
    assert_eq!(
        (cached2, blocks2),
        (15, 16),
        "the last prompt token is always computed"
    );
    assert!(itl2.is_empty());
    assert_eq!(out2, 1);
    assert!(
        ttft2 < ttft1,
        "cached prefill is faster: {ttft2} vs {ttft1}"
    );

    // Errors: one error event, then the end of the stream.
    let e = worker_generate(&bus, &s, 7, 0, "c", vec![], 5).await;
    assert_eq!(error_of(&e), ErrorKind::EmptyPrompt);
    let e = worker_generate(&bus, &s, 7, 0, "c", prompt_tokens(2, 1000 * 16 + 1), 5).await;
    assert_eq!(error_of(&e), ErrorKind::PromptTooLong);
    let e = worker_generate(&bus, &s, 7, 1, "c", prompt_tokens(2, 10), 5).await;
    assert_eq!(error_of(&e), ErrorKind::InvalidRank);
    let e: Vec<GenerateEvent> = collect_stream(&bus, &s.generate(7), vec![1, 2, 3]).await;
    assert_eq!(error_of(&e), ErrorKind::Malformed);
    // Duplicate id while the first is still running.
    let long = {
        let bus = bus.clone();
        let s = s.clone();
        tokio::spawn(async move {
            worker_generate(&bus, &s, 7, 0, "dup", prompt_tokens(3, 64), 3000).await
        })
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    let e = worker_generate(&bus, &s, 7, 0, "dup", prompt_tokens(4, 64), 5).await;
    assert_eq!(error_of(&e), ErrorKind::DuplicateRequest);
    let (_, itl, (out, _)) = summarize(&long.await.unwrap());
    assert_eq!((itl.len(), out), (2999, 3000));

    // Load reports come.
    let l: LoadReport = next_from_worker(&mut loads, &s).await;
    assert_eq!(l.worker_id, 7);
    assert_eq!(l.instance_id, fleet.instance_id(7).unwrap());
    assert_eq!(l.ranks.len(), 1);
    fleet.shutdown().await.unwrap();
}

#[tokio::test]
async fn events_are_gap_free_and_match_the_chunked_state() {
    // 8 KiB payloads: at most 256 blocks per message, so the state comes in several chunks.
    let bus: Bus = LocalBus::with_max_payload(8192).into();
    let cfg = FleetConfig {
        engine: EngineConfig {
            block_size: 16,
            capacity_blocks: 400,
            ..EngineConfig::default()
        },
        ..fast_fleet_config(1)
    };
    let s = kvrouter_protocol::Subjects::new("kvrouter")
        .unwrap()
        .model(MODEL)
        .unwrap();
    let mut kv = bus
        .subscribe(&s.every_worker(WorkerSubject::KvEvents))
        .await
        .unwrap();
    let fleet = MockerFleet::start(bus.clone(), cfg).await.unwrap();
    // 24 prompts of 32 blocks (shared prefixes for some): more than the cache, so evictions.
    let mut tasks = Vec::new();
    for i in 0..24u32 {
        let bus = bus.clone();
        let s = s.clone();
        let mut tokens = prompt_tokens(i / 2, 256);
        tokens.extend(prompt_tokens(1000 + i, 256));
        tasks.push(tokio::spawn(async move {
            worker_generate(&bus, &s, 1, 0, &format!("r{i}"), tokens, 3).await
        }));
        if i % 4 == 3 {
            for t in tasks.drain(..) {
                summarize(&t.await.unwrap());
            }
        }
    }
    let chunks = state(&bus, &s, 1, 0).await;
    assert!(chunks.len() >= 2, "{} chunks", chunks.len());
    let mut snapshot = HashMap::new();
    let mut last = None;
    for c in chunks {
        let c = c.into_result().unwrap();
        assert_eq!(c.key, WorkerKey::new(1, 0));
        assert_eq!(c.instance_id, fleet.instance_id(1).unwrap());
        assert!(c.events.iter().map(KvEvent::block_count).sum::<usize>() <= 256);
        assert!(last.is_none() || last == Some(c.last_event_id));
        last = Some(c.last_event_id);
        for ev in &c.events {
            apply_event(&mut snapshot, ev);
        }
    }
    let last: EventId = last.unwrap().expect("events happened");
    assert!(snapshot.len() > 256 && snapshot.len() <= 400);

    let mut per_rank = BTreeMap::new();
    drain_events(&mut kv, &mut per_rank, |m| {
        m.get(&WorkerKey::new(1, 0))
            .and_then(|v| v.last())
            .is_some_and(|e| e.event_id >= last)
    })
    .await;
    let events = &per_rank[&WorkerKey::new(1, 0)];
    let ids: Vec<_> = events.iter().map(|e| e.event_id).collect();
    assert_eq!(ids, (0..=last).collect::<Vec<_>>(), "gap-free, in order");
    assert!(events
        .iter()
        .any(|e| matches!(e.data, KvEventData::Removed { .. })));
    let mut replayed = HashMap::new();
    for ev in events {
        apply_event(&mut replayed, ev);
    }
    assert_eq!(replayed, snapshot);

    // Unknown rank: one error chunk.
    let bad = state(&bus, &s, 1, 3).await;
    assert_eq!(bad.len(), 1);
    match &bad[0] {
        Reply::Err(e) => assert_eq!(e.kind, ErrorKind::InvalidRank),
        other => panic!("expected an error, got {other:?}"),
    }

    // Clear: a Cleared event, then an empty snapshot at its id.
    let cleared = fleet.clear_rank(1, 0).await.unwrap();
    assert_eq!(cleared, last + 1);
    let chunks = state(&bus, &s, 1, 0).await;
    assert_eq!(chunks.len(), 1);
    let c = chunks[0].clone().into_result().unwrap();
    assert_eq!((c.last_event_id, c.events.len()), (Some(cleared), 0));
    drain_events(&mut kv, &mut per_rank, |m| {
        m[&WorkerKey::new(1, 0)].last().unwrap().event_id >= cleared
    })
    .await;
    let ev = per_rank[&WorkerKey::new(1, 0)].last().unwrap();
    assert_eq!((ev.event_id, &ev.data), (cleared, &KvEventData::Cleared));
    fleet.shutdown().await.unwrap();
}

#[tokio::test]
async fn drop_events_makes_a_gap() {
    let bus = Bus::local();
    let fleet = MockerFleet::start(bus.clone(), fast_fleet_config(9))
        .await
        .unwrap();
    let s = fleet.subjects().clone();
    let mut kv = bus
        .subscribe(&s.every_worker(WorkerSubject::KvEvents))
        .await
        .unwrap();
    let settle = || tokio::time::sleep(Duration::from_millis(30));

    summarize(&worker_generate(&bus, &s, 9, 0, "a", prompt_tokens(1, 64), 2).await);
    settle().await;
    let ack = bus
        .request(&s.drop_events(9), encode(&1u64).unwrap().into(), WAIT)
        .await
        .unwrap();
    assert_eq!(decode::<Reply<()>>(&ack.payload).unwrap(), Reply::Ok(()));
    summarize(&worker_generate(&bus, &s, 9, 0, "b", prompt_tokens(2, 64), 2).await);
    settle().await;
    summarize(&worker_generate(&bus, &s, 9, 0, "c", prompt_tokens(3, 64), 2).await);
    settle().await;

    let chunks = state(&bus, &s, 9, 0).await;
    let last = chunks[0]
        .clone()
        .into_result()
        .unwrap()
        .last_event_id
        .unwrap();
    assert_eq!(last, 2, "three prompts, one Stored event each");
    let mut per_rank = BTreeMap::new();
    drain_events(&mut kv, &mut per_rank, |m| {
        m.get(&WorkerKey::new(9, 0))
            .and_then(|v| v.last())
            .is_some_and(|e| e.event_id >= last)
    })
    .await;
    let ids: Vec<_> = per_rank[&WorkerKey::new(9, 0)]
        .iter()
        .map(|e| e.event_id)
        .collect();
    assert_eq!(ids, vec![0, 2], "the batch with event 1 was dropped");
    fleet.shutdown().await.unwrap();
}

/// Every message of a streamed answer, undecoded.
async fn raw_stream(bus: &Bus, subject: &str, payload: Vec<u8>) -> Vec<Bytes> {
    let mut stream = bus
        .request_stream(subject, Bytes::from(payload), WAIT)
        .await
        .expect("request sent");
    let mut out = Vec::new();
    while let Some(item) = stream.next().await {
        out.push(item.expect("stream item"));
    }
    out
}

#[tokio::test]
async fn answers_come_in_the_request_version() {
    let bus = Bus::local();
    let fleet = MockerFleet::start(bus.clone(), fast_fleet_config(20))
        .await
        .unwrap();
    let s = fleet.subjects().clone();
    for version in [MIN_READ_VERSION, FORMAT_VERSION] {
        let req = GenerateRequest {
            request_id: format!("v{version}"),
            tokens: prompt_tokens(version as u32, 64),
            max_tokens: 3,
            dp_rank: 0,
        };
        let raw = raw_stream(&bus, &s.generate(20), encode_as(&req, version).unwrap()).await;
        let events: Vec<GenerateEvent> = raw
            .iter()
            .map(|b| {
                let (ev, v) = decode_versioned(b).unwrap();
                assert_eq!(v, version);
                ev
            })
            .collect();
        assert_eq!(summarize(&events).2 .0, 3);

        let q = StateQuery { dp_rank: 0 };
        let raw = raw_stream(&bus, &s.state(20), encode_as(&q, version).unwrap()).await;
        assert!(!raw.is_empty());
        for b in &raw {
            let (chunk, v) = decode_versioned::<Reply<StateChunk>>(b).unwrap();
            assert_eq!(v, version);
            assert!(chunk.into_result().is_ok());
        }

        let ack = bus
            .request(
                &s.drop_events(20),
                encode_as(&0u64, version).unwrap().into(),
                WAIT,
            )
            .await
            .unwrap();
        assert_eq!(decode_versioned(&ack.payload), Ok((Reply::Ok(()), version)));
    }
    // An undecodable request in the previous version is refused in that version; one in an
    // unknown version, in the current one.
    for (payload, version) in [
        (vec![MIN_READ_VERSION, 0xff], MIN_READ_VERSION),
        (vec![9, 0], FORMAT_VERSION),
    ] {
        let raw = raw_stream(&bus, &s.generate(20), payload).await;
        assert_eq!(raw.len(), 1);
        let (ev, v) = decode_versioned::<GenerateEvent>(&raw[0]).unwrap();
        assert_eq!((error_of(&[ev]), v), (ErrorKind::Malformed, version));
    }
    fleet.shutdown().await.unwrap();
}

#[tokio::test]
async fn dp_ranks_are_separate_caches() {
    let bus = Bus::local();
    let cfg = FleetConfig {
        dp_size: 2,
        dp_start_rank: 4,
        ..fast_fleet_config(20)
    };
    let fleet = MockerFleet::start(bus.clone(), cfg).await.unwrap();
    let s = fleet.subjects().clone();
    let mut kv = bus
        .subscribe(&s.every_worker(WorkerSubject::KvEvents))
        .await
        .unwrap();

    summarize(&worker_generate(&bus, &s, 20, 5, "a", prompt_tokens(1, 128), 4).await);
    let again = worker_generate(&bus, &s, 20, 4, "b", prompt_tokens(1, 128), 4).await;
    let ((_, cached_on_4, _), _, _) = summarize(&again);
    assert_eq!(cached_on_4, 0, "rank 4 has its own cache");
    let again = worker_generate(&bus, &s, 20, 5, "c", prompt_tokens(1, 128), 4).await;
    let ((_, cached_on_5, _), _, _) = summarize(&again);
    assert_eq!(cached_on_5, 7);

    let mut per_rank = BTreeMap::new();
    drain_events(&mut kv, &mut per_rank, |m| m.len() >= 2).await;
    assert_eq!(
        per_rank.keys().copied().collect::<Vec<_>>(),
        vec![WorkerKey::new(20, 4), WorkerKey::new(20, 5)]
    );

    for rank in [3, 6] {
        let e = worker_generate(&bus, &s, 20, rank, "x", prompt_tokens(1, 16), 1).await;
        assert_eq!(error_of(&e), ErrorKind::InvalidRank);
    }
    // A dead rank refuses work and state queries.
    fleet.set_rank_live(20, 5, false).await.unwrap();
    let e = worker_generate(&bus, &s, 20, 5, "y", prompt_tokens(1, 16), 1).await;
    assert_eq!(error_of(&e), ErrorKind::InvalidRank);
    let st = state(&bus, &s, 20, 5).await;
    assert!(matches!(&st[..], [Reply::Err(e)] if e.kind == ErrorKind::InvalidRank));
    fleet.set_rank_live(20, 5, true).await.unwrap();
    summarize(&worker_generate(&bus, &s, 20, 5, "z", prompt_tokens(1, 16), 1).await);
    fleet.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_fresh_rank_sends_one_empty_chunk() {
    let bus = Bus::local();
    let fleet = MockerFleet::start(bus.clone(), fast_fleet_config(30))
        .await
        .unwrap();
    let s = fleet.subjects().clone();
    let chunks = state(&bus, &s, 30, 0).await;
    assert_eq!(chunks.len(), 1);
    let c = chunks[0].clone().into_result().unwrap();
    assert_eq!((c.last_event_id, c.events.len()), (None, 0));
    fleet.shutdown().await.unwrap();
}

#[tokio::test]
async fn shutdown_ends_requests_in_flight() {
    let bus = Bus::local();
    let cfg = FleetConfig {
        speedup: 1.0,
        ..fast_fleet_config(40)
    };
    let fleet = MockerFleet::start(bus.clone(), cfg).await.unwrap();
    let s = fleet.subjects().clone();
    let running = {
        let bus = bus.clone();
        let s = s.clone();
        tokio::spawn(async move {
            worker_generate(&bus, &s, 40, 0, "long", prompt_tokens(1, 64), 10_000).await
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    fleet.shutdown().await.unwrap();
    let events = running.await.unwrap();
    match events.last() {
        Some(GenerateEvent::Error(e)) => assert_eq!(e.kind, ErrorKind::Unavailable),
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

#[test]
fn bad_configs_are_refused() {
    for cfg in [
        FleetConfig {
            workers: 0,
            ..fast_fleet_config(0)
        },
        FleetConfig {
            dp_size: 0,
            ..fast_fleet_config(0)
        },
        FleetConfig {
            speedup: 0.0,
            ..fast_fleet_config(0)
        },
        FleetConfig {
            speedup: f64::NAN,
            ..fast_fleet_config(0)
        },
        FleetConfig {
            worker_id_start: u64::MAX,
            workers: 2,
            ..fast_fleet_config(0)
        },
        FleetConfig {
            dp_start_rank: u32::MAX,
            ..fast_fleet_config(0)
        },
    ] {
        assert!(cfg.validate().is_err(), "{cfg:?}");
    }
    assert!(fast_fleet_config(0).validate().is_ok());
}

#[tokio::test]
async fn simulated_time_follows_the_wall_clock_times_speedup() {
    let bus = Bus::local();
    let cfg = FleetConfig {
        speedup: 10.0,
        ..fast_fleet_config(50)
    };
    let fleet = MockerFleet::start(bus.clone(), cfg).await.unwrap();
    let s = fleet.subjects().clone();
    let t0 = Instant::now();
    let events = worker_generate(&bus, &s, 50, 0, "a", prompt_tokens(1, 512), 60).await;
    let wall = t0.elapsed();
    let (_, itl, (_, e2e_us)) = summarize(&events);
    // 60 tokens at ≥ 7 ms each: over 400 ms simulated, so over 40 ms of wall time.
    let expected = Duration::from_micros(e2e_us / 10);
    assert!(e2e_us > 400_000, "{e2e_us}");
    assert!(wall >= expected.mul_f64(0.9), "{wall:?} vs {expected:?}");
    assert!(
        wall < expected + Duration::from_millis(500),
        "{wall:?} vs {expected:?}"
    );
    assert!(itl.iter().all(|&t| (7_000..9_000).contains(&t)), "{itl:?}");

    // Queueing counts in TTFT: two prompts at once; one waits for the other's prefill
    // (max_num_batched_tokens 8192 holds only one of them per step, ≈ 530 ms each).
    let (a, b) = tokio::join!(
        worker_generate(&bus, &s, 50, 0, "q1", prompt_tokens(2, 8000), 1),
        worker_generate(&bus, &s, 50, 0, "q2", prompt_tokens(3, 8000), 1),
    );
    let ((ttft_a, _, _), _, _) = summarize(&a);
    let ((ttft_b, _, _), _, _) = summarize(&b);
    let (fast, slow) = (ttft_a.min(ttft_b), ttft_a.max(ttft_b));
    assert!(
        fast > 500_000 && slow > fast + 400_000,
        "{fast} then {slow}"
    );
    fleet.shutdown().await.unwrap();
}

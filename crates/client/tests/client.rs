//! The client against the in-process bus, with fake replicas and workers.

use bytes::Bytes;
use kvrouter_bus::{Bus, LocalBus};
use kvrouter_client::{route_request, ClientError, GenerateParams, KvRouterClient, WorkerFailure};
use kvrouter_protocol::{
    decode, encode, ErrorKind, ErrorReply, GenerateEvent, GenerateRequest, OverlapRequest,
    OverlapScoresReply, Reply, RequestUpdate, RouteDecision, RouteRequest, Subjects, TierBlocks,
    WorkerKey,
};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const NS: &str = "test-ns";
const MODEL: &str = "Qwen/Qwen3-0.6B";

fn enc<T: kvrouter_protocol::Wire>(v: &T) -> Bytes {
    Bytes::from(encode(v).expect("encodes"))
}

fn decision(replica: &str) -> RouteDecision {
    RouteDecision {
        tier_overlap_blocks: TierBlocks::default(),
        worker_id: 7,
        dp_rank: 1,
        overlap_blocks: 3,
        replica_id: replica.to_string(),
        base_url: String::new(),
        block_size: 0,
        lease: kvrouter_protocol::Lease::NONE,
        fallbacks: Vec::new(),
    }
}

/// Answers every request on `subject` with `answer(request payload)`; returns what it saw.
async fn responder(
    bus: &Bus,
    subject: &str,
    answer: impl Fn(&[u8]) -> Bytes + Send + 'static,
) -> Arc<Mutex<Vec<Bytes>>> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut sub = bus
        .queue_subscribe(subject, "kvrouter-replicas")
        .await
        .expect("subscribes");
    let (bus, seen2) = (bus.clone(), seen.clone());
    tokio::spawn(async move {
        while let Some(msg) = sub.next().await {
            seen2.lock().unwrap().push(msg.payload.clone());
            if let Some(reply) = msg.reply {
                let _ = bus.publish(&reply, answer(&msg.payload)).await;
            }
        }
    });
    seen
}

/// A fake replica `replica_id`: answers route with a decision naming itself, records
/// mark_prefill and free calls as `(endpoint, request_id)` in arrival order.
async fn fake_replica(bus: &Bus, replica_id: &str) -> Arc<Mutex<Vec<(String, String)>>> {
    let calls = Arc::new(Mutex::new(Vec::new()));
    let subjects = Subjects::new(NS).unwrap();
    let d = decision(replica_id);
    responder(bus, &subjects.route(), move |_| enc(&Reply::Ok(d.clone()))).await;
    for (endpoint, subject) in [
        ("mark_prefill", subjects.mark_prefill(replica_id)),
        ("free", subjects.free(replica_id)),
    ] {
        let calls = calls.clone();
        responder(bus, &subject, move |payload| {
            let u: RequestUpdate = decode(payload).expect("a RequestUpdate");
            assert_eq!(u.model, MODEL);
            calls
                .lock()
                .unwrap()
                .push((endpoint.to_string(), u.request_id));
            enc(&Reply::<()>::Ok(()))
        })
        .await;
    }
    calls
}

/// A fake worker 7: answers generate with `events`, then the end marker if `end`.
async fn fake_worker(
    bus: &Bus,
    events: Vec<GenerateEvent>,
    end: bool,
) -> Arc<Mutex<Vec<GenerateRequest>>> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let subject = Subjects::new(NS).unwrap().model(MODEL).unwrap().generate(7);
    let mut sub = bus.subscribe(&subject).await.unwrap();
    let (bus, seen2) = (bus.clone(), seen.clone());
    tokio::spawn(async move {
        while let Some(msg) = sub.next().await {
            let req: GenerateRequest = decode(&msg.payload).expect("a GenerateRequest");
            seen2.lock().unwrap().push(req);
            let Some(reply) = msg.reply else { continue };
            for ev in &events {
                bus.publish(&reply, enc(ev)).await.unwrap();
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            if end {
                bus.end_stream(&reply).await.unwrap();
            }
        }
    });
    seen
}

fn client(bus: &Bus) -> KvRouterClient {
    KvRouterClient::new(bus.clone(), NS)
        .unwrap()
        .with_timeout(Duration::from_millis(500))
        .with_generate_idle_timeout(Duration::from_millis(500))
}

#[tokio::test]
async fn route_round_trips() {
    let bus = Bus::local();
    let subjects = Subjects::new(NS).unwrap();
    let seen = responder(&bus, &subjects.route(), |_| enc(&Reply::Ok(decision("r1")))).await;
    let mut req = route_request(MODEL, vec![1, 2, 3]);
    req.request_id = String::new();
    req.update_states = false;
    let d = client(&bus).route(&req).await.unwrap();
    assert_eq!(d, decision("r1"));
    let sent: RouteRequest = decode(&seen.lock().unwrap()[0]).unwrap();
    assert_eq!(sent.tokens, vec![1, 2, 3]);
    assert!(!sent.update_states);
    // An empty request id is replaced by a uuid.
    assert!(
        uuid::Uuid::parse_str(&sent.request_id).is_ok(),
        "{}",
        sent.request_id
    );
}

#[tokio::test]
async fn overlap_endpoints_round_trip() {
    let bus = Bus::local();
    let subjects = Subjects::new(NS).unwrap();
    let scores = OverlapScoresReply {
        shared_blocks: 0,
        tier_overlap_blocks: Vec::new(),
        block_size: 16,
        scores: vec![(WorkerKey::new(1, 0), 4)],
    };
    let s2 = scores.clone();
    responder(&bus, &subjects.overlap_scores(), move |_| {
        enc(&Reply::Ok(s2.clone()))
    })
    .await;
    responder(&bus, &subjects.potential_loads(), |_| {
        enc(&Reply::<Vec<kvrouter_protocol::PotentialLoad>>::Ok(vec![]))
    })
    .await;
    let req = OverlapRequest {
        model: MODEL.into(),
        tokens: vec![1; 64],
        lora: None,
    };
    let c = client(&bus);
    assert_eq!(c.overlap_scores(&req).await.unwrap(), scores);
    assert!(c.potential_loads(&req).await.unwrap().is_empty());
}

#[tokio::test]
async fn error_replies_keep_their_kind() {
    let bus = Bus::local();
    let subjects = Subjects::new(NS).unwrap();
    responder(&bus, &subjects.route(), |_| {
        enc(&Reply::<RouteDecision>::Err(ErrorReply::new(
            ErrorKind::Overloaded,
            "every worker is busy",
        )))
    })
    .await;
    let err = client(&bus)
        .route(&route_request(MODEL, vec![1, 2, 3]))
        .await
        .unwrap_err();
    match &err {
        ClientError::Router(e) => assert_eq!(e.kind, ErrorKind::Overloaded),
        other => panic!("expected Router, got {other:?}"),
    }
    assert_eq!(err.kind_label(), "overloaded");
    assert!(err.to_string().contains("every worker is busy"), "{err}");
}

#[tokio::test]
async fn no_replica_is_no_router() {
    let bus = Bus::local();
    let err = client(&bus)
        .route(&route_request(MODEL, vec![1, 2, 3]))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, ClientError::NoRouter { namespace, .. } if namespace == NS),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(msg.contains("test-ns.router.route"), "{msg}");
    assert!(
        msg.contains("kvrouter serve") && msg.contains("--namespace test-ns"),
        "{msg}"
    );
}

#[tokio::test]
async fn garbage_replies_are_decode_errors() {
    let bus = Bus::local();
    let subjects = Subjects::new(NS).unwrap();
    responder(&bus, &subjects.route(), |_| {
        Bytes::from_static(b"\x01garbage")
    })
    .await;
    let err = client(&bus)
        .route(&route_request(MODEL, vec![1, 2, 3]))
        .await
        .unwrap_err();
    assert!(matches!(err, ClientError::Decode { .. }), "{err:?}");
}

#[tokio::test]
async fn silent_replicas_time_out() {
    let bus = Bus::local();
    let subjects = Subjects::new(NS).unwrap();
    let _sub = bus.subscribe(&subjects.route()).await.unwrap();
    let c = client(&bus).with_timeout(Duration::from_millis(50));
    let err = c.route(&route_request(MODEL, vec![1])).await.unwrap_err();
    assert!(
        matches!(err, ClientError::Timeout { after, .. } if after == Duration::from_millis(50)),
        "{err:?}"
    );
}

#[tokio::test]
async fn a_replica_that_never_answers_costs_a_timeout_not_the_route() {
    let bus = Bus::local();
    let subjects = Subjects::new(NS).unwrap();
    // A replica that takes the first route request and dies with it, then a live one.
    let mut stalled = bus
        .queue_subscribe(&subjects.route(), "kvrouter-replicas")
        .await
        .unwrap();
    let taken = tokio::spawn(async move { stalled.next().await.map(|m| m.payload) });
    let c = client(&bus).with_timeout(Duration::from_millis(100));
    let req = route_request(MODEL, vec![1, 2]);
    let route = {
        let c = c.clone();
        let req = req.clone();
        tokio::spawn(async move { c.route(&req).await })
    };
    let first: RouteRequest = decode(&taken.await.unwrap().unwrap()).unwrap();
    assert_eq!(first.request_id, req.request_id);
    let seen = responder(&bus, &subjects.route(), |_| enc(&Reply::Ok(decision("r2")))).await;
    assert_eq!(route.await.unwrap().unwrap(), decision("r2"));
    let again: RouteRequest = decode(&seen.lock().unwrap()[0]).unwrap();
    assert_eq!(
        again.request_id, req.request_id,
        "the same request, asked again"
    );
}

/// Routes through `c` against a silent replica listening on `sub`: how often it was asked.
async fn times_asked(c: &KvRouterClient, sub: &mut kvrouter_bus::Subscription) -> u32 {
    let err = c.route(&route_request(MODEL, vec![1])).await.unwrap_err();
    assert!(matches!(err, ClientError::Timeout { .. }), "{err:?}");
    let mut n = 0;
    while let Ok(Some(_)) = tokio::time::timeout(Duration::from_millis(5), sub.next()).await {
        n += 1;
    }
    n
}

#[tokio::test]
async fn retries_are_bounded_and_error_replies_not_retried() {
    let bus = Bus::local();
    let subjects = Subjects::new(NS).unwrap();
    let mut silent = bus.subscribe(&subjects.route()).await.unwrap();
    let c = client(&bus).with_timeout(Duration::from_millis(30));
    assert_eq!(
        times_asked(&c.clone().with_retries(0), &mut silent).await,
        1
    );
    assert_eq!(
        times_asked(&c, &mut silent).await,
        1 + kvrouter_client::DEFAULT_RETRIES
    );
    drop(silent);
    let seen = responder(&bus, &subjects.route(), |_| {
        enc(&Reply::<RouteDecision>::Err(ErrorReply::new(
            ErrorKind::Overloaded,
            "every worker is busy",
        )))
    })
    .await;
    let err = c.route(&route_request(MODEL, vec![1])).await.unwrap_err();
    assert!(matches!(err, ClientError::Router(_)), "{err:?}");
    assert_eq!(seen.lock().unwrap().len(), 1, "an answer is final");
}

#[tokio::test]
async fn an_unavailable_replica_is_asked_past() {
    let bus = Bus::local();
    let subjects = Subjects::new(NS).unwrap();
    // The first to answer has just woken from a stall (or is draining); then a good one.
    let answered = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let n = answered.clone();
    responder(&bus, &subjects.route(), move |_| {
        if n.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
            enc(&Reply::<RouteDecision>::Err(ErrorReply::new(
                ErrorKind::Unavailable,
                "stalled",
            )))
        } else {
            enc(&Reply::Ok(decision("r2")))
        }
    })
    .await;
    let d = client(&bus).route(&route_request(MODEL, vec![1])).await;
    assert_eq!(d.unwrap(), decision("r2"));
    assert_eq!(answered.load(std::sync::atomic::Ordering::SeqCst), 2);
}

#[tokio::test]
async fn oversized_prompts_fail_before_sending() {
    let max_payload = (64 << 10) + 4000;
    let bus = Bus::Local(LocalBus::with_max_payload(max_payload));
    let subjects = Subjects::new(NS).unwrap();
    let seen = responder(&bus, &subjects.route(), |_| enc(&Reply::Ok(decision("r1")))).await;
    let c = client(&bus);
    let err = c
        .route(&route_request(MODEL, vec![5; 1001]))
        .await
        .unwrap_err();
    let ClientError::PromptTooLarge {
        tokens,
        max_payload: max,
        max_tokens,
        ..
    } = err
    else {
        panic!("expected PromptTooLarge, got {err:?}");
    };
    assert_eq!((tokens, max, max_tokens), (1001, max_payload, 1000));
    let msg = err.to_string();
    assert!(
        msg.contains("69536 bytes") && msg.contains("1000 tokens"),
        "{msg}"
    );
    assert!(seen.lock().unwrap().is_empty());
    // The advertised longest prompt does go through.
    c.route(&route_request(MODEL, vec![5; max_tokens]))
        .await
        .unwrap();
    assert_eq!(seen.lock().unwrap().len(), 1);
}

#[tokio::test]
async fn generate_marks_prefill_then_frees_on_the_deciding_replica() {
    let bus = Bus::local();
    let calls = fake_replica(&bus, "replica-a").await;
    let worker = fake_worker(
        &bus,
        vec![
            GenerateEvent::PrefillDone {
                ttft_us: 1500,
                cached_blocks: 2,
                prompt_blocks: 4,
                tier_cached_blocks: TierBlocks {
                    host: 1,
                    ..TierBlocks::on_device(1)
                },
            },
            GenerateEvent::Tokens {
                itl_us: vec![10, 20],
            },
            GenerateEvent::Tokens { itl_us: vec![30] },
            GenerateEvent::Done {
                output_tokens: 4,
                e2e_us: 1560,
            },
        ],
        true,
    )
    .await;
    let mut params = GenerateParams::new(MODEL, (0..64).collect(), 4);
    params.request_id = Some("req-1".into());
    let out = client(&bus).generate(&params).await.unwrap();
    assert_eq!(out.decision, decision("replica-a"));
    assert_eq!(out.request_id, "req-1");
    assert_eq!(
        (out.ttft_us, out.cached_blocks, out.prompt_blocks),
        (1500, 2, 4)
    );
    assert_eq!(
        (out.tier_cached_blocks.device, out.tier_cached_blocks.host),
        (1, 1)
    );
    assert_eq!(out.itl_us, vec![10, 20, 30]);
    assert_eq!(out.mean_itl_us(), Some(20.0));
    assert_eq!((out.output_tokens, out.e2e_us), (4, 1560));
    assert!(out.bookkeeping_errors.is_empty());
    let calls = calls.lock().unwrap().clone();
    assert_eq!(
        calls,
        vec![
            ("mark_prefill".to_string(), "req-1".to_string()),
            ("free".to_string(), "req-1".to_string())
        ]
    );
    let sent = worker.lock().unwrap().clone();
    assert_eq!(sent.len(), 1);
    assert_eq!((sent[0].dp_rank, sent[0].max_tokens), (1, 4));
    assert_eq!(sent[0].request_id, "req-1");
}

#[tokio::test]
async fn generate_frees_when_the_worker_fails() {
    let bus = Bus::local();
    let calls = fake_replica(&bus, "replica-b").await;
    fake_worker(
        &bus,
        vec![GenerateEvent::Error(ErrorReply::new(
            ErrorKind::Internal,
            "engine crashed",
        ))],
        true,
    )
    .await;
    let params = GenerateParams::new(MODEL, vec![1, 2, 3], 4);
    let err = client(&bus).generate(&params).await.unwrap_err();
    let ClientError::Worker {
        worker_id,
        failure: WorkerFailure::Error(e),
        request_id,
        ..
    } = &err
    else {
        panic!("expected a worker error, got {err:?}");
    };
    assert_eq!((*worker_id, e.kind), (7, ErrorKind::Internal));
    // A generated request id (uuid v4) is what the replica is told to free.
    assert!(uuid::Uuid::parse_str(request_id).is_ok());
    assert_eq!(
        calls.lock().unwrap().clone(),
        vec![("free".to_string(), request_id.clone())]
    );
}

#[tokio::test]
async fn generate_frees_when_the_stream_breaks_or_nobody_serves() {
    // The stream ends after the prefill, without Done.
    let bus = Bus::local();
    let calls = fake_replica(&bus, "replica-c").await;
    fake_worker(
        &bus,
        vec![GenerateEvent::PrefillDone {
            ttft_us: 1,
            cached_blocks: 0,
            prompt_blocks: 1,
            tier_cached_blocks: TierBlocks::default(),
        }],
        true,
    )
    .await;
    let mut params = GenerateParams::new(MODEL, vec![1, 2, 3], 4);
    params.request_id = Some("req-2".into());
    let err = client(&bus).generate(&params).await.unwrap_err();
    assert!(
        matches!(
            &err,
            ClientError::Worker {
                failure: WorkerFailure::StreamEnded,
                ..
            }
        ),
        "{err:?}"
    );
    let names: Vec<String> = calls.lock().unwrap().iter().map(|c| c.0.clone()).collect();
    assert_eq!(names, vec!["mark_prefill", "free"]);

    // The stream stalls: idle timeout.
    let bus = Bus::local();
    let calls = fake_replica(&bus, "replica-d").await;
    fake_worker(&bus, vec![], false).await;
    let err = client(&bus)
        .with_generate_idle_timeout(Duration::from_millis(50))
        .generate(&params)
        .await
        .unwrap_err();
    assert!(
        matches!(
            &err,
            ClientError::Worker {
                failure: WorkerFailure::Timeout(_),
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(calls.lock().unwrap().len(), 1);

    // No worker serves the subject.
    let bus = Bus::local();
    let calls = fake_replica(&bus, "replica-e").await;
    let err = client(&bus).generate(&params).await.unwrap_err();
    assert!(
        matches!(
            &err,
            ClientError::Worker {
                failure: WorkerFailure::NoResponders(_),
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(
        calls.lock().unwrap().clone(),
        vec![("free".to_string(), "req-2".to_string())]
    );
}

#[tokio::test]
async fn generate_without_router_does_not_free() {
    let bus = Bus::local();
    let err = client(&bus)
        .generate(&GenerateParams::new(MODEL, vec![1], 1))
        .await
        .unwrap_err();
    assert!(matches!(err, ClientError::NoRouter { .. }), "{err:?}");
}

#[test]
fn bad_namespaces_are_refused() {
    assert!(matches!(
        KvRouterClient::new(Bus::local(), "a b"),
        Err(ClientError::Subject(_))
    ));
}

/// A free that finds no replica (a NATS restart, a replica re-subscribing) is sent again
/// until one answers; an `UnknownRequest` after a failed attempt counts as delivered, a
/// first one does not; any other answer ends it.
#[tokio::test]
async fn frees_are_sent_again_until_the_replica_answers() {
    let bus = Bus::local();
    let c = client(&bus);
    let subject = Subjects::new(NS).unwrap().free("late");
    let (bus2, subject2) = (bus.clone(), subject.clone());
    let late = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(600)).await;
        responder(&bus2, &subject2, |_| enc(&Reply::<()>::Ok(()))).await
    });
    c.free_until_delivered(&booking_of_q("late")).await.unwrap();
    let seen = late.await.unwrap();
    assert_eq!(seen.lock().unwrap().len(), 1, "delivered once it was there");

    let unknown = || {
        enc(&Reply::<()>::Err(ErrorReply::new(
            ErrorKind::UnknownRequest,
            "not active",
        )))
    };
    let gone = Subjects::new(NS).unwrap().free("r-unknown");
    let seen = responder(&bus, &gone, move |_| unknown()).await;
    let first = c.free_until_delivered(&booking_of_q("r-unknown")).await;
    assert!(
        matches!(&first, Err(ClientError::Router(e)) if e.kind == ErrorKind::UnknownRequest),
        "{first:?}"
    );
    assert_eq!(
        seen.lock().unwrap().len(),
        1,
        "an answer is not tried again"
    );
}

/// A booking of request "q" held on `replica_id`.
fn booking_of_q(replica_id: &str) -> kvrouter_client::Booking {
    kvrouter_client::Booking {
        replica_id: replica_id.into(),
        model: MODEL.into(),
        request_id: "q".into(),
        lease: kvrouter_protocol::Lease::from_bits(7),
    }
}

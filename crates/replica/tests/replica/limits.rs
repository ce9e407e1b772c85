//! Hostile sizes on the bus (issue 26, "bounded by construction"): a replica answers every
//! oversize input with a typed `invalid_request` naming the field and the limit, clamps
//! numeric hints, and keeps `/metrics` the same size whatever model names callers send.

use crate::support::{fleet_config, prompt, replica_config, MODEL};
use bytes::Bytes;
use kvrouter_bus::Bus;
use kvrouter_mocker::MockerFleet;
use kvrouter_protocol::limits::{
    MAX_EXPECTED_OUTPUT_TOKENS, MAX_LORA_NAME_BYTES, MAX_MODEL_NAME_BYTES, MAX_REQUEST_ID_BYTES,
    MAX_WORKER_LIST_LEN,
};
use kvrouter_protocol::{
    decode, encode, ErrorKind, ErrorReply, OutputBlock, PromptExtras, Reply, RequestUpdate,
    RouteDecision, RouteRequest, Subjects, Wire,
};
use kvrouter_replica::Replica;
use std::time::Duration;

async fn ask<Q: Wire, A: Wire>(bus: &Bus, subject: &str, q: &Q) -> Reply<A> {
    let payload = Bytes::from(encode(q).unwrap());
    let msg = bus
        .request(subject, payload, Duration::from_secs(5))
        .await
        .unwrap();
    decode::<Reply<A>>(&msg.payload).unwrap()
}

async fn route_on_bus(bus: &Bus, req: &RouteRequest) -> Result<RouteDecision, ErrorReply> {
    let subject = Subjects::new("kvrouter").unwrap().route();
    ask::<_, RouteDecision>(bus, &subject, req)
        .await
        .into_result()
}

/// The error is `invalid_request` and names `field` and `limit`.
fn assert_refused(result: Result<impl std::fmt::Debug, ErrorReply>, field: &str, limit: usize) {
    let e = result.expect_err("refused");
    assert_eq!(e.kind, ErrorKind::InvalidRequest, "{e}");
    assert!(e.message.starts_with(field), "{field}: {e}");
    assert!(e.message.contains(&limit.to_string()), "{limit}: {e}");
    assert!(
        e.message.len() < 200,
        "the message does not echo the input: {e}"
    );
}

#[tokio::test(start_paused = true)]
async fn oversize_inputs_get_a_typed_error_and_metrics_stay_bounded() {
    let bus = Bus::local();
    let fleet = MockerFleet::start(bus.clone(), fleet_config(2, 1, 256))
        .await
        .unwrap();
    let r = Replica::start(replica_config(), bus.clone()).await.unwrap();
    assert!(r.wait_ready(Duration::from_secs(5)).await);
    let ok = || RouteRequest::new(MODEL, prompt(1, 2));

    // Sizes nobody checked before: each refused, naming the field and the limit.
    let long = |n: usize| "x".repeat(n);
    let cases = [
        (
            ok().booked(long(900 * 1024)),
            "request_id",
            MAX_REQUEST_ID_BYTES,
        ),
        (
            RouteRequest::new(long(500 * 1024), prompt(1, 2)),
            "model",
            MAX_MODEL_NAME_BYTES,
        ),
        (
            ok().with_lora(long(MAX_LORA_NAME_BYTES + 1)),
            "lora",
            MAX_LORA_NAME_BYTES,
        ),
        (
            ok().with_allowed_workers((0..MAX_WORKER_LIST_LEN as u64 + 1).collect::<Vec<_>>()),
            "allowed_workers",
            MAX_WORKER_LIST_LEN,
        ),
        (
            ok().with_excluded_workers(vec![7; MAX_WORKER_LIST_LEN + 1]),
            "excluded_workers",
            MAX_WORKER_LIST_LEN,
        ),
        (
            ok().with_extras(PromptExtras {
                block_extras: Vec::new(),
                cache_salt: Some(long(4096)),
            }),
            "cache_salt",
            1024,
        ),
    ];
    for (req, field, limit) in cases {
        assert_refused(route_on_bus(&bus, &req).await, field, limit);
    }
    // Updates by an oversize request id, on the replica's own subjects.
    let subjects = Subjects::new("kvrouter").unwrap();
    let update = RequestUpdate {
        model: MODEL.into(),
        request_id: long(MAX_REQUEST_ID_BYTES + 1),
        lease: kvrouter_protocol::Lease::NONE,
    };
    for subject in [
        subjects.free(r.replica_id()),
        subjects.mark_prefill(r.replica_id()),
    ] {
        let reply = ask::<_, ()>(&bus, &subject, &update).await;
        assert_refused(reply.into_result(), "request_id", MAX_REQUEST_ID_BYTES);
    }
    let block = OutputBlock {
        model: MODEL.into(),
        request_id: long(MAX_REQUEST_ID_BYTES + 1),
        decay_fraction: None,
        lease: kvrouter_protocol::Lease::NONE,
    };
    let reply = ask::<_, ()>(&bus, &subjects.add_output_block(r.replica_id()), &block).await;
    assert_refused(reply.into_result(), "request_id", MAX_REQUEST_ID_BYTES);

    // At the limits: routed. Duplicate-heavy lists are fine, hints are clamped.
    let at = ok()
        .booked(long(MAX_REQUEST_ID_BYTES))
        .with_allowed_workers(vec![10; MAX_WORKER_LIST_LEN])
        .with_priority_jump(1e308)
        .with_expected_output_tokens(u32::MAX);
    let d = route_on_bus(&bus, &at).await.expect("within every limit");
    assert_eq!(d.worker_id, 10);
    let load = || {
        r.shared()
            .metrics
            .render()
            .lines()
            .find(|l| {
                l.starts_with("kvrouter_worker_active_blocks{") && l.contains("worker=\"10\"")
            })
            .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
    };
    // 2 prompt blocks plus the output, clamped to the rank's 256-block capacity (far
    // below the 2^20-token cap).
    const { assert!(MAX_EXPECTED_OUTPUT_TOKENS / 16 > 256) };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    while load() != Some(2 + 256) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(load(), Some(2 + 256));

    // A flood of unknown model names (each within the length limit, some with a bad pin
    // too) adds one series, not one per name.
    let unknown = |i: u32| RouteRequest::new(format!("{i:08}-{}", long(200)), prompt(1, 1));
    let _ = route_on_bus(&bus, &unknown(0)).await;
    let before = r.shared().metrics.render().len();
    for i in 1..200 {
        let e = route_on_bus(&bus, &unknown(i)).await.unwrap_err();
        assert_eq!(e.kind, ErrorKind::UnknownModel);
    }
    let text = r.shared().metrics.render();
    assert!(
        text.len() <= before + 16,
        "/metrics grew from {before} to {} bytes",
        text.len()
    );
    assert!(
        text.contains(r#"kvrouter_route_errors_total{model="_other",kind="unknown_model"} 200"#),
        "{text}"
    );
    assert!(!text.contains("xxxxxxxx"), "no caller's name is a label");

    r.shutdown().await;
    fleet.shutdown().await.unwrap();
}

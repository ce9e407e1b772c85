//! Route leases on the bus (docs/protocol.md, "Route leases"), end to end: the real binary
//! over a real nats-server and a mocker fleet; a caller that did not route a request cannot
//! mark, extend, free or abandon it, and a previous-version caller's unleased bookings are
//! taken only by a replica started for a rolling upgrade.

use crate::common;

use bytes::Bytes;
use common::{
    e2e_tokens as tokens, free_port, metric_sum as sum, ready, serve, wait_until, E2eClient,
    NatsServer, E2E_BLOCK as BLOCK, E2E_MODEL as MODEL,
};
use kvrouter_client::{Booking, ClientError};
use kvrouter_protocol::{
    decode, encode, encode_as, Abandon, ErrorKind, Lease, Reply, RequestUpdate, RouteDecision,
    RouteRequest, Subjects, MIN_READ_VERSION,
};
use std::time::Duration;

const ACTIVE: &str = "kvrouter_worker_active_requests";
const REFUSED: &str = "kvrouter_replica_lease_refused_total";

impl E2eClient {
    /// One request-reply on the bus with raw bytes, decoded as `Reply<T>`.
    fn raw<T: kvrouter_protocol::Wire>(&self, subject: &str, payload: Vec<u8>) -> Reply<T> {
        let msg = self
            .rt
            .block_on(
                self.bus()
                    .request(subject, Bytes::from(payload), Duration::from_secs(3)),
            )
            .expect("an answer");
        decode(&msg.payload).expect("a reply")
    }

    fn publish(&self, subject: &str, payload: Vec<u8>) {
        self.rt
            .block_on(self.bus().publish(subject, Bytes::from(payload)))
            .expect("publish");
    }
}

fn unknown(r: Result<(), ClientError>) -> bool {
    matches!(r, Err(ClientError::Router(e)) if e.kind == ErrorKind::UnknownRequest)
}

#[test]
fn only_the_lease_holder_ends_a_request_and_unleased_bookings_wait_for_an_upgrade_flag() {
    let nats = NatsServer::start();
    let _fleet = common::mocker(&nats, 100, 1, 1, BLOCK);
    let (pa, pb) = (free_port(), free_port());
    let _a = serve(&nats, "a", pa, &[]);
    assert!(ready(pa), "replica a turns ready");
    let owner = E2eClient::new(&nats);
    let intruder = E2eClient::new(&nats);
    let subjects = Subjects::new("kvrouter").unwrap();

    // The owner books a request: the decision carries its lease.
    let req = RouteRequest::new(MODEL, tokens(1, 2)).booked("victim");
    let d: RouteDecision = owner.route_req(req.clone()).expect("route");
    assert_eq!(d.lease, req.lease);
    assert!(!d.lease.is_none());
    assert!(wait_until(Duration::from_secs(3), || sum(pa, ACTIVE) == 1.0));

    // Someone who knows the request id but not the lease: every report is refused, with
    // the answer an unknown request gets, and counted.
    let forged = Booking {
        lease: Lease::random(),
        ..Booking::new(&d, MODEL, "victim")
    };
    let c = &intruder.client;
    assert!(unknown(intruder.rt.block_on(c.mark_prefill(&forged))));
    assert!(unknown(
        intruder.rt.block_on(c.add_output_block(&forged, None))
    ));
    assert!(unknown(intruder.rt.block_on(c.free(&forged))));
    let bare = Booking {
        lease: Lease::NONE,
        ..forged.clone()
    };
    assert!(unknown(intruder.rt.block_on(c.free(&bare))));
    // An abandon under another lease frees nothing either.
    let abandon = Abandon {
        model: MODEL.into(),
        request_id: "victim".into(),
        call_id: req.call_id,
        kept_by: None,
        lease: Lease::random(),
    };
    intruder.publish(&subjects.abandon(), encode(&abandon).unwrap());
    assert!(wait_until(Duration::from_secs(3), || sum(pa, REFUSED) == 5.0));
    assert_eq!(sum(pa, ACTIVE), 1.0, "the request is still held");

    // The holder's reports go through; then it is gone.
    let mine = Booking::new(&d, MODEL, "victim");
    owner.rt.block_on(owner.client.mark_prefill(&mine)).unwrap();
    owner.rt.block_on(owner.client.free(&mine)).unwrap();
    assert!(wait_until(Duration::from_secs(3), || sum(pa, ACTIVE) == 0.0));

    // An abandon under the booking's lease frees it.
    let req = RouteRequest::new(MODEL, tokens(2, 2)).booked("left");
    owner.route_req(req.clone()).expect("route");
    assert!(wait_until(Duration::from_secs(3), || sum(pa, ACTIVE) == 1.0));
    let abandon = Abandon {
        model: MODEL.into(),
        request_id: "left".into(),
        call_id: req.call_id,
        kept_by: None,
        lease: req.lease,
    };
    owner.publish(&subjects.abandon(), encode(&abandon).unwrap());
    assert!(wait_until(Duration::from_secs(3), || sum(pa, ACTIVE) == 0.0));

    // A booking without a lease (what a caller that knows no leases sends) is refused, in
    // either version read...
    let old = RouteRequest::new(MODEL, tokens(3, 2))
        .with_request_id("old")
        .with_update_states(true);
    for payload in [
        encode(&old).unwrap(),
        encode_as(&old, MIN_READ_VERSION).unwrap(),
    ] {
        match intruder.raw::<RouteDecision>(&subjects.route(), payload) {
            Reply::Err(e) => {
                assert_eq!(e.kind, ErrorKind::InvalidRequest);
                assert!(e.message.contains("--allow-unleased"), "{}", e.message);
            }
            Reply::Ok(d) => panic!("an unleased booking was taken: {d:?}"),
        }
    }
    assert_eq!(sum(pa, ACTIVE), 0.0);

    // ...unless the replica is started with --allow-unleased: then such a caller books and
    // frees as before leases existed.
    drop(_a);
    let _b = serve(&nats, "b", pb, &["--allow-unleased"]);
    assert!(ready(pb), "replica b turns ready");
    let d = match intruder.raw::<RouteDecision>(&subjects.route(), encode(&old).unwrap()) {
        Reply::Ok(d) => d,
        Reply::Err(e) => panic!("refused: {e:?}"),
    };
    assert!(d.lease.is_none());
    assert!(wait_until(Duration::from_secs(3), || sum(pb, ACTIVE) == 1.0));
    let free = RequestUpdate {
        model: MODEL.into(),
        request_id: "old".into(),
        lease: Lease::NONE,
    };
    match intruder.raw::<()>(&subjects.free("b"), encode(&free).unwrap()) {
        Reply::Ok(()) => {}
        Reply::Err(e) => panic!("the unleased free was refused: {e:?}"),
    }
    assert!(wait_until(Duration::from_secs(3), || sum(pb, ACTIVE) == 0.0));
}

//! End to end over a real nats-server with the real binary: replica sync (`--replica-sync`).
//! Replicas see each other's requests, a late one catches up, and a replica killed without
//! a word leaves its peers once its lease runs out, taking its requests with it.

use crate::common;

use common::{
    e2e_tokens as tokens, free_port, metric_sum as sum, ready, serve, wait_until,
    E2eClient as Client, NatsServer, E2E_BLOCK as BLOCK, E2E_MODEL as MODEL,
};
use kvrouter_protocol::RouteRequest;
use std::time::Duration;

const ACTIVE: &str = "kvrouter_worker_active_requests";
const PEERS: &str = "kvrouter_replica_sync_peers";
const LOST: &str = "kvrouter_replica_sync_peers_lost_total";

#[test]
fn synced_replicas_share_requests_catch_up_and_drop_a_killed_peer() {
    let nats = NatsServer::start();
    let _fleet = common::mocker(&nats, 100, 2, 1, BLOCK);
    let (pa, pb) = (free_port(), free_port());
    let a = serve(&nats, "a", pa, &["--replica-sync"]);
    let _b = serve(&nats, "b", pb, &["--replica-sync"]);
    assert!(ready(pa) && ready(pb));
    assert!(
        wait_until(Duration::from_secs(5), || sum(pa, PEERS) == 1.0
            && sum(pb, PEERS) == 1.0),
        "each replica sees the other"
    );

    let c = Client::new(&nats);
    let mut by_a = 0;
    for i in 0..12u32 {
        let d = c
            .route_req(RouteRequest::new(MODEL, tokens(i, 4)).booked(format!("q{i}")))
            .expect("route");
        by_a += usize::from(d.replica_id == "a");
    }
    assert!(
        by_a > 0 && by_a < 12,
        "both replicas decided some: a {by_a}"
    );
    assert!(
        wait_until(Duration::from_secs(5), || sum(pa, ACTIVE) == 12.0
            && sum(pb, ACTIVE) == 12.0),
        "every replica counts all 12: a {}, b {}",
        sum(pa, ACTIVE),
        sum(pb, ACTIVE)
    );

    // A replica started now catches up from a peer.
    let pc = free_port();
    let _c = serve(&nats, "c", pc, &["--replica-sync"]);
    assert!(ready(pc));
    assert!(
        wait_until(Duration::from_secs(5), || sum(pc, ACTIVE) == 12.0),
        "the late replica counts all 12: {}",
        sum(pc, ACTIVE)
    );

    // Killed without a word: its peers drop it and its requests after the 3 s lease.
    a.kill();
    let left = (12 - by_a) as f64;
    for port in [pb, pc] {
        assert!(
            wait_until(Duration::from_secs(8), || sum(port, ACTIVE) == left
                && sum(port, PEERS) == 1.0
                && sum(port, LOST) == 1.0),
            "a's requests dropped: {} active, {} peers, {} lost",
            sum(port, ACTIVE),
            sum(port, PEERS),
            sum(port, LOST)
        );
    }
}

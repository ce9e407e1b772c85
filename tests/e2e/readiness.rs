//! Honest readiness over a real nats-server with the real binary: `/readyz` follows the bus
//! connection, and a new serving indexer is used by remote replicas as soon as it announces
//! itself, not after their breaker's cooldown.

use crate::common;

use common::{
    e2e_tokens as tokens, free_port, http_get, let_nats_notice, metrics, plain_route, ready, serve,
    wait_until, E2eClient as Client, NatsServer, E2E_MODEL as MODEL,
};
use kvrouter_client::GenerateParams;
use std::time::Duration;

/// The value of a series (0 when absent).
fn series(port: u16, name: &str) -> f64 {
    metrics(port)
        .lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or(0.0)
}

#[test]
fn readyz_turns_503_while_the_bus_is_down_and_back_after_reconnecting() {
    let nats = NatsServer::start();
    let port = nats.port;
    let _fleet = common::mocker(&nats, 100, 2, 1, 16);
    let admin = free_port();
    let _replica = serve(&nats, "r1", admin, &[]);
    assert!(ready(admin));
    assert_eq!(series(admin, "kvrouter_bus_connected"), 1.0);

    // Stopped by PID; dropping the handle later kills nothing that is still there.
    let _ = std::process::Command::new("kill")
        .arg(nats.pid().to_string())
        .status();
    assert!(
        wait_until(Duration::from_secs(10), || {
            let (code, body) = http_get(admin, "/readyz");
            code == 503 && body.contains("bus")
        }),
        "readyz stayed ready with the bus down: {:?}",
        http_get(admin, "/readyz")
    );
    assert_eq!(series(admin, "kvrouter_bus_connected"), 0.0);

    let _back = NatsServer::start_on_port(port, &[]);
    assert!(ready(admin), "ready again after reconnecting");
    assert_eq!(series(admin, "kvrouter_bus_connected"), 1.0);
    assert!(series(admin, "kvrouter_bus_disconnects_total") >= 1.0);
    // It routes again, with the workers re-synced.
    let c = Client::new(&_back);
    let prompt = tokens(3, 4);
    assert!(
        wait_until(Duration::from_secs(10), || c
            .route_req(plain_route(&prompt))
            .is_ok()),
        "routes resume"
    );
}

#[test]
fn a_new_serving_indexer_is_used_as_soon_as_it_announces_itself() {
    let nats = NatsServer::start();
    let _fleet = common::mocker(&nats, 100, 2, 2, 16);
    let (ps1, pr1, ps2) = (free_port(), free_port(), free_port());
    let mut s1 = serve(&nats, "s1", ps1, &["--serve-indexer"]);
    // A long breaker cooldown: without the announcement r1 would route blind for 30 s.
    let _r1 = serve(
        &nats,
        "r1",
        pr1,
        &[
            "--use-remote-indexer",
            "--remote-indexer-timeout-ms",
            "50",
            "--remote-indexer-breaker-cooldown-ms",
            "30000",
        ],
    );
    assert!(ready(ps1) && ready(pr1));
    let c = Client::new(&nats);
    let prompt = tokens(1, 8);
    let p = GenerateParams::new(MODEL, prompt.clone(), 4);
    c.rt.block_on(c.client.generate(&p)).expect("generate");

    // The serving indexer hangs: r1's lookups time out and its breaker opens.
    s1.signal(libc::SIGSTOP);
    let breaker = r#"kvrouter_remote_indexer_breaker_open{model="Qwen/Qwen3-0.6B"}"#;
    assert!(
        wait_until(Duration::from_secs(30), || {
            let _ = c.route_req(plain_route(&prompt)); // s1 may take it and time out
            series(pr1, breaker) == 1.0
        }),
        "r1's breaker never opened"
    );
    s1.kill();
    let_nats_notice();

    // A new serving indexer syncs and announces itself; from then on no route is blind.
    let announced = r#"kvrouter_remote_indexer_announcements_total{model="Qwen/Qwen3-0.6B"}"#;
    let before = series(pr1, announced); // s1's, when it started
    let _s2 = serve(&nats, "s2", ps2, &["--serve-indexer"]);
    assert!(
        wait_until(Duration::from_secs(20), || series(pr1, announced) > before),
        "r1 never heard s2's announcement"
    );
    assert_eq!(
        series(pr1, breaker),
        0.0,
        "the announcement closed the breaker"
    );
    let mut by_r1 = 0;
    for i in 0..30 {
        let d = c.route_req(plain_route(&prompt)).expect("route");
        assert_eq!(
            d.overlap_blocks, 8,
            "route {i} after the announcement, answered by {}, was blind",
            d.replica_id
        );
        by_r1 += usize::from(d.replica_id == "r1");
    }
    assert!(by_r1 > 0, "r1 answered none of the routes");
}

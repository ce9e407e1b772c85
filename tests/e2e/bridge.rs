//! `kvrouter bridge` end to end: vLLM's own KV event publisher (the current release's, from
//! its wheel: tests/engines/engine.py), the real bridge binary, real `serve` replicas and a
//! real nats-server. Malformed frames come from the stand-in (no release sends them); every
//! release's wire is checked in engines.rs.

use crate::common;

use common::engine::{Engine, STANDIN, VLLM};
use common::*;
use kvrouter_protocol::WorkerKey;
use serde_json::json;
use std::time::{Duration, Instant};

fn metric(text: &str, name: &str) -> u64 {
    metric_sum_in(text, name) as u64
}

#[test]
fn bridge_feeds_replicas_replays_gaps_and_follows_restarts_and_health() {
    let nats = NatsServer::start();
    let mut engine = Engine::start(VLLM, 2);
    let (a1, a2) = (free_port(), free_port());
    let _r1 = serve(&nats, "r1", a1, &[]);
    let _r2 = serve(&nats, "r2", a2, &[]);
    let (_bridge, worker, ab) = bridge(&nats, &engine.at(true));
    assert!(ready(ab), "bridge /readyz: {:?}", http_get(ab, "/readyz"));
    assert!(ready(a1) && ready(a2));
    let client = E2eClient::new(&nats);
    let (k0, k1) = (WorkerKey::new(worker, 0), WorkerKey::new(worker, 1));

    // A prefix stored on rank 1 is seen there, in full, by the replicas.
    let a = e2e_tokens(1, 4);
    engine.store(1, &a);
    assert!(client.overlap_becomes(&a, k1, 4));
    assert_eq!(client.overlap(&a, k0), 0);
    // A route goes there, and names the engine's HTTP address from the registration.
    let d = client.route_req(plain_route(&a)).unwrap();
    assert_eq!((d.worker_id, d.dp_rank, d.overlap_blocks), (worker, 1, 4));
    assert_eq!(d.base_url, format!("http://127.0.0.1:{}", engine.http));

    // Two batches of rank 0 lost on the wire, then one more: the bridge replays the two.
    // (The first batch a bridge sees is never a gap: rank 0 gets one before.)
    let warm = e2e_tokens(9, 1);
    engine.store(0, &warm);
    assert!(client.overlap_becomes(&warm, k0, 1));
    let (b, c, d) = (e2e_tokens(2, 3), e2e_tokens(3, 2), e2e_tokens(4, 2));
    engine.cmd(json!({"drop": {"rank": 0, "count": 2}}));
    engine.store(0, &b);
    engine.store(0, &c);
    engine.store(0, &d);
    assert!(client.overlap_becomes(&b, k0, 3), "replayed batch B");
    assert!(client.overlap_becomes(&c, k0, 2), "replayed batch C");
    assert!(client.overlap_becomes(&d, k0, 2));
    let m = http_get(ab, "/metrics").1;
    assert_eq!(metric(&m, "kvrouter_bridge_gaps_replayed_total"), 1, "{m}");
    assert_eq!(metric(&m, "kvrouter_bridge_ranks_cleared_total"), 0, "{m}");

    // The engine restarts (sequence numbers from 0, caches empty), seen first on rank 1:
    // every rank's old blocks are gone everywhere, and rank 0's own restart signal (its
    // next batch) is the same restart, not another.
    engine.cmd(json!({"restart": {"rank": 1}}));
    engine.cmd(json!({"restart": {"rank": 0}}));
    let e = e2e_tokens(5, 2);
    engine.store(1, &e);
    assert!(
        client.overlap_becomes(&a, k1, 0),
        "restarted rank's old blocks"
    );
    assert!(client.overlap_becomes(&e, k1, 2));
    assert!(
        client.overlap_becomes(&b, k0, 0),
        "the other rank's old blocks"
    );
    let f = e2e_tokens(6, 2);
    engine.store(0, &f);
    assert!(client.overlap_becomes(&f, k0, 2));
    assert!(
        client.overlap_becomes(&e, k1, 2),
        "rank 1 kept after rank 0's signal"
    );
    let m = http_get(ab, "/metrics").1;
    assert_eq!(
        metric(&m, "kvrouter_bridge_engine_restarts_total"),
        1,
        "{m}"
    );

    // The engine's own load (its metrics, scraped by the bridge) reaches the replicas.
    engine.cmd(json!({"load": {"rank": 0, "running": 2, "waiting": 5, "usage": 0.5}}));
    let labels = format!("{{model=\"{E2E_MODEL}\",worker=\"{worker}\",dp_rank=\"0\"}}");
    let waiting = format!("kvrouter_worker_reported_waiting_requests{labels} 5");
    let blocks = format!("kvrouter_worker_reported_active_blocks{labels} 500");
    assert!(
        wait_until(Duration::from_secs(10), || {
            let m = metrics(a1);
            m.contains(&waiting) && m.contains(&blocks)
        }),
        "{}",
        metrics(a1)
    );

    // The engine's health check fails: its ranks leave routing within a second or so.
    engine.cmd(json!({"health": false}));
    let t = Instant::now();
    assert!(wait_until(Duration::from_secs(5), || {
        client.overlap(&f, k0) == 0 && client.overlap(&f, k0) == 0
    }));
    let took = t.elapsed();
    assert!(
        took < Duration::from_millis(1500),
        "unroutable after {took:?}"
    );
    assert_eq!(http_get(ab, "/readyz").0, 503);
    // Back: taken for a restart (a new instance), then rebuilt from the engine's replay
    // buffer, which here still holds everything since sequence number 0 (this engine did not
    // really restart): the blocks from before the failure are back, with the new ones.
    engine.cmd(json!({"health": true}));
    let g = e2e_tokens(7, 3);
    assert!(wait_until(Duration::from_secs(10), || {
        engine.store(0, &g);
        client.overlap(&g, k0) == 3
    }));
    assert!(
        client.overlap_becomes(&f, k0, 2),
        "rebuilt from the replay buffer"
    );
    assert!(ready(ab));
    let m = http_get(ab, "/metrics").1;
    assert_eq!(
        metric(&m, "kvrouter_bridge_engine_restarts_total"),
        2,
        "{m}"
    );
}

/// An engine in the bridge's pod publishing on socket files (`ipc://`, which it binds):
/// the bridge connects to them, catches up from the replay socket at start, and follows.
#[test]
fn a_bridge_follows_an_engine_over_ipc_socket_files() {
    let nats = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let (a1, ports) = (free_port(), [free_port(), free_port(), free_port()]);
    let _r1 = serve(&nats, "r1", a1, &[]);
    let mut engine = Engine::spawn(
        VLLM,
        ports,
        1,
        &[format!("--ipc-dir={}", dir.path().display())],
    )
    .unwrap();
    let at = EngineAt {
        kind: "vllm",
        zmq: ports[0],
        replay: None,
        http: ports[2],
        dp: 1,
        capacity_blocks: 1000,
    };
    // Published before the bridge starts: only the replay socket can tell it.
    let early = e2e_tokens(1, 3);
    engine.store(0, &early);
    let events = format!("ipc://{}/events", dir.path().display());
    let replay = format!("ipc://{}/replay", dir.path().display());
    let (_bridge, worker, ab) = bridge_at(&nats, &at, &events, &["--replay-endpoint", &replay]);
    assert!(ready(ab), "bridge /readyz: {:?}", http_get(ab, "/readyz"));
    assert!(ready(a1));
    let client = E2eClient::new(&nats);
    let k0 = WorkerKey::new(worker, 0);
    assert!(client.overlap_becomes(&early, k0, 3), "caught up over ipc");
    let live = e2e_tokens(2, 4);
    engine.store(0, &live);
    assert!(client.overlap_becomes(&live, k0, 4), "live over ipc");
    let m = http_get(ab, "/metrics").1;
    assert!(
        metric(&m, "kvrouter_bridge_batches_caught_up_total") >= 1,
        "{m}"
    );
}

/// Events going elsewhere (here: the bridge listens for another topic) while the engine
/// runs requests: after `--events-silent-secs` the rank is reported silent; an idle engine
/// publishing nothing is not.
#[test]
fn a_busy_engine_whose_events_never_arrive_is_reported_silent() {
    let nats = NatsServer::start();
    let mut engine = Engine::start(VLLM, 1);
    let (_bridge, _worker, ab) = bridge_with(
        &nats,
        &engine.at(true),
        &["--topic", "kv@", "--events-silent-secs", "1"],
    );
    assert!(ready(ab), "bridge /readyz: {:?}", http_get(ab, "/readyz"));
    let silent = || metric(&http_get(ab, "/metrics").1, "kvrouter_bridge_events_silent");
    // Idle, and publishing what the bridge does not hear: nothing to say.
    engine.store(0, &e2e_tokens(1, 2));
    std::thread::sleep(Duration::from_millis(2000));
    assert_eq!(silent(), 0, "an idle engine reported silent");
    // Busy: silent within a second or so.
    engine.cmd(json!({"load": {"rank": 0, "running": 2, "waiting": 0, "usage": 0.1}}));
    assert!(
        wait_until(Duration::from_secs(10), || silent() == 1),
        "{}",
        http_get(ab, "/metrics").1
    );
    let m = http_get(ab, "/metrics").1;
    assert!(
        metric(&m, "kvrouter_bridge_seconds_since_last_batch") >= 2,
        "{m}"
    );
    assert_eq!(metric(&m, "kvrouter_bridge_batches_total"), 0, "{m}");
}

/// The usual order in a pod: the bridge starts while the engine still loads its weights
/// (its health check failing, nothing listening). The engine's first healthy answer is its
/// start, not a restart: no new instance, no restart counted, its first events kept; a later
/// loss of health and return still counts as one.
#[test]
fn a_bridge_started_before_its_engine_counts_its_start_as_no_restart() {
    let nats = NatsServer::start();
    let (a1, ports) = (free_port(), [free_port(), free_port(), free_port()]);
    let _r1 = serve(&nats, "r1", a1, &[]);
    let at = EngineAt {
        kind: "vllm",
        zmq: ports[0],
        replay: Some(ports[1]),
        http: ports[2],
        dp: 1,
        capacity_blocks: 1000,
    };
    let (_bridge, worker, ab) = bridge(&nats, &at);
    let restarts = || {
        metric(
            &http_get(ab, "/metrics").1,
            "kvrouter_bridge_engine_restarts_total",
        )
    };
    // Several failed health checks (every 250 ms) and connection attempts.
    assert!(wait_until(Duration::from_secs(10), || {
        metric(
            &http_get(ab, "/metrics").1,
            "kvrouter_bridge_engine_healthy",
        ) == 0
            && http_get(ab, "/readyz").0 == 503
    }));
    std::thread::sleep(Duration::from_millis(1500));
    let mut engine = Engine::spawn(VLLM, ports, 1, &[]).unwrap();
    assert!(ready(ab), "bridge /readyz: {:?}", http_get(ab, "/readyz"));
    assert!(ready(a1));
    let client = E2eClient::new(&nats);
    let k0 = WorkerKey::new(worker, 0);
    // The engine's first events, at once: none lost to a restart racing them.
    let a = e2e_tokens(1, 4);
    engine.store(0, &a);
    assert!(client.overlap_becomes(&a, k0, 4));
    assert_eq!(restarts(), 0, "the engine's start counted as a restart");
    // Later, health lost and back: a restart, as before.
    engine.cmd(json!({"health": false}));
    assert!(wait_until(Duration::from_secs(5), || http_get(
        ab, "/readyz"
    )
    .0 == 503));
    engine.cmd(json!({"health": true}));
    assert!(wait_until(Duration::from_secs(10), || restarts() == 1));
    assert!(ready(ab));
}

#[test]
fn without_replay_a_gap_clears_the_rank_and_a_killed_bridge_leaves() {
    let nats = NatsServer::start();
    let mut engine = Engine::start(STANDIN, 1);
    let a1 = free_port();
    let _r1 = serve(&nats, "r1", a1, &[]);
    let (bridge, worker, ab) = bridge(&nats, &engine.at(false));
    assert!(ready(ab) && ready(a1));
    let client = E2eClient::new(&nats);
    let k0 = WorkerKey::new(worker, 0);

    let a = e2e_tokens(1, 3);
    engine.store(0, &a);
    assert!(client.overlap_becomes(&a, k0, 3));
    engine.cmd(json!({"drop": {"rank": 0, "count": 1}}));
    engine.store(0, &e2e_tokens(2, 2));
    let c = e2e_tokens(3, 2);
    engine.store(0, &c);
    // The rank was cleared, then the batch after the gap applied.
    assert!(client.overlap_becomes(&a, k0, 0));
    assert!(client.overlap_becomes(&c, k0, 2));
    let m = http_get(ab, "/metrics").1;
    assert_eq!(metric(&m, "kvrouter_bridge_ranks_cleared_total"), 1, "{m}");

    // Malformed messages are counted by kind; the good batch after them still lands. (An
    // unreadable payload loses what it held, so the rank is cleared once more.)
    for kind in ["frames", "seq", "payload"] {
        engine.cmd(json!({"garbage": {"rank": 0, "kind": kind}}));
    }
    let after = e2e_tokens(4, 2);
    engine.store(0, &after);
    assert!(client.overlap_becomes(&after, k0, 2));
    let m = http_get(ab, "/metrics").1;
    for kind in ["frames", "sequence", "payload"] {
        let line = format!("kvrouter_bridge_malformed_total{{reason=\"{kind}\"}} 1");
        assert!(m.contains(&line), "{line} in {m}");
    }
    assert_eq!(metric(&m, "kvrouter_bridge_ranks_cleared_total"), 2, "{m}");

    // A killed bridge's worker leaves within its lease.
    bridge.kill();
    assert!(
        wait_until(Duration::from_secs(10), || client.overlap(&after, k0) == 0),
        "the worker of a killed bridge is still routable"
    );
}

/// Issue 27: with `--zmq-bind` the bridge listens on each rank's port and the engine's
/// publisher connects to it over loopback (vLLM's does for `tcp://127.0.0.1:PORT`), so the
/// engine's events (prompt token ids) never listen on the pod's network. A batch published
/// before the publisher's subscription arrived is lost on the wire, and recovered by the
/// replay; the bound socket outlives the engine, whose next process connects to it again.
#[test]
fn a_binding_bridge_takes_events_from_publishers_that_connect_to_it() {
    let nats = NatsServer::start();
    let ports = [free_ports(2), free_ports(2), free_port()];
    let mut engine = Engine::spawn(VLLM, ports, 2, &["--zmq-connect".into()]).unwrap();
    let a1 = free_port();
    let _r1 = serve(&nats, "r1", a1, &[]);
    let (_bridge, worker, ab) = bridge_with(&nats, &engine.at(true), &["--zmq-bind"]);
    // Ready only once both ranks' publishers connected.
    assert!(ready(ab), "bridge /readyz: {:?}", http_get(ab, "/readyz"));
    assert!(ready(a1));
    let connected = || metric(&http_get(ab, "/metrics").1, "kvrouter_bridge_zmq_connected");
    assert_eq!(connected(), 2);
    let client = E2eClient::new(&nats);
    let (k0, k1) = (WorkerKey::new(worker, 0), WorkerKey::new(worker, 1));

    // Published as soon as the bridge is ready: maybe before the subscription reached the
    // publisher. Whatever the later batches' sequence numbers show missing is replayed.
    let a = e2e_tokens(1, 3);
    engine.store(1, &a);
    let warm = e2e_tokens(2, 1);
    assert!(wait_until(Duration::from_secs(10), || {
        engine.store(1, &warm);
        client.overlap(&warm, k1) == 1
    }));
    assert!(
        client.overlap_becomes(&a, k1, 3),
        "the first batch of rank 1"
    );
    let b = e2e_tokens(3, 2);
    engine.store(0, &b);
    assert!(client.overlap_becomes(&b, k0, 2));
    assert_eq!(client.overlap(&b, k1), 0);

    // The engine goes away: no publisher, not ready.
    drop(engine);
    assert!(
        wait_until(Duration::from_secs(10), || http_get(ab, "/readyz").0 == 503),
        "still ready without an engine"
    );
    assert!(
        wait_until(Duration::from_secs(10), || connected() == 0),
        "ranks still connected without a publisher"
    );
    // A new engine process on the same ports connects to the same bound sockets: the old
    // blocks are gone, the new ones land on their ranks.
    let mut engine = Engine::spawn(VLLM, ports, 2, &["--zmq-connect".into()]).unwrap();
    assert!(ready(ab), "bridge /readyz: {:?}", http_get(ab, "/readyz"));
    assert_eq!(connected(), 2);
    let c = e2e_tokens(4, 2);
    assert!(wait_until(Duration::from_secs(10), || {
        engine.store(0, &c);
        client.overlap(&c, k0) == 2
    }));
    assert!(client.overlap_becomes(&b, k0, 0), "the old engine's blocks");
    assert!(client.overlap_becomes(&a, k1, 0), "the old engine's blocks");
    let d = e2e_tokens(5, 2);
    engine.store(1, &d);
    assert!(client.overlap_becomes(&d, k1, 2));
}

/// The largest resident size the process has had, from /proc (Linux), in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap_or_else(|| panic!("no VmHWM in {status}"));
    kb * 1024
}

/// Issue 26: an events array claiming 2^32-1 elements before one nil once grew the bridge
/// to gigabytes. That payload is refused (and the rank cleared, as for any unreadable
/// payload); a megabyte of one-byte bad events is a batch of skips, counted; a bad event
/// between two good ones is skipped and the good ones land, in order. The bridge stays
/// small, answers /healthz, and still stops promptly on SIGTERM.
#[test]
fn poison_payloads_are_refused_or_skipped_and_good_events_still_land() {
    let nats = NatsServer::start();
    let mut engine = Engine::start(STANDIN, 1);
    let a1 = free_port();
    let _r1 = serve(&nats, "r1", a1, &[]);
    let (mut bridge, worker, ab) = bridge(&nats, &engine.at(true));
    assert!(ready(ab) && ready(a1));
    let client = E2eClient::new(&nats);
    let k0 = WorkerKey::new(worker, 0);
    let warm = e2e_tokens(1, 2);
    engine.store(0, &warm);
    assert!(client.overlap_becomes(&warm, k0, 2));

    engine.cmd(json!({"raw": {"rank": 0, "hex": "9200ddffffffffc0"}}));
    let nils: u64 = 1 << 20;
    let hex = format!("9200dd{nils:08x}{}", "c0".repeat(nils as usize));
    engine.cmd(json!({"raw": {"rank": 0, "hex": hex}}));
    // Good, nil, good: the second good event extends the first, so its blocks are only
    // routable if both landed, in order.
    let a = e2e_tokens(2, 4);
    engine.cmd(json!({"store": {"rank": 0, "tokens": a, "parent": null, "bad": "c0"}}));
    assert!(
        client.overlap_becomes(&a, k0, 4),
        "the good events around the bad one"
    );
    assert!(
        client.overlap_becomes(&warm, k0, 0),
        "the refused payload cleared the rank"
    );

    assert_eq!(http_get(ab, "/healthz").0, 200);
    let m = http_get(ab, "/metrics").1;
    let line = "kvrouter_bridge_malformed_total{reason=\"payload\"} 1";
    assert!(m.contains(line), "{line} in {m}");
    let line = format!(
        "kvrouter_bridge_events_skipped_total{{reason=\"malformed\"}} {}",
        nils + 1
    );
    assert!(m.contains(&line), "{line} in {m}");
    assert_eq!(metric(&m, "kvrouter_bridge_ranks_cleared_total"), 1, "{m}");
    let rss = peak_rss(bridge.pid());
    assert!(rss < 256 << 20, "the bridge peaked at {} MiB", rss >> 20);

    bridge.signal(libc::SIGTERM);
    let status = bridge.wait_exit(Duration::from_secs(5));
    assert!(status.is_some_and(|s| s.success()), "SIGTERM -> {status:?}");
}

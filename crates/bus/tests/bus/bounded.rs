//! Bounded bus work for shutdown paths: with the NATS server gone, `flush_within` and
//! `publish_within` give up in time instead of waiting for a reconnect that never comes.

use bytes::Bytes;
use kvrouter_bus::{Bus, BusError, NatsOptions};
use kvrouter_testkit::NatsServer;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_nats_down_flush_and_publish_give_up_in_time() {
    let server = NatsServer::start();
    let bus = Bus::connect(&NatsOptions::new(server.url()))
        .await
        .expect("connect");
    bus.publish("bounded.x", Bytes::from_static(b"x"))
        .await
        .unwrap();
    bus.flush_within(Duration::from_secs(5))
        .await
        .expect("a live server takes the flush");

    drop(server); // killed by PID
    let deadline = Instant::now() + Duration::from_secs(10);
    while bus.is_connected() {
        assert!(Instant::now() < deadline, "the client never noticed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let limit = Duration::from_millis(300);
    let started = Instant::now();
    let e = bus.flush_within(limit).await.unwrap_err();
    let took = started.elapsed();
    assert_eq!(
        e,
        BusError::Stalled {
            what: "flush".into(),
            after: limit
        }
    );
    assert!(took >= limit && took < limit * 3, "{took:?}");
    assert!(e.to_string().contains("connection is down"), "{e}");

    // Publishes queue up while disconnected; once the client's queue is full a plain publish
    // would wait for the reconnect. The bounded one gives up.
    let limit = Duration::from_millis(50);
    let started = Instant::now();
    let mut stalled = None;
    for i in 0..1_000_000u32 {
        if let Err(e) = bus
            .publish_within("bounded.x", Bytes::from_static(b"x"), limit)
            .await
        {
            stalled = Some((i, e));
            break;
        }
    }
    let (queued, e) = stalled.expect("the outbound queue fills up");
    assert!(queued > 0, "the first publishes are only queued");
    assert_eq!(
        e,
        BusError::Stalled {
            what: "publish to 'bounded.x'".into(),
            after: limit
        }
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

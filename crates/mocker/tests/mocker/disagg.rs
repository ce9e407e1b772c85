//! Prefill and decode workers on the in-process bus: per-tp-rank KV transfer reports, a
//! decode that waits for every tp rank to receive, and the silenced tp rank test hook.

use bytes::Bytes;
use kvrouter_bus::{Bus, Subscription};
use kvrouter_mocker::{EngineConfig, FleetConfig, FleetError, MockerFleet};
use kvrouter_protocol::{
    decode, encode, ErrorKind, GenerateEvent, GenerateRequest, TransferReport, TransferSide,
    WorkerRole, WorkerSubject,
};
use std::time::Duration;
use tokio::time::{timeout, Instant};

const MODEL: &str = "test/disagg";
const WAIT: Duration = Duration::from_secs(5);

fn disagg_fleet_config(role: WorkerRole, worker_id_start: u64) -> FleetConfig {
    FleetConfig {
        worker_id_start,
        role,
        tp_size: 2,
        speedup: 1.0,
        engine: EngineConfig {
            block_size: 16,
            capacity_blocks: 1000,
            ..EngineConfig::default()
        },
        // 4 blocks: 100 ms per tp rank at speedup 1.
        kv_transfer_per_block: Duration::from_millis(25),
        kv_receive_timeout: Duration::from_millis(400),
        ..FleetConfig::new(MODEL)
    }
}

/// `blocks` full 16-token blocks of tokens unique to `seed`.
fn seeded_prompt(seed: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * 16).map(|t| seed * 100_000 + t).collect()
}

/// Runs a request; returns each stream event with the time it arrived since the start.
async fn timed_generate(
    bus: &Bus,
    fleet: &MockerFleet,
    worker_id: u64,
    request_id: &str,
    tokens: Vec<u32>,
) -> Vec<(Duration, GenerateEvent)> {
    let req = GenerateRequest {
        request_id: request_id.into(),
        tokens,
        max_tokens: 3,
        dp_rank: 0,
    };
    let start = Instant::now();
    let mut stream = bus
        .request_stream(
            &fleet.subjects().generate(worker_id),
            Bytes::from(encode(&req).unwrap()),
            WAIT,
        )
        .await
        .unwrap();
    let mut out = Vec::new();
    while let Some(item) = stream.next().await {
        out.push((start.elapsed(), decode(&item.unwrap()).unwrap()));
    }
    out
}

/// Transfer reports until `quiet` passes without one.
async fn reports(sub: &mut Subscription, quiet: Duration) -> Vec<TransferReport> {
    let mut out = Vec::new();
    while let Ok(Some(msg)) = timeout(quiet, sub.next()).await {
        out.push(decode(&msg.payload).unwrap());
    }
    out
}

fn tp_ranks(reports: &[TransferReport], side: TransferSide, request_id: &str) -> Vec<u32> {
    let mut r: Vec<u32> = reports
        .iter()
        .filter(|r| r.side == side && r.request_ids == [request_id])
        .map(|r| r.tp_rank)
        .collect();
    r.sort_unstable();
    r
}

#[tokio::test]
async fn decode_starts_once_every_tp_rank_received() {
    let bus = Bus::local();
    let fleet = MockerFleet::start(bus.clone(), disagg_fleet_config(WorkerRole::Decode, 1))
        .await
        .unwrap();
    let mut sub = bus
        .subscribe(&fleet.subjects().every_worker(WorkerSubject::KvTransfer))
        .await
        .unwrap();
    let sent_at = Instant::now();
    let (events, got) = tokio::join!(
        timed_generate(&bus, &fleet, 1, "a", seeded_prompt(1, 4)),
        async {
            // Each report with when it arrived.
            let mut got = Vec::new();
            while let Ok(Some(msg)) = timeout(Duration::from_millis(600), sub.next()).await {
                got.push((
                    sent_at.elapsed(),
                    decode::<TransferReport>(&msg.payload).unwrap(),
                ));
            }
            got
        }
    );
    let all: Vec<TransferReport> = got.iter().map(|(_, r)| r.clone()).collect();
    assert_eq!(
        tp_ranks(&all, TransferSide::Received, "a"),
        vec![0, 1],
        "one Received report per tp rank: {all:?}"
    );
    assert_eq!(all.len(), 2, "{all:?}");
    let last_received = got.iter().map(|(t, _)| *t).max().unwrap();
    assert!(last_received >= Duration::from_millis(100), "{got:?}");
    let (first_at, first) = &events[0];
    let GenerateEvent::PrefillDone { ttft_us, .. } = first else {
        panic!("the request runs: {events:?}");
    };
    assert!(
        *first_at >= last_received,
        "first token at {first_at:?}, before the last tp rank received at {last_received:?}"
    );
    assert!(*ttft_us >= 100_000, "TTFT counts the transfer: {ttft_us}");
    assert!(
        matches!(
            events.last(),
            Some((
                _,
                GenerateEvent::Done {
                    output_tokens: 3,
                    ..
                }
            ))
        ),
        "{events:?}"
    );
    fleet.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_silenced_decode_tp_rank_fails_the_request_after_the_receive_timeout() {
    let bus = Bus::local();
    let fleet = MockerFleet::start(
        bus.clone(),
        FleetConfig {
            silence_tp_rank: Some(1),
            ..disagg_fleet_config(WorkerRole::Decode, 1)
        },
    )
    .await
    .unwrap();
    let mut sub = bus
        .subscribe(&fleet.subjects().every_worker(WorkerSubject::KvTransfer))
        .await
        .unwrap();
    let events = timed_generate(&bus, &fleet, 1, "a", seeded_prompt(1, 4)).await;
    assert_eq!(events.len(), 1, "no token, one error: {events:?}");
    let (at, GenerateEvent::Error(e)) = &events[0] else {
        panic!("an error: {events:?}");
    };
    assert_eq!(e.kind, ErrorKind::Unavailable);
    assert!(
        e.message.contains("tp ranks [1]") && e.message.contains("KV transfer"),
        "{e}"
    );
    assert!(
        *at >= Duration::from_millis(400),
        "after the timeout: {at:?}"
    );
    let got = reports(&mut sub, Duration::from_millis(200)).await;
    assert_eq!(
        got.iter().map(|r| (r.tp_rank, r.side)).collect::<Vec<_>>(),
        vec![(0, TransferSide::Received)],
        "only the live tp rank reports"
    );

    // Unsilenced at run time: the next request runs.
    fleet.silence_tp_rank(1, None).unwrap();
    let events = timed_generate(&bus, &fleet, 1, "b", seeded_prompt(2, 4)).await;
    assert!(
        matches!(events.last(), Some((_, GenerateEvent::Done { .. }))),
        "{events:?}"
    );
    assert_eq!(
        tp_ranks(
            &reports(&mut sub, Duration::from_millis(100)).await,
            TransferSide::Received,
            "b"
        ),
        vec![0, 1]
    );
    assert!(matches!(
        fleet.silence_tp_rank(1, Some(2)),
        Err(FleetError::InvalidTpRank { tp_rank: 2, .. })
    ));
    fleet.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_silenced_prefill_tp_rank_never_reports_sent() {
    let bus = Bus::local();
    let fleet = MockerFleet::start(
        bus.clone(),
        FleetConfig {
            speedup: 100.0,
            silence_tp_rank: Some(0),
            ..disagg_fleet_config(WorkerRole::Prefill, 7)
        },
    )
    .await
    .unwrap();
    let mut sub = bus
        .subscribe(&fleet.subjects().every_worker(WorkerSubject::KvTransfer))
        .await
        .unwrap();
    let events = timed_generate(&bus, &fleet, 7, "p", seeded_prompt(3, 4)).await;
    assert!(
        matches!(
            events.last(),
            Some((
                _,
                GenerateEvent::Done {
                    output_tokens: 0,
                    ..
                }
            ))
        ),
        "the prefill itself runs: {events:?}"
    );
    let got = reports(&mut sub, Duration::from_millis(200)).await;
    assert_eq!(tp_ranks(&got, TransferSide::Sent, "p"), vec![1]);
    assert_eq!(got.len(), 1, "{got:?}");
    fleet.shutdown().await.unwrap();
}

#[test]
fn a_silenced_tp_rank_must_exist() {
    let c = FleetConfig {
        silence_tp_rank: Some(2),
        ..disagg_fleet_config(WorkerRole::Decode, 1)
    };
    assert!(matches!(c.validate(), Err(FleetError::Config(m)) if m.contains("silence_tp_rank")));
    let c = FleetConfig {
        kv_receive_timeout: Duration::ZERO,
        ..disagg_fleet_config(WorkerRole::Decode, 1)
    };
    assert!(c.validate().is_err());
}

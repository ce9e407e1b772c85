//! Randomness of the choice: fair tie-breaks, temperature sampling, seed determinism.

use kvrouter_protocol::{SequenceHash, WorkerKey};
use kvrouter_scheduler::{RouteQuery, Scheduler, SchedulerConfig};
use std::time::Instant;

fn scheduler(seed: u64, temperature: f64, keys: u64) -> Scheduler {
    let mut s = Scheduler::new(SchedulerConfig {
        block_size: 16,
        temperature,
        seed,
        ..Default::default()
    })
    .unwrap();
    for w in 0..keys {
        s.add_worker_key(WorkerKey::new(w, 0), 1000);
    }
    s
}

fn hashes(base: u64, n: u64) -> Vec<SequenceHash> {
    (0..n).map(|i| SequenceHash(base * 1000 + i)).collect()
}

#[test]
fn ties_are_broken_fairly_at_random() {
    let mut s = scheduler(1, 0.0, 8);
    let h = hashes(1, 4);
    let q = RouteQuery::new(64, &h);
    let mut counts = [0u32; 8];
    for _ in 0..1000 {
        counts[s.select(&q, &[]).unwrap().key.worker_id as usize] += 1;
    }
    // Expected 125 each.
    assert!(
        counts.iter().all(|&c| (70..=180).contains(&c)),
        "{counts:?}"
    );

    // Ties among a subset only: the cheapest two (cached prefix) share the load.
    let overlaps = [(WorkerKey::new(3, 0), 4), (WorkerKey::new(6, 0), 4)];
    let mut counts = [0u32; 8];
    for _ in 0..1000 {
        counts[s.select(&q, &overlaps).unwrap().key.worker_id as usize] += 1;
    }
    assert_eq!(counts[3] + counts[6], 1000, "{counts:?}");
    assert!((400..=600).contains(&counts[3]), "{counts:?}");
}

#[test]
fn temperature_prefers_cheaper_keys_but_not_exclusively() {
    let mut s = scheduler(2, 1.0, 3);
    let now = Instant::now();
    // Decode load: key 0 none, key 1 20 blocks, key 2 60 blocks.
    s.add_request("l1".into(), WorkerKey::new(1, 0), &hashes(7, 20), 0, now)
        .unwrap();
    s.add_request("l2".into(), WorkerKey::new(2, 0), &hashes(8, 60), 0, now)
        .unwrap();
    let h = hashes(1, 4);
    let q = RouteQuery::new(64, &h);
    let mut counts = [0u32; 3];
    for _ in 0..3000 {
        counts[s.select(&q, &[]).unwrap().key.worker_id as usize] += 1;
    }
    assert!(counts[0] > counts[1] && counts[1] > counts[2], "{counts:?}");
    assert!(counts[2] > 0, "{counts:?}");

    // Temperature 0 with the same loads: always the cheapest.
    let mut s0 = scheduler(2, 0.0, 3);
    s0.add_request("l1".into(), WorkerKey::new(1, 0), &hashes(7, 20), 0, now)
        .unwrap();
    s0.add_request("l2".into(), WorkerKey::new(2, 0), &hashes(8, 60), 0, now)
        .unwrap();
    for _ in 0..100 {
        assert_eq!(s0.select(&q, &[]).unwrap().key, WorkerKey::new(0, 0));
    }
}

fn choices(seed: u64, temperature: f64) -> Vec<WorkerKey> {
    let mut s = scheduler(seed, temperature, 8);
    let now = Instant::now();
    (0..200)
        .map(|i| {
            let h = hashes(i % 5, 3);
            let q = RouteQuery::new(48, &h);
            let sel = s.route(&q, &[], format!("r{i}"), true, now).unwrap();
            if i % 3 == 0 {
                s.free(&format!("r{}", i / 2));
            }
            sel.key
        })
        .collect()
}

#[test]
fn same_seed_same_choices() {
    for t in [0.0, 0.7] {
        assert_eq!(choices(5, t), choices(5, t));
        assert_ne!(choices(5, t), choices(6, t));
    }
}

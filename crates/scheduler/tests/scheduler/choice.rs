//! Randomness of the choice: fair tie-breaks, temperature sampling, seed determinism.

use kvrouter_protocol::{SequenceHash, WorkerKey};
use kvrouter_scheduler::{RouteQuery, RoutingPolicy, Scheduler, SchedulerConfig};
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

fn with_policy(policy: RoutingPolicy, keys: u64) -> Scheduler {
    let mut s = Scheduler::new(SchedulerConfig {
        block_size: 16,
        policy,
        seed: 5,
        ..Default::default()
    })
    .unwrap();
    for w in 0..keys {
        s.add_worker_key(WorkerKey::new(w, 0), 1000);
    }
    s
}

#[test]
fn baseline_policies_ignore_the_cache() {
    let now = Instant::now();
    let h = hashes(1, 4);
    let q = RouteQuery::new(64, &h);
    // Key 2 holds the whole prefix: kv goes there every time.
    let overlaps = [(WorkerKey::new(2, 0), 4)];
    let mut kv = with_policy(RoutingPolicy::Kv, 4);
    assert!((0..20).all(|_| kv.select(&q, &overlaps).unwrap().key.worker_id == 2));

    // Round robin visits every key in turn, whatever the overlaps.
    let mut rr = with_policy(RoutingPolicy::RoundRobin, 4);
    let picks: Vec<u64> = (0..8)
        .map(|_| rr.select(&q, &overlaps).unwrap().key.worker_id)
        .collect();
    assert_eq!(picks[..4], picks[4..]);
    let mut distinct = picks[..4].to_vec();
    distinct.sort_unstable();
    assert_eq!(distinct, vec![0, 1, 2, 3]);

    // Random spreads over every key.
    let mut random = with_policy(RoutingPolicy::Random, 4);
    let mut counts = [0u32; 4];
    for _ in 0..400 {
        counts[random.select(&q, &overlaps).unwrap().key.worker_id as usize] += 1;
    }
    assert!(
        counts.iter().all(|&c| (50..=150).contains(&c)),
        "{counts:?}"
    );

    // Least loaded avoids the cached but loaded key 2 and takes the idle key 3.
    let mut ll = with_policy(RoutingPolicy::LeastLoaded, 4);
    for (w, n) in [(0, 10), (1, 5), (2, 40)] {
        ll.add_request(
            format!("r{w}"),
            WorkerKey::new(w, 0),
            &hashes(10 + w, n),
            0,
            now,
        )
        .unwrap();
    }
    assert!((0..20).all(|_| ll.select(&q, &overlaps).unwrap().key.worker_id == 3));
    for p in ["kv", "round-robin", "random", "least-loaded"] {
        assert_eq!(p.parse::<RoutingPolicy>().unwrap().as_str(), p);
    }
    assert!("fastest".parse::<RoutingPolicy>().is_err());
}

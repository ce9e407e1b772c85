//! What several modules of this suite share: the model and block size of the in-process
//! fleets, a mocker fleet's and a replica's configuration, seeded prompts and a replica's
//! per-model metrics.

use kvrouter_mocker::{EngineConfig, FleetConfig};
use kvrouter_replica::{Replica, ReplicaConfig};
use std::time::Duration;

/// The model every in-process fleet and replica here serves.
pub(crate) const MODEL: &str = "m";
/// The mocker fleets' block size, in tokens.
pub(crate) const BLOCK: u32 = 16;

/// A fast mocker fleet of [`MODEL`]: `workers` workers from id 10, `dp` ranks each of
/// `capacity_blocks` [`BLOCK`]-token blocks, 200 ms heartbeats (override fields as needed).
pub(crate) fn fleet_config(workers: u32, dp: u32, capacity_blocks: usize) -> FleetConfig {
    FleetConfig {
        model: MODEL.into(),
        workers,
        worker_id_start: 10,
        dp_size: dp,
        engine: EngineConfig {
            block_size: BLOCK as usize,
            capacity_blocks,
            ..EngineConfig::default()
        },
        speedup: 1000.0,
        heartbeat_interval: Duration::from_millis(200),
        ..FleetConfig::default()
    }
}

/// A replica of [`MODEL`], quick to discover (override fields as needed).
pub(crate) fn replica_config() -> ReplicaConfig {
    ReplicaConfig {
        models: vec![MODEL.into()],
        discovery_window: Duration::from_millis(100),
        ..ReplicaConfig::default()
    }
}

/// `len` tokens unique to `seed`: `seed * 100_000 + position`.
pub(crate) fn seeded_tokens(seed: u32, len: u32) -> Vec<u32> {
    (0..len).map(|t| seed * 100_000 + t).collect()
}

/// `blocks` full [`BLOCK`]-token blocks of tokens unique to `seed`.
pub(crate) fn prompt(seed: u32, blocks: u32) -> Vec<u32> {
    seeded_tokens(seed, blocks * BLOCK)
}

/// The value of a replica's `{model="m"}` series, 0 when absent.
pub(crate) fn model_metric(replica: &Replica, name: &str) -> u64 {
    let text = replica.shared().metrics.render();
    let prefix = format!("{name}{{model=\"{MODEL}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map_or(0, |v| v.trim().parse::<f64>().unwrap() as u64)
}

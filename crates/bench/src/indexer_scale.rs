//! `kvrouter bench indexer --scale`: the index at fleet scale, generated without a trace.
//!
//! `workers × ranks` worker keys. Every rank holds one of `system_prompts` shared system
//! prompts (`system_blocks` blocks, held by a quarter of the fleet each) and then chains of
//! `chain_blocks` blocks of its own (conversations), until the fleet holds `pairs` live
//! (block, rank) pairs. Lookups ask for a random rank's chain plus a few new blocks.
//! Finally one extra rank of `dump_blocks` blocks is dumped and rebuilt from the dump, as a
//! replica does when a peer recovers a rank.

use crate::indexer_bench::{page_faults, rss_bytes, time_lookups, BenchError, IndexMode};
use kvrouter_indexer::{Index, RankDump, ShardedIndex, ShardedIndexConfig};
use kvrouter_protocol::{
    EngineBlockHash, KvEvent, KvEventData, LocalBlockHash, StoredBlock, Tier, WorkerKey,
};
use serde::Serialize;
use std::time::Instant;

#[derive(Clone, Debug, Serialize)]
pub struct ScaleConfig {
    pub workers: u64,
    pub ranks: u32,
    pub pairs: u64,
    pub chain_blocks: u64,
    pub system_prompts: u64,
    pub system_blocks: u64,
    pub lookups: usize,
    pub dump_blocks: u64,
    pub seed: u64,
}

impl Default for ScaleConfig {
    fn default() -> Self {
        Self {
            workers: 1000,
            ranks: 8,
            pairs: 100_000_000,
            chain_blocks: 192,
            system_prompts: 4,
            system_blocks: 8,
            lookups: 100_000,
            dump_blocks: 65_536,
            seed: 1,
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct ScaleFigures {
    pub worker_keys: usize,
    pub live_pairs: usize,
    pub live_blocks: usize,
    pub apply_secs: f64,
    pub block_ops_per_s: f64,
    pub apply_minor_page_faults: u64,
    pub lookup_p50_us: f64,
    pub lookup_p99_us: f64,
    pub lookups_per_s: f64,
    pub mean_best_overlap: f64,
    pub rss_bytes: u64,
    pub bytes_per_pair: f64,
    pub table_bytes_per_pair: f64,
    pub dump_blocks: usize,
    pub dump_ms: f64,
    pub rebuild_ms: f64,
}

fn mix(mut x: u64) -> u64 {
    // splitmix64's finaliser: distinct inputs, well-spread outputs.
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The local hash of block `i` of chain `c` of rank number `r` (`r = u64::MAX`: system
/// prompt `c`); the engine hash is derived from it.
fn local(seed: u64, r: u64, c: u64, i: u64) -> u64 {
    mix(seed ^ mix(r ^ mix(c << 20 | i)))
}

fn engine(local: u64) -> u64 {
    mix(local ^ 0x5EED)
}

struct Plan<'a> {
    cfg: &'a ScaleConfig,
    chains_per_rank: u64,
}

impl Plan<'_> {
    fn system(&self, r: u64) -> u64 {
        r % self.cfg.system_prompts.max(1)
    }

    fn stored(
        &self,
        key: WorkerKey,
        event_id: u64,
        parent: Option<u64>,
        locals: &[u64],
    ) -> KvEvent {
        KvEvent {
            tier: Tier::Device,
            key,
            event_id,
            data: KvEventData::Stored {
                parent: parent.map(EngineBlockHash),
                blocks: locals
                    .iter()
                    .map(|&l| StoredBlock {
                        engine_hash: EngineBlockHash(engine(l)),
                        local_hash: LocalBlockHash(l),
                    })
                    .collect(),
            },
        }
    }

    fn system_locals(&self, s: u64) -> Vec<u64> {
        (0..self.cfg.system_blocks)
            .map(|i| local(self.cfg.seed, u64::MAX, s, i))
            .collect()
    }

    /// Events that fill rank number `r` with `chains` chains.
    fn rank_events(&self, r: u64, key: WorkerKey, chains: u64) -> Vec<KvEvent> {
        let sys = self.system_locals(self.system(r));
        let parent = sys.last().map(|&l| engine(l));
        let mut events = vec![self.stored(key, 0, None, &sys)];
        for c in 0..chains {
            let locals: Vec<u64> = (0..self.cfg.chain_blocks)
                .map(|i| local(self.cfg.seed, r, c, i))
                .collect();
            events.push(self.stored(key, c + 1, parent, &locals));
        }
        events
    }

    fn query(&self, r: u64, c: u64, extra: u64) -> Vec<LocalBlockHash> {
        let mut q = self.system_locals(self.system(r));
        q.extend((0..self.cfg.chain_blocks + extra).map(|i| local(self.cfg.seed, r, c, i)));
        q.into_iter().map(LocalBlockHash).collect()
    }
}

enum Target {
    Core(Box<Index>),
    Sharded(ShardedIndex),
}

/// Builds the fleet, measures, and reports.
pub async fn run_scale(
    cfg: &ScaleConfig,
    mode: IndexMode,
    shards: usize,
) -> Result<ScaleFigures, BenchError> {
    let keys = cfg.workers * cfg.ranks as u64;
    if keys == 0 || cfg.chain_blocks == 0 {
        return Err(BenchError::Config(
            "--workers, --ranks and the chain length must be at least 1".into(),
        ));
    }
    let per_rank = cfg.pairs / keys;
    let plan = Plan {
        cfg,
        chains_per_rank: per_rank.saturating_sub(cfg.system_blocks) / cfg.chain_blocks,
    };
    let rss_before = rss_bytes()?;
    let mut target = match mode {
        IndexMode::Core => Target::Core(Box::default()),
        IndexMode::Sharded => Target::Sharded(
            ShardedIndex::start(ShardedIndexConfig {
                shards,
                ..Default::default()
            })
            .await?,
        ),
    };
    let faults = page_faults();
    let t0 = Instant::now();
    let mut ops = 0u64;
    for r in 0..keys {
        let key = WorkerKey::new(r / cfg.ranks as u64, (r % cfg.ranks as u64) as u32);
        let events = plan.rank_events(r, key, plan.chains_per_rank);
        ops += events.iter().map(|e| e.block_count() as u64).sum::<u64>();
        match &mut target {
            Target::Core(index) => {
                for ev in &events {
                    let _ = index.apply(ev);
                }
            }
            Target::Sharded(index) => {
                index.apply_batch(events)?;
                // Bound what waits in the mailboxes.
                if r % 64 == 63 {
                    index.flush().await?;
                }
            }
        }
    }
    if let Target::Sharded(index) = &target {
        index.flush().await?;
    }
    let apply_secs = t0.elapsed().as_secs_f64();
    let apply_faults = page_faults().0 - faults.0;
    let rss_after = rss_bytes()?;
    let stats = match &target {
        Target::Core(index) => index.stats(),
        Target::Sharded(index) => index.stats(),
    };

    let mut rng = fastrand::Rng::with_seed(cfg.seed);
    let queries: Vec<Vec<LocalBlockHash>> = (0..cfg.lookups)
        .map(|_| {
            let r = rng.u64(0..keys);
            plan.query(r, rng.u64(0..plan.chains_per_rank.max(1)), rng.u64(0..16))
        })
        .collect();
    let lookup = |q: &[LocalBlockHash]| match &target {
        Target::Core(index) => index.find_matches(q).best(),
        Target::Sharded(index) => index.find_matches(q).best(),
    };
    let t = time_lookups(&queries, lookup);

    // One big rank, dumped and rebuilt.
    let big = WorkerKey::new(cfg.workers, 0);
    let chains = cfg.dump_blocks.saturating_sub(cfg.system_blocks) / cfg.chain_blocks;
    let events = plan.rank_events(keys, big, chains);
    let (dump, dump_ms, rebuild_ms) = match &mut target {
        Target::Core(index) => {
            for ev in &events {
                let _ = index.apply(ev);
            }
            let t = Instant::now();
            let dump = index.dump(big);
            let dump_ms = t.elapsed().as_secs_f64() * 1e3;
            let dump = dump.unwrap_or_else(|| empty_dump(big));
            let t = Instant::now();
            let _ = index.load_rank(&dump);
            (dump, dump_ms, t.elapsed().as_secs_f64() * 1e3)
        }
        Target::Sharded(index) => {
            index.apply_and_wait(events).await?;
            let t = Instant::now();
            let dump = index.dump(big).await?;
            let dump_ms = t.elapsed().as_secs_f64() * 1e3;
            let dump = dump.unwrap_or_else(|| empty_dump(big));
            let t = Instant::now();
            index.load_rank(dump.clone()).await?;
            (dump, dump_ms, t.elapsed().as_secs_f64() * 1e3)
        }
    };
    let dump_blocks = dump.events.iter().map(|e| e.block_count()).sum();
    if let Target::Sharded(index) = target {
        index.stop().await;
    }
    let pairs = stats.live_pairs.max(1) as f64;
    Ok(ScaleFigures {
        worker_keys: stats.worker_keys,
        live_pairs: stats.live_pairs,
        live_blocks: stats.live_blocks,
        apply_secs,
        block_ops_per_s: ops as f64 / apply_secs.max(1e-12),
        apply_minor_page_faults: apply_faults,
        lookup_p50_us: t.p50_us,
        lookup_p99_us: t.p99_us,
        lookups_per_s: t.per_s,
        mean_best_overlap: t.best_sum as f64 / queries.len().max(1) as f64,
        rss_bytes: rss_after.saturating_sub(rss_before),
        bytes_per_pair: rss_after.saturating_sub(rss_before) as f64 / pairs,
        table_bytes_per_pair: stats.table_bytes as f64 / pairs,
        dump_blocks,
        dump_ms,
        rebuild_ms,
    })
}

fn empty_dump(key: WorkerKey) -> RankDump {
    RankDump {
        key,
        last_event_id: None,
        events: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_small_fleet_holds_what_was_planned_and_rebuilds_its_big_rank() {
        let cfg = ScaleConfig {
            workers: 10,
            ranks: 8,
            pairs: 80 * (8 + 3 * 16),
            chain_blocks: 16,
            lookups: 200,
            dump_blocks: 8 + 5 * 16,
            ..ScaleConfig::default()
        };
        for (mode, copies) in [(IndexMode::Core, 1), (IndexMode::Sharded, 2)] {
            let f = run_scale(&cfg, mode, 2).await.unwrap();
            assert_eq!(f.worker_keys, 80);
            // 80 ranks of 3 chains; the 4 system prompts are shared (once per shard)
            assert_eq!(f.live_pairs, 80 * (8 + 48));
            assert_eq!(f.live_blocks, copies * 4 * 8 + 80 * 48);
            // every query is a held chain plus up to 15 new blocks
            assert_eq!(f.mean_best_overlap, 8.0 + 16.0);
            // the big rank: its system prompt and 5 chains
            assert_eq!(f.dump_blocks, 8 + 80);
        }
    }
}

//! `kvrouter bench indexer`: apply the trace's event stream to the index, then look up every
//! request, and measure block ops/s, lookup latency and bytes per live (block, rank) pair.

use crate::indexer_stream::{request_hashes, StreamBuilder, StreamConfig, StreamError};
use crate::stats::{percentile, Spread};
use crate::stream_file::{write_event, StreamFileError, StreamFileReader};
use crate::trace::TraceReader;
use kvrouter_indexer::{Index, IndexStats, ShardError, ShardedIndex, ShardedIndexConfig};
use kvrouter_protocol::{KvEvent, LocalBlockHash};
use serde::Serialize;
use std::io::{BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;
use thiserror::Error;

/// Events per message to the shards: large enough to amortise the hop, small enough that a
/// write lock never blocks readers for long.
pub const BATCH_EVENTS: usize = 256;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum IndexMode {
    /// Shard actors and the shared read path: what a replica runs.
    Sharded,
    /// The bare synchronous core.
    Core,
}

impl std::str::FromStr for IndexMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "sharded" => Ok(Self::Sharded),
            "core" => Ok(Self::Core),
            other => Err(format!("unknown mode {other:?} (expected sharded or core)")),
        }
    }
}

#[derive(Debug, Error)]
pub enum BenchError {
    #[error(transparent)]
    Stream(#[from] StreamError),
    #[error(transparent)]
    StreamFile(#[from] StreamFileError),
    #[error(transparent)]
    Shard(#[from] ShardError),
    #[error("cannot write {path}: {source}")]
    Export {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid settings: {0}")]
    Config(String),
    #[error("cannot read RSS from /proc/self/status: {0}")]
    Rss(String),
    #[error("the memory-measurement run failed: {0}")]
    MemoryRun(String),
}

/// The stream, decoded, with every request's lookup query.
pub struct BuiltStream {
    pub events: Vec<KvEvent>,
    pub queries: Vec<Vec<LocalBlockHash>>,
    pub requests: u64,
    pub stored_blocks: u64,
    pub removed_blocks: u64,
}

/// Builds the stream from a trace, writing it to `export` as it goes when given.
pub fn build_stream(
    trace: &Path,
    config: StreamConfig,
    export: Option<&Path>,
) -> Result<BuiltStream, BenchError> {
    let mut builder = StreamBuilder::new(config)?;
    let mut out = match export {
        Some(path) => Some((
            path,
            BufWriter::new(
                std::fs::File::create(path).map_err(|source| BenchError::Export {
                    path: path.to_owned(),
                    source,
                })?,
            ),
        )),
        None => None,
    };
    let mut built = BuiltStream {
        events: Vec::new(),
        queries: Vec::new(),
        requests: 0,
        stored_blocks: 0,
        removed_blocks: 0,
    };
    for req in TraceReader::open(trace).map_err(StreamError::from)? {
        let req = req.map_err(StreamError::from)?;
        let r = builder.requests();
        let start = built.events.len();
        builder.push_request(&req.hash_ids, &mut built.events)?;
        for ev in &built.events[start..] {
            match &ev.data {
                kvrouter_protocol::KvEventData::Stored { blocks, .. } => {
                    built.stored_blocks += blocks.len() as u64
                }
                _ => built.removed_blocks += ev.block_count() as u64,
            }
            if let Some((_, w)) = out.as_mut() {
                write_event(w, ev)?;
            }
        }
        if !req.hash_ids.is_empty() {
            built
                .queries
                .push(request_hashes(r, &req.hash_ids, config.sub_blocks)?.0);
        }
    }
    built.requests = builder.requests();
    if let Some((path, mut w)) = out {
        w.flush().map_err(|source| BenchError::Export {
            path: path.to_owned(),
            source,
        })?;
    }
    Ok(built)
}

/// Figures of one timed run.
#[derive(Clone, Debug, Serialize)]
pub struct RunFigures {
    pub apply_secs: f64,
    pub block_ops_per_s: f64,
    pub lookup_p50_us: f64,
    pub lookup_p99_us: f64,
    pub lookups_per_s: f64,
    pub mean_best_overlap: f64,
    pub live_pairs: usize,
    pub live_blocks: usize,
    pub refused_events: u64,
    /// Page faults the process took while applying the stream (minor, major).
    pub apply_page_faults: (u64, u64),
}

/// Page faults of this process so far (minor, major).
pub fn page_faults() -> (u64, u64) {
    // SAFETY: getrusage writes into the struct we pass.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return (0, 0);
    }
    (u.ru_minflt as u64, u.ru_majflt as u64)
}

fn faults_since(before: (u64, u64)) -> (u64, u64) {
    let now = page_faults();
    (now.0 - before.0, now.1 - before.1)
}

/// One timed run: apply every event (until visible to readers), then look up every request.
pub async fn timed_run(
    stream: &BuiltStream,
    mode: IndexMode,
    shards: usize,
) -> Result<RunFigures, BenchError> {
    let ops = (stream.stored_blocks + stream.removed_blocks) as f64;
    match mode {
        IndexMode::Core => {
            let mut index = Index::new();
            let faults = page_faults();
            let t0 = Instant::now();
            for ev in &stream.events {
                let _ = index.apply(ev);
            }
            let apply = t0.elapsed().as_secs_f64();
            let faults = faults_since(faults);
            let mut figures = measure_lookups(apply, ops, &stream.queries, index.stats(), |q| {
                index.find_matches(q).best()
            });
            figures.apply_page_faults = faults;
            Ok(figures)
        }
        IndexMode::Sharded => {
            let index = ShardedIndex::start(ShardedIndexConfig {
                shards,
                ..Default::default()
            })
            .await?;
            let batches: Vec<Vec<KvEvent>> = stream
                .events
                .chunks(BATCH_EVENTS)
                .map(<[KvEvent]>::to_vec)
                .collect();
            let faults = page_faults();
            let t0 = Instant::now();
            for batch in batches {
                index.apply_batch(batch)?;
            }
            index.flush().await?;
            let apply = t0.elapsed().as_secs_f64();
            let faults = faults_since(faults);
            let reader = index.reader();
            let mut figures = measure_lookups(apply, ops, &stream.queries, reader.stats(), |q| {
                reader.find_matches(q).best()
            });
            figures.apply_page_faults = faults;
            index.stop().await;
            Ok(figures)
        }
    }
}

fn measure_lookups(
    apply_secs: f64,
    ops: f64,
    queries: &[Vec<LocalBlockHash>],
    stats: IndexStats,
    lookup: impl Fn(&[LocalBlockHash]) -> u32,
) -> RunFigures {
    let t = time_lookups(queries, lookup);
    let c = stats.counters;
    let n = queries.len().max(1) as f64;
    RunFigures {
        apply_secs,
        block_ops_per_s: ops / apply_secs.max(1e-12),
        lookup_p50_us: t.p50_us,
        lookup_p99_us: t.p99_us,
        lookups_per_s: t.per_s,
        mean_best_overlap: t.best_sum as f64 / n,
        live_pairs: stats.live_pairs,
        live_blocks: stats.live_blocks,
        refused_events: c.stale_events + c.rejected_missing_parent + c.rejected_block_limit,
        apply_page_faults: (0, 0),
    }
}

/// Lookup figures: a throughput pass without per-lookup timers, then a latency pass.
pub struct LookupTimes {
    pub per_s: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    /// Sum of the best overlap of every query.
    pub best_sum: u64,
}

pub fn time_lookups<Q: AsRef<[LocalBlockHash]>>(
    queries: &[Q],
    lookup: impl Fn(&[LocalBlockHash]) -> u32,
) -> LookupTimes {
    let t0 = Instant::now();
    let best_sum = queries.iter().map(|q| lookup(q.as_ref()) as u64).sum();
    let per_s = queries.len() as f64 / t0.elapsed().as_secs_f64().max(1e-12);
    let mut lat_ns: Vec<u64> = queries
        .iter()
        .map(|q| {
            let t = Instant::now();
            std::hint::black_box(lookup(q.as_ref()));
            t.elapsed().as_nanos() as u64
        })
        .collect();
    lat_ns.sort_unstable();
    let us = |q: f64| percentile(&lat_ns, q).unwrap_or(0) as f64 / 1000.0;
    LookupTimes {
        per_s,
        p50_us: us(0.50),
        p99_us: us(0.99),
        best_sum,
    }
}

/// Resident set size of this process, in bytes.
pub fn rss_bytes() -> Result<u64, BenchError> {
    let status =
        std::fs::read_to_string("/proc/self/status").map_err(|e| BenchError::Rss(e.to_string()))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .ok_or_else(|| BenchError::Rss("no VmRSS line".into()))
}

/// Memory figures of a run that streams events from a file.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct RssFigures {
    pub rss_before_bytes: u64,
    pub rss_after_bytes: u64,
    pub live_pairs: usize,
    pub live_blocks: usize,
    /// What the index's tables allocated, without allocator slack.
    pub table_bytes: usize,
}

impl RssFigures {
    fn new(rss_before_bytes: u64, rss_after_bytes: u64, stats: IndexStats) -> Self {
        Self {
            rss_before_bytes,
            rss_after_bytes,
            live_pairs: stats.live_pairs,
            live_blocks: stats.live_blocks,
            table_bytes: stats.table_bytes,
        }
    }

    pub fn bytes_per_pair(&self) -> f64 {
        self.rss_after_bytes.saturating_sub(self.rss_before_bytes) as f64
            / self.live_pairs.max(1) as f64
    }
}

/// Populates an index from an exported stream, one event at a time, and measures RSS before
/// the first event and after the last. Run it in a fresh process for a clean heap.
pub async fn measure_rss(
    stream_file: &Path,
    mode: IndexMode,
    shards: usize,
) -> Result<RssFigures, BenchError> {
    let file = std::fs::File::open(stream_file).map_err(StreamFileError::from)?;
    let mut reader = StreamFileReader::new(BufReader::with_capacity(1 << 16, file));
    match mode {
        IndexMode::Core => {
            let mut index = Index::new();
            let before = rss_bytes()?;
            while let Some(ev) = reader.next_event()? {
                let _ = index.apply(&ev);
                reader.recycle(ev);
            }
            Ok(RssFigures::new(before, rss_bytes()?, index.stats()))
        }
        IndexMode::Sharded => {
            let index = ShardedIndex::start(ShardedIndexConfig {
                shards,
                ..Default::default()
            })
            .await?;
            let before = rss_bytes()?;
            // Small batches, each waited for: the decoded events in flight (which the
            // allocator may keep after they are freed) stay small next to the index.
            const RSS_BATCH: usize = 8;
            let mut batch = Vec::with_capacity(RSS_BATCH);
            while let Some(ev) = reader.next_event()? {
                batch.push(ev);
                if batch.len() == RSS_BATCH {
                    index.apply_batch(std::mem::take(&mut batch))?;
                    // Bound what is in flight so the mailbox never holds the stream.
                    index.flush().await?;
                }
            }
            index.apply_and_wait(batch).await?;
            let figures = RssFigures::new(before, rss_bytes()?, index.stats());
            index.stop().await;
            Ok(figures)
        }
    }
}

/// Median of each figure over runs.
pub fn median_figures(runs: &[RunFigures]) -> Option<RunFigures> {
    let first = runs.first()?.clone();
    let med = |f: fn(&RunFigures) -> f64| Spread::of(runs.iter().map(f)).map_or(0.0, |s| s.median);
    Some(RunFigures {
        apply_secs: med(|r| r.apply_secs),
        block_ops_per_s: med(|r| r.block_ops_per_s),
        lookup_p50_us: med(|r| r.lookup_p50_us),
        lookup_p99_us: med(|r| r.lookup_p99_us),
        lookups_per_s: med(|r| r.lookups_per_s),
        mean_best_overlap: med(|r| r.mean_best_overlap),
        apply_page_faults: (
            med(|r| r.apply_page_faults.0 as f64) as u64,
            med(|r| r.apply_page_faults.1 as f64) as u64,
        ),
        ..first
    })
}

/// The kernel's transparent-huge-page mode (`always`, `madvise` or `never`), when known.
pub fn transparent_huge_pages() -> Option<String> {
    let s = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").ok()?;
    let start = s.find('[')? + 1;
    let end = s[start..].find(']')? + start;
    Some(s[start..end].to_owned())
}

//! `kvrouter bench indexer`: apply the trace's event stream to the index, then look up every
//! request, and measure block ops/s, lookup latency and bytes per live (block, rank) pair.

use crate::indexer_stream::{request_hashes, StreamBuilder, StreamConfig, StreamError};
pub use crate::machine::transparent_huge_pages;
use crate::machine::{Pmu, PmuReading};
use crate::radix_ruler::RadixRuler;
use crate::stats::{percentile, Spread};
use crate::stream_file::{write_event, StreamFileError, StreamFileReader};
use crate::trace::TraceReader;
use crate::trace_gen::TRACE_BLOCK_TOKENS;
use kvrouter_indexer::{Index, IndexStats, ShardError, ShardedIndex, ShardedIndexConfig};
use kvrouter_protocol::hashing::local_block_hashes;
use kvrouter_protocol::{KvEvent, LocalBlockHash};
use serde::Serialize;
use std::cell::RefCell;
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
    #[error(transparent)]
    Machine(#[from] crate::machine::MachineError),
}

/// The stream, decoded, with every request's lookup query.
pub struct BuiltStream {
    pub events: Vec<KvEvent>,
    pub queries: Vec<Vec<LocalBlockHash>>,
    pub requests: u64,
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    /// K of the stream: sub-blocks per trace block.
    pub sub_blocks: u64,
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
        sub_blocks: config.sub_blocks,
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
    /// What the index's tables allocated at the end of the run.
    pub table_bytes: usize,
    /// Page faults the process took while applying the stream (minor, major).
    pub apply_page_faults: (u64, u64),
    /// Page faults the process took over both lookup passes (minor, major).
    pub lookup_page_faults: (u64, u64),
    /// Hardware counters of the applying thread (core mode only: in sharded mode the shard
    /// actors apply on their own threads).
    pub apply_pmu: Option<PmuReading>,
    /// Hardware counters over both lookup passes.
    pub lookup_pmu: PmuReading,
    /// The lookup as a route does it.
    pub route: RouteFigures,
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
            let mut pmu = Pmu::open();
            let faults = page_faults();
            let t0 = Instant::now();
            let ((), apply_pmu) = pmu.count(|| {
                for ev in &stream.events {
                    let _ = index.apply(ev);
                }
            });
            let apply = t0.elapsed().as_secs_f64();
            let faults = faults_since(faults);
            let lookup = |q: &[LocalBlockHash]| index.find_matches(q).best();
            let mut figures = measure_lookups(apply, ops, &stream.queries, index.stats(), lookup);
            figures.apply_page_faults = faults;
            figures.apply_pmu = Some(apply_pmu);
            figures.route = time_route_lookups(&stream.queries, stream.sub_blocks, lookup);
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
            let lookup = |q: &[LocalBlockHash]| reader.find_matches(q).best();
            let mut figures = measure_lookups(apply, ops, &stream.queries, reader.stats(), lookup);
            figures.apply_page_faults = faults;
            figures.route = time_route_lookups(&stream.queries, stream.sub_blocks, lookup);
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
    let mut pmu = Pmu::open();
    let faults = page_faults();
    let (t, lookup_pmu) = pmu.count(|| time_lookups(queries, lookup));
    let lookup_page_faults = faults_since(faults);
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
        table_bytes: stats.table_bytes,
        apply_page_faults: (0, 0),
        lookup_page_faults,
        apply_pmu: None,
        lookup_pmu,
        route: RouteFigures::default(),
    }
}

/// Tokens in the prompt of the route's lookup.
pub const ROUTE_PROMPT_TOKENS: usize = 8192;

/// The lookup as a route does it: a prompt's tokens hashed, then looked up.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RouteFigures {
    pub prompt_tokens: usize,
    /// Tokens per block: a trace block's 512 tokens over K.
    pub block_size: usize,
    /// Query blocks looked up, on average (fewer than the prompt's blocks when the request
    /// is shorter than the prompt).
    pub mean_query_blocks: f64,
    /// Hashing and lookup.
    pub p50_us: f64,
    pub p99_us: f64,
    /// Hashing alone.
    pub hash_p50_us: f64,
    pub hash_p99_us: f64,
}

/// Per request: an 8,192-token prompt whose tokens follow from the request's sub-blocks
/// (each sub-block's local hash, itself xxh3 of the sub-block id, seeds its tokens; past the
/// request's end the request number does), hashed with
/// [`local_block_hashes`] at the stream's block size, then the index's lookup of the
/// request's own stream hashes for those tokens (the first 8,192 tokens' worth). The stream
/// hashes are looked up rather than the tokens' hashes so that the lookup finds what the
/// stream stored.
pub fn time_route_lookups(
    queries: &[Vec<LocalBlockHash>],
    sub_blocks: u64,
    lookup: impl Fn(&[LocalBlockHash]) -> u32,
) -> RouteFigures {
    let block_size = (TRACE_BLOCK_TOKENS / sub_blocks.max(1)).max(1) as usize;
    let prompt_blocks = ROUTE_PROMPT_TOKENS / block_size;
    let mut tokens = vec![0u32; ROUTE_PROMPT_TOKENS];
    let mut total_ns = Vec::with_capacity(queries.len());
    let mut hash_ns = Vec::with_capacity(queries.len());
    let mut query_blocks = 0usize;
    for (r, q) in queries.iter().enumerate() {
        for (b, chunk) in tokens.chunks_mut(block_size).enumerate() {
            let seed = q.get(b).map_or(((r as u64) << 32) | b as u64, |h| h.0);
            for (i, t) in chunk.iter_mut().enumerate() {
                *t = (seed as u32 ^ (seed >> 32) as u32).wrapping_add(i as u32);
            }
        }
        let q = &q[..q.len().min(prompt_blocks)];
        query_blocks += q.len();
        let t0 = Instant::now();
        let hashes = local_block_hashes(&tokens, block_size, None).unwrap_or_default();
        let t1 = Instant::now();
        std::hint::black_box(lookup(q));
        let t2 = Instant::now();
        std::hint::black_box(hashes);
        hash_ns.push((t1 - t0).as_nanos() as u64);
        total_ns.push((t2 - t0).as_nanos() as u64);
    }
    total_ns.sort_unstable();
    hash_ns.sort_unstable();
    let us = |v: &[u64], q: f64| percentile(v, q).unwrap_or(0) as f64 / 1000.0;
    RouteFigures {
        prompt_tokens: ROUTE_PROMPT_TOKENS,
        block_size,
        mean_query_blocks: query_blocks as f64 / queries.len().max(1) as f64,
        p50_us: us(&total_ns, 0.50),
        p99_us: us(&total_ns, 0.99),
        hash_p50_us: us(&hash_ns, 0.50),
        hash_p99_us: us(&hash_ns, 0.99),
    }
}

/// Figures of one timed run of the ruler (the plain radix tree) on the same stream.
#[derive(Clone, Debug, Serialize)]
pub struct RulerFigures {
    pub apply_secs: f64,
    pub block_ops_per_s: f64,
    pub lookup_p50_us: f64,
    pub lookup_p99_us: f64,
    pub lookups_per_s: f64,
    pub mean_best_overlap: f64,
    pub live_pairs: usize,
    pub live_nodes: usize,
    pub refused_events: u64,
    pub apply_page_faults: (u64, u64),
}

/// One timed run of the ruler: apply every event, then look up every request, as
/// [`timed_run`] does for the index.
pub fn ruler_run(stream: &BuiltStream) -> RulerFigures {
    let ops = (stream.stored_blocks + stream.removed_blocks) as f64;
    let mut ruler = RadixRuler::new();
    let faults = page_faults();
    let t0 = Instant::now();
    for ev in &stream.events {
        ruler.apply(ev);
    }
    let apply_secs = t0.elapsed().as_secs_f64();
    let apply_page_faults = faults_since(faults);
    let scratch = RefCell::new(Vec::new());
    let t = time_lookups(&stream.queries, |q| {
        ruler.best(q, &mut scratch.borrow_mut())
    });
    let c = ruler.counters();
    let figures = RulerFigures {
        apply_secs,
        block_ops_per_s: ops / apply_secs.max(1e-12),
        lookup_p50_us: t.p50_us,
        lookup_p99_us: t.p99_us,
        lookups_per_s: t.per_s,
        mean_best_overlap: t.best_sum as f64 / stream.queries.len().max(1) as f64,
        live_pairs: ruler.live_pairs(),
        live_nodes: ruler.live_nodes(),
        refused_events: c.refused_missing_parent + c.ignored_tier,
        apply_page_faults,
    };
    // Freeing a big tree takes a while; not part of any figure.
    drop(ruler);
    figures
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

/// Populates the ruler from an exported stream, one event at a time, and measures RSS before
/// the first event and after the last (as [`measure_rss`] does for the
/// index). Run it in a fresh process for a clean heap.
pub fn measure_ruler_rss(stream_file: &Path) -> Result<RssFigures, BenchError> {
    let file = std::fs::File::open(stream_file).map_err(StreamFileError::from)?;
    let mut reader = StreamFileReader::new(BufReader::with_capacity(1 << 16, file));
    let mut ruler = RadixRuler::new();
    let before = rss_bytes()?;
    while let Some(ev) = reader.next_event()? {
        ruler.apply(&ev);
        reader.recycle(ev);
    }
    Ok(RssFigures {
        rss_before_bytes: before,
        rss_after_bytes: rss_bytes()?,
        live_pairs: ruler.live_pairs(),
        live_blocks: ruler.live_nodes(),
        table_bytes: ruler.table_bytes(),
    })
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
        lookup_page_faults: (
            med(|r| r.lookup_page_faults.0 as f64) as u64,
            med(|r| r.lookup_page_faults.1 as f64) as u64,
        ),
        route: RouteFigures {
            p50_us: med(|r| r.route.p50_us),
            p99_us: med(|r| r.route.p99_us),
            hash_p50_us: med(|r| r.route.hash_p50_us),
            hash_p99_us: med(|r| r.route.hash_p99_us),
            ..first.route.clone()
        },
        ..first
    })
}

/// Median of each figure of the ruler over runs.
pub fn median_ruler_figures(runs: &[RulerFigures]) -> Option<RulerFigures> {
    let first = runs.first()?.clone();
    let med =
        |f: fn(&RulerFigures) -> f64| Spread::of(runs.iter().map(f)).map_or(0.0, |s| s.median);
    Some(RulerFigures {
        apply_secs: med(|r| r.apply_secs),
        block_ops_per_s: med(|r| r.block_ops_per_s),
        lookup_p50_us: med(|r| r.lookup_p50_us),
        lookup_p99_us: med(|r| r.lookup_p99_us),
        lookups_per_s: med(|r| r.lookups_per_s),
        apply_page_faults: (
            med(|r| r.apply_page_faults.0 as f64) as u64,
            med(|r| r.apply_page_faults.1 as f64) as u64,
        ),
        ..first
    })
}

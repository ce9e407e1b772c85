//! `kvrouter bench indexer`: a trace's event stream built once, applied to the index `runs`
//! times (apply rate, lookup latency, page faults), and the memory measured once in a fresh
//! process; the report holds the medians and every figure's min/median/max.

use crate::indexer_bench::{
    build_stream, median_figures, timed_run, transparent_huge_pages, BenchError, IndexMode,
    RssFigures, RunFigures,
};
use crate::indexer_stream::StreamConfig;
use crate::stats::Spread;
use serde::Serialize;
use std::path::{Path, PathBuf};

/// What to measure.
#[derive(Clone, Debug)]
pub struct IndexerExperiment {
    pub trace: PathBuf,
    pub stream: StreamConfig,
    pub mode: IndexMode,
    /// Shard actors (sharded mode).
    pub shards: usize,
    pub runs: usize,
    /// Where the stream is written (the memory run reads it from there).
    pub stream_path: PathBuf,
    /// The build measured, for the report.
    pub git_revision: String,
}

/// Min, median and max over the runs of the headline figures.
#[derive(Clone, Debug, Serialize)]
pub struct IndexerSpreads {
    pub block_ops_per_s: Option<Spread>,
    pub lookup_p50_us: Option<Spread>,
    pub lookup_p99_us: Option<Spread>,
    pub lookups_per_s: Option<Spread>,
}

/// The figures: the medians over the runs, the memory run's, and the spreads.
#[derive(Clone, Debug, Serialize)]
pub struct IndexerReport {
    pub trace: PathBuf,
    pub mode: IndexMode,
    pub workers: u64,
    pub capacity_blocks: usize,
    pub sub_blocks: u64,
    pub shards: usize,
    pub runs: usize,
    pub engine_hash_salt: Option<u64>,
    pub requests: u64,
    pub lookups: usize,
    pub events: usize,
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    pub block_ops: u64,
    pub live_pairs: usize,
    pub live_blocks: usize,
    pub refused_events: u64,
    pub apply_secs: f64,
    pub block_ops_per_s: f64,
    pub lookup_p50_us: f64,
    pub lookup_p99_us: f64,
    pub lookups_per_s: f64,
    pub mean_best_overlap: f64,
    pub rss_before_bytes: u64,
    pub rss_after_bytes: u64,
    pub bytes_per_pair: f64,
    pub table_bytes_per_pair: f64,
    pub spread: IndexerSpreads,
    pub apply_minor_page_faults: u64,
    pub apply_major_page_faults: u64,
    pub git_revision: String,
    pub transparent_huge_pages: Option<String>,
}

impl IndexerExperiment {
    /// Builds the stream, measures memory with `rss` (given the stream file; a fresh process,
    /// so nothing of the timed runs is in its RSS), then makes the timed runs.
    pub async fn run(
        &self,
        rss: impl FnOnce(&Path) -> Result<RssFigures, BenchError>,
    ) -> Result<IndexerReport, BenchError> {
        if self.runs == 0 || self.shards == 0 {
            return Err(BenchError::Config(
                "runs and shards must be at least 1".into(),
            ));
        }
        let started = std::time::Instant::now();
        let stream = build_stream(&self.trace, self.stream, Some(&self.stream_path))?;
        tracing::info!(
            requests = stream.requests,
            events = stream.events.len(),
            secs = started.elapsed().as_secs_f64(),
            "stream built"
        );
        let rss = rss(&self.stream_path)?;
        let mut runs: Vec<RunFigures> = Vec::with_capacity(self.runs);
        for i in 0..self.runs {
            let r = timed_run(&stream, self.mode, self.shards).await?;
            tracing::info!(
                run = i + 1,
                block_ops_per_s = r.block_ops_per_s,
                lookup_p99_us = r.lookup_p99_us,
                "run done"
            );
            runs.push(r);
        }
        let m = median_figures(&runs).ok_or_else(|| BenchError::Config("no runs".into()))?;
        let spread = |f: fn(&RunFigures) -> f64| Spread::of(runs.iter().map(f));
        Ok(IndexerReport {
            trace: self.trace.clone(),
            mode: self.mode,
            workers: self.stream.workers,
            capacity_blocks: self.stream.capacity_blocks,
            sub_blocks: self.stream.sub_blocks,
            shards: match self.mode {
                IndexMode::Sharded => self.shards,
                IndexMode::Core => 1,
            },
            runs: self.runs,
            engine_hash_salt: self.stream.engine_hash_salt,
            requests: stream.requests,
            lookups: stream.queries.len(),
            events: stream.events.len(),
            stored_blocks: stream.stored_blocks,
            removed_blocks: stream.removed_blocks,
            block_ops: stream.stored_blocks + stream.removed_blocks,
            live_pairs: m.live_pairs,
            live_blocks: m.live_blocks,
            refused_events: m.refused_events,
            apply_secs: m.apply_secs,
            block_ops_per_s: m.block_ops_per_s,
            lookup_p50_us: m.lookup_p50_us,
            lookup_p99_us: m.lookup_p99_us,
            lookups_per_s: m.lookups_per_s,
            mean_best_overlap: m.mean_best_overlap,
            rss_before_bytes: rss.rss_before_bytes,
            rss_after_bytes: rss.rss_after_bytes,
            bytes_per_pair: rss.bytes_per_pair(),
            table_bytes_per_pair: rss.table_bytes as f64 / rss.live_pairs.max(1) as f64,
            spread: IndexerSpreads {
                block_ops_per_s: spread(|r| r.block_ops_per_s),
                lookup_p50_us: spread(|r| r.lookup_p50_us),
                lookup_p99_us: spread(|r| r.lookup_p99_us),
                lookups_per_s: spread(|r| r.lookups_per_s),
            },
            apply_minor_page_faults: m.apply_page_faults.0,
            apply_major_page_faults: m.apply_page_faults.1,
            git_revision: self.git_revision.clone(),
            transparent_huge_pages: transparent_huge_pages(),
        })
    }
}

impl IndexerReport {
    /// The human-readable report.
    pub fn render(&self) -> String {
        let range = |s: &Option<Spread>, scale: f64| {
            s.map_or(String::new(), |s| {
                format!("{:.2}..{:.2}", s.min / scale, s.max / scale)
            })
        };
        let index = match self.mode {
            IndexMode::Sharded => format!("sharded mode ({} shards)", self.shards),
            IndexMode::Core => "core mode".to_string(),
        };
        let rss_mib =
            self.rss_after_bytes.saturating_sub(self.rss_before_bytes) as f64 / (1 << 20) as f64;
        format!(
            "kvrouter bench indexer: {}\n\
             \x20 stream   {} requests, {} events, {} block ops (W={}, C={}, K={})\n\
             \x20 index    {index}, live pairs {}, live blocks {}\n\
             \x20 apply    {:.2} M block ops/s ({}), {} minor page faults\n\
             \x20 lookup   p50 {:.2} µs ({}), p99 {:.2} µs ({}), {:.0} k lookups/s ({}), mean best overlap {:.1}\n\
             \x20 memory   {:.1} bytes per live pair (RSS +{rss_mib:.1} MiB; tables alone {:.1} bytes per pair)\n\
             \x20 (median of {} runs, min..max in brackets; build {}, transparent huge pages {})\n",
            self.trace.display(),
            self.requests,
            self.events,
            self.block_ops,
            self.workers,
            self.capacity_blocks,
            self.sub_blocks,
            self.live_pairs,
            self.live_blocks,
            self.block_ops_per_s / 1e6,
            range(&self.spread.block_ops_per_s, 1e6),
            self.apply_minor_page_faults,
            self.lookup_p50_us,
            range(&self.spread.lookup_p50_us, 1.0),
            self.lookup_p99_us,
            range(&self.spread.lookup_p99_us, 1.0),
            self.lookups_per_s / 1e3,
            range(&self.spread.lookups_per_s, 1e3),
            self.mean_best_overlap,
            self.bytes_per_pair,
            self.table_bytes_per_pair,
            self.runs,
            self.git_revision,
            self.transparent_huge_pages.as_deref().unwrap_or("unknown"),
        )
    }
}

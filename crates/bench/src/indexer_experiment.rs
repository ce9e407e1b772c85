//! `kvrouter bench indexer`: a trace's event stream built once, applied to the index `runs`
//! times (apply rate, lookup latency, the route's lookup, page faults, hardware counters),
//! each time followed by the ruler (a plain radix tree, `radix_ruler`) on the same stream;
//! the memory of both measured once each in a fresh process; then the machine calibrated
//! (pointer chasing over a table the size of the index's). The report holds the medians,
//! every headline figure's min/median/max and the index/ruler ratios.

use crate::indexer_bench::{
    build_stream, median_figures, median_ruler_figures, ruler_run, timed_run,
    transparent_huge_pages, BenchError, IndexMode, RouteFigures, RssFigures, RulerFigures,
    RunFigures,
};
use crate::indexer_stream::StreamConfig;
use crate::machine::{format_bytes, Calibration, PmuReading};
use crate::stats::Spread;
use serde::Serialize;
use std::path::{Path, PathBuf};

/// Whose memory a fresh process measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RssOf {
    Index,
    Ruler,
}

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
    /// Timed loads of each pointer chase of the calibration (0: no calibration).
    pub chase_loads: u64,
}

/// Min, median and max over the runs of the headline figures.
#[derive(Clone, Debug, Serialize)]
pub struct IndexerSpreads {
    pub block_ops_per_s: Option<Spread>,
    pub lookup_p50_us: Option<Spread>,
    pub lookup_p99_us: Option<Spread>,
    pub lookups_per_s: Option<Spread>,
}

/// The ruler's figures: medians over the runs (memory from its own fresh process).
#[derive(Clone, Debug, Serialize)]
pub struct RulerReport {
    pub block_ops_per_s: f64,
    pub lookup_p50_us: f64,
    pub lookup_p99_us: f64,
    pub lookups_per_s: f64,
    pub mean_best_overlap: f64,
    pub live_pairs: usize,
    pub live_nodes: usize,
    pub refused_events: u64,
    pub apply_minor_page_faults: u64,
    pub bytes_per_pair: f64,
    /// An estimate (entry and control byte per slot of each table's capacity).
    pub table_bytes_per_pair: f64,
    pub spread: IndexerSpreads,
}

/// The index's figures over the ruler's (above 1: the index's figure is the larger).
#[derive(Clone, Debug, Serialize)]
pub struct RulerRatios {
    pub block_ops_per_s: f64,
    pub lookup_p50_us: f64,
    pub lookup_p99_us: f64,
    pub lookups_per_s: f64,
    pub bytes_per_pair: f64,
}

/// Nanoseconds per operation over the latency of one dependent load on a table the size of
/// the index's (huge pages asked for): "dependent-miss equivalents".
#[derive(Clone, Debug, Serialize)]
pub struct MissEquivalents {
    pub chase_ns: f64,
    pub index_per_block_op: f64,
    /// Per matched block of a lookup (mean lookup time over the mean best overlap).
    pub index_per_lookup_block: f64,
    pub ruler_per_block_op: f64,
    pub ruler_per_lookup_block: f64,
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
    pub lookup_minor_page_faults: u64,
    pub lookup_major_page_faults: u64,
    /// The index's tables at the end of a timed run.
    pub table_bytes: usize,
    /// Hardware counters of the first run's apply (core mode only) and lookups (both
    /// passes); "unavailable (errno)" without a PMU.
    pub apply_pmu: Option<PmuReading>,
    pub lookup_pmu: PmuReading,
    pub route: RouteFigures,
    pub ruler: RulerReport,
    pub ruler_ratios: RulerRatios,
    /// The ruler and the index agree on every lookup's best overlap, on average.
    pub overlaps_agree: bool,
    pub calibration: Option<Calibration>,
    pub miss_equivalents: Option<MissEquivalents>,
    pub git_revision: String,
    pub transparent_huge_pages: Option<String>,
}

impl IndexerExperiment {
    /// Builds the stream, measures memory with `rss` (given the stream file; a fresh process,
    /// so nothing of the timed runs is in its RSS), then makes the timed runs.
    pub async fn run(
        &self,
        rss: impl Fn(&Path, RssOf) -> Result<RssFigures, BenchError>,
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
        let rss_index = rss(&self.stream_path, RssOf::Index)?;
        let rss_ruler = rss(&self.stream_path, RssOf::Ruler)?;
        let mut runs: Vec<RunFigures> = Vec::with_capacity(self.runs);
        let mut ruler_runs: Vec<RulerFigures> = Vec::with_capacity(self.runs);
        for i in 0..self.runs {
            let r = timed_run(&stream, self.mode, self.shards).await?;
            let q = ruler_run(&stream);
            tracing::info!(
                run = i + 1,
                block_ops_per_s = r.block_ops_per_s,
                lookup_p99_us = r.lookup_p99_us,
                ruler_block_ops_per_s = q.block_ops_per_s,
                ruler_lookup_p99_us = q.lookup_p99_us,
                "run done"
            );
            runs.push(r);
            ruler_runs.push(q);
        }
        let m = median_figures(&runs).ok_or_else(|| BenchError::Config("no runs".into()))?;
        let q = median_ruler_figures(&ruler_runs)
            .ok_or_else(|| BenchError::Config("no runs".into()))?;
        let spread = |f: fn(&RunFigures) -> f64| Spread::of(runs.iter().map(f));
        let ruler_spread = |f: fn(&RulerFigures) -> f64| Spread::of(ruler_runs.iter().map(f));
        let calibration = if self.chase_loads > 0 {
            Some(Calibration::measure(m.table_bytes, self.chase_loads)?)
        } else {
            None
        };
        let per_block = |per_s: f64, overlap: f64| 1e9 / per_s.max(1e-12) / overlap.max(1.0);
        let miss_equivalents = calibration.as_ref().map(|c| {
            let ns = c.table_huge.ns;
            MissEquivalents {
                chase_ns: ns,
                index_per_block_op: 1e9 / m.block_ops_per_s.max(1e-12) / ns,
                index_per_lookup_block: per_block(m.lookups_per_s, m.mean_best_overlap) / ns,
                ruler_per_block_op: 1e9 / q.block_ops_per_s.max(1e-12) / ns,
                ruler_per_lookup_block: per_block(q.lookups_per_s, q.mean_best_overlap) / ns,
            }
        });
        let ratio = |a: f64, b: f64| a / b.max(1e-12);
        let ruler = RulerReport {
            block_ops_per_s: q.block_ops_per_s,
            lookup_p50_us: q.lookup_p50_us,
            lookup_p99_us: q.lookup_p99_us,
            lookups_per_s: q.lookups_per_s,
            mean_best_overlap: q.mean_best_overlap,
            live_pairs: q.live_pairs,
            live_nodes: q.live_nodes,
            refused_events: q.refused_events,
            apply_minor_page_faults: q.apply_page_faults.0,
            bytes_per_pair: rss_ruler.bytes_per_pair(),
            table_bytes_per_pair: rss_ruler.table_bytes as f64 / rss_ruler.live_pairs.max(1) as f64,
            spread: IndexerSpreads {
                block_ops_per_s: ruler_spread(|r| r.block_ops_per_s),
                lookup_p50_us: ruler_spread(|r| r.lookup_p50_us),
                lookup_p99_us: ruler_spread(|r| r.lookup_p99_us),
                lookups_per_s: ruler_spread(|r| r.lookups_per_s),
            },
        };
        let ruler_ratios = RulerRatios {
            block_ops_per_s: ratio(m.block_ops_per_s, q.block_ops_per_s),
            lookup_p50_us: ratio(m.lookup_p50_us, q.lookup_p50_us),
            lookup_p99_us: ratio(m.lookup_p99_us, q.lookup_p99_us),
            lookups_per_s: ratio(m.lookups_per_s, q.lookups_per_s),
            bytes_per_pair: ratio(rss_index.bytes_per_pair(), ruler.bytes_per_pair),
        };
        let overlaps_agree = runs
            .iter()
            .zip(&ruler_runs)
            .all(|(r, q)| r.mean_best_overlap == q.mean_best_overlap);
        if !overlaps_agree {
            tracing::warn!(
                index = m.mean_best_overlap,
                ruler = q.mean_best_overlap,
                "the ruler's mean best overlap differs from the index's"
            );
        }
        let rss = rss_index;
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
            lookup_minor_page_faults: m.lookup_page_faults.0,
            lookup_major_page_faults: m.lookup_page_faults.1,
            table_bytes: m.table_bytes,
            apply_pmu: m.apply_pmu.clone(),
            lookup_pmu: m.lookup_pmu.clone(),
            route: m.route.clone(),
            ruler,
            ruler_ratios,
            overlaps_agree,
            calibration,
            miss_equivalents,
            git_revision: self.git_revision.clone(),
            transparent_huge_pages: transparent_huge_pages(),
        })
    }
}

impl IndexerReport {
    /// The human-readable report: a header, then one table of the index beside the ruler.
    pub fn render(&self) -> String {
        let range = |s: &Option<Spread>, scale: f64| {
            s.map_or(String::new(), |s| {
                let p = if s.max / scale >= 100.0 { 0 } else { 2 };
                format!(" ({:.p$}..{:.p$})", s.min / scale, s.max / scale)
            })
        };
        let index = match self.mode {
            IndexMode::Sharded => format!("index, sharded ({} shard(s))", self.shards),
            IndexMode::Core => "index, core".to_string(),
        };
        let rss_mib =
            self.rss_after_bytes.saturating_sub(self.rss_before_bytes) as f64 / (1 << 20) as f64;
        let mut out = format!(
            "kvrouter bench indexer: {}\n\
             \x20 stream     {} requests, {} events, {} block ops (W={}, C={}, K={})\n",
            self.trace.display(),
            self.requests,
            self.events,
            self.block_ops,
            self.workers,
            self.capacity_blocks,
            self.sub_blocks,
        );
        match &self.calibration {
            Some(c) => out.push_str(&c.render()),
            None => out.push_str(&format!(
                "  tables     {} (no calibration: --chase-loads 0)\n",
                format_bytes(self.table_bytes as u64)
            )),
        }
        let (r, x, sp, rs) = (
            &self.ruler,
            &self.ruler_ratios,
            &self.spread,
            &self.ruler.spread,
        );
        let mut row = |name: &str, index: String, ruler: String, ratio: String| {
            out.push_str(&format!("  {name:<24} {index:<30} {ruler:<30} {ratio}\n"));
        };
        row(
            "",
            index,
            "ruler (plain radix tree)".into(),
            "index/ruler".into(),
        );
        row(
            "block ops/s (M)",
            format!(
                "{:.2}{}",
                self.block_ops_per_s / 1e6,
                range(&sp.block_ops_per_s, 1e6)
            ),
            format!(
                "{:.2}{}",
                r.block_ops_per_s / 1e6,
                range(&rs.block_ops_per_s, 1e6)
            ),
            format!("{:.2}x", x.block_ops_per_s),
        );
        row(
            "lookup p50 (µs)",
            format!("{:.2}{}", self.lookup_p50_us, range(&sp.lookup_p50_us, 1.0)),
            format!("{:.2}{}", r.lookup_p50_us, range(&rs.lookup_p50_us, 1.0)),
            format!("{:.2}x", x.lookup_p50_us),
        );
        row(
            "lookup p99 (µs)",
            format!("{:.2}{}", self.lookup_p99_us, range(&sp.lookup_p99_us, 1.0)),
            format!("{:.2}{}", r.lookup_p99_us, range(&rs.lookup_p99_us, 1.0)),
            format!("{:.2}x", x.lookup_p99_us),
        );
        row(
            "lookups/s (k)",
            format!(
                "{:.0}{}",
                self.lookups_per_s / 1e3,
                range(&sp.lookups_per_s, 1e3)
            ),
            format!(
                "{:.0}{}",
                r.lookups_per_s / 1e3,
                range(&rs.lookups_per_s, 1e3)
            ),
            format!("{:.2}x", x.lookups_per_s),
        );
        row(
            "mean best overlap",
            format!("{:.2}", self.mean_best_overlap),
            format!("{:.2}", r.mean_best_overlap),
            if self.overlaps_agree {
                "equal".into()
            } else {
                "DIFFER".into()
            },
        );
        row(
            "bytes/pair RSS; tables",
            format!(
                "{:.1}; {:.1} (+{rss_mib:.1} MiB)",
                self.bytes_per_pair, self.table_bytes_per_pair
            ),
            format!("{:.1}; ~{:.1}", r.bytes_per_pair, r.table_bytes_per_pair),
            format!("{:.2}x", x.bytes_per_pair),
        );
        row(
            "live pairs; blocks",
            format!("{}; {}", self.live_pairs, self.live_blocks),
            format!("{}; {}", r.live_pairs, r.live_nodes),
            String::new(),
        );
        row(
            "minor faults apply; look",
            format!(
                "{}; {}",
                self.apply_minor_page_faults, self.lookup_minor_page_faults
            ),
            format!("{}; -", r.apply_minor_page_faults),
            String::new(),
        );
        if let Some(e) = &self.miss_equivalents {
            row(
                "chase-loads/block op",
                format!("{:.2}", e.index_per_block_op),
                format!("{:.2}", e.ruler_per_block_op),
                format!("(÷ {:.1} ns)", e.chase_ns),
            );
            row(
                "chase-loads/lookup block",
                format!("{:.3}", e.index_per_lookup_block),
                format!("{:.3}", e.ruler_per_lookup_block),
                String::new(),
            );
        }
        let rt = &self.route;
        out.push_str(&format!(
            "  route      {} tokens in blocks of {}, {:.0} query blocks on average: p50 {:.2} µs, p99 {:.2} µs (hashing alone p50 {:.2}, p99 {:.2})\n",
            rt.prompt_tokens, rt.block_size, rt.mean_query_blocks, rt.p50_us, rt.p99_us, rt.hash_p50_us, rt.hash_p99_us,
        ));
        let lookups = 2.0 * self.lookups as f64;
        let pmu = match &self.apply_pmu {
            Some(a) if a.unavailable().is_none() => format!(
                "apply: {}; lookups: {}",
                a.render_per(self.block_ops as f64, "block op"),
                self.lookup_pmu.render_per(lookups, "lookup")
            ),
            _ => self.lookup_pmu.render_per(lookups, "lookup"),
        };
        out.push_str(&format!("  PMU        {pmu}\n"));
        out.push_str(&format!(
            "  (median of {} runs, min..max in brackets; build {}, transparent huge pages {})\n",
            self.runs,
            self.git_revision,
            self.transparent_huge_pages.as_deref().unwrap_or("unknown"),
        ));
        out
    }
}

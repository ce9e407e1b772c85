//! One figure of a replay: left, the TTFT distribution (CDF, log time axis) of every run;
//! right, every run's observed hit rate against the two ideals.
//!
//! The format follows the file's extension: `.svg` or `.png`. Text is laid out with a TrueType
//! font found at run time (DejaVu Sans, Liberation Sans, … in the usual system folders);
//! a PNG cannot be drawn without one, an SVG leaves the glyphs to the viewer.

use kvrouter_replay::report::ReplayReport;
use kvrouter_replay::RunOutcome;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum PlotError {
    #[error("cannot plot to {0}: the file name must end in .svg or .png")]
    UnknownFormat(PathBuf),
    #[error(
        "no TrueType font found to draw text into a PNG (looked for {searched}); \
         plot to a .svg file instead, or install DejaVu or Liberation fonts"
    )]
    NoFont { searched: String },
    #[error("cannot draw the plot {path}: {reason}")]
    Draw { path: PathBuf, reason: String },
}

/// Font files tried in order; the first readable one is registered as "sans-serif".
pub const FONT_CANDIDATES: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/truetype/freefont/FreeSans.ttf",
    "/usr/share/fonts/truetype/noto/NotoSans-Regular.ttf",
    "/Library/Fonts/Arial.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
    "C:\\Windows\\Fonts\\arial.ttf",
];

const FONT: &str = "sans-serif";

/// Registers the first font found (once per process); whether one is available.
pub fn ensure_font() -> bool {
    static FOUND: OnceLock<bool> = OnceLock::new();
    *FOUND.get_or_init(|| {
        FONT_CANDIDATES.iter().any(|p| {
            let Ok(bytes) = std::fs::read(p) else {
                return false;
            };
            // plotters keeps fonts for the life of the process: leak the one file once.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            plotters::style::register_font(FONT, FontStyle::Normal, bytes).is_ok()
        })
    })
}

enum Format {
    Svg,
    Png,
}

const WIDTH: u32 = 1400;
const HEIGHT: u32 = 620;
/// Most points drawn per CDF line.
const MAX_CDF_POINTS: usize = 400;

/// Draws the figure of `report` and its runs' `outcomes` to `path`.
pub fn plot(report: &ReplayReport, outcomes: &[RunOutcome], path: &Path) -> Result<(), PlotError> {
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    let format = match ext.as_deref() {
        Some("svg") => Format::Svg,
        Some("png") => Format::Png,
        _ => return Err(PlotError::UnknownFormat(path.to_owned())),
    };
    let have_font = ensure_font();
    let draw_err = |reason: String| PlotError::Draw {
        path: path.to_owned(),
        reason,
    };
    match format {
        Format::Svg => {
            let root = SVGBackend::new(path, (WIDTH, HEIGHT)).into_drawing_area();
            draw(&root, report, outcomes).map_err(|e| {
                if have_font {
                    draw_err(e)
                } else {
                    draw_err(format!(
                        "{e} (no TrueType font found; install DejaVu fonts)"
                    ))
                }
            })?;
            root.present().map_err(|e| draw_err(e.to_string()))
        }
        Format::Png => {
            if !have_font {
                return Err(PlotError::NoFont {
                    searched: FONT_CANDIDATES.join(", "),
                });
            }
            let root = BitMapBackend::new(path, (WIDTH, HEIGHT)).into_drawing_area();
            draw(&root, report, outcomes).map_err(draw_err)?;
            root.present().map_err(|e| draw_err(e.to_string()))
        }
    }
}

fn label(policy: &str, rate_scale: f64) -> String {
    format!("{policy} x{rate_scale}")
}

/// The CDF of a run's TTFTs in ms: (ttft, fraction of requests at or below it), at most
/// [`MAX_CDF_POINTS`] samples (always including the last) drawn as a staircase.
fn cdf_points(outcome: &RunOutcome, floor_ms: f64) -> Vec<(f64, f64)> {
    let mut ttft: Vec<u64> = outcome
        .results
        .iter()
        .filter(|r| r.error.is_none())
        .map(|r| r.ttft_us)
        .collect();
    ttft.sort_unstable();
    let n = ttft.len();
    if n == 0 {
        return Vec::new();
    }
    let step = n.div_ceil(MAX_CDF_POINTS);
    let mut pts: Vec<(f64, f64)> = (0..n)
        .step_by(step)
        .chain(std::iter::once(n - 1))
        .map(|i| {
            (
                (ttft[i] as f64 / 1000.0).max(floor_ms),
                (i + 1) as f64 / n as f64,
            )
        })
        .collect();
    pts.dedup_by(|a, b| a == b);
    // A staircase from 0: at each sample the fraction steps up from the previous one.
    let mut steps = Vec::with_capacity(2 * pts.len());
    let mut prev = 0.0;
    for (x, y) in pts {
        steps.push((x, prev));
        steps.push((x, y));
        prev = y;
    }
    steps
}

fn color(i: usize) -> RGBColor {
    const COLORS: [RGBColor; 10] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
        RGBColor(188, 189, 34),
        RGBColor(23, 190, 207),
    ];
    COLORS[i % COLORS.len()]
}

fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    report: &ReplayReport,
    outcomes: &[RunOutcome],
) -> Result<(), String> {
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(e)?;
    let (left, right) = root.split_horizontally(WIDTH * 11 / 20);
    draw_ttft(&left, outcomes).map_err(e)?;
    draw_hit_rates(&right, report).map_err(e)?;
    Ok(())
}

fn draw_ttft<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    outcomes: &[RunOutcome],
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    // Log axis: clamp TTFTs below 0.1 ms (or 0) to 0.1 ms.
    const FLOOR_MS: f64 = 0.1;
    let lines: Vec<(String, Vec<(f64, f64)>)> = outcomes
        .iter()
        .map(|o| (label(&o.policy, o.rate_scale), cdf_points(o, FLOOR_MS)))
        .collect();
    let all = lines.iter().flat_map(|(_, p)| p.iter().map(|&(x, _)| x));
    let (lo, hi) = all.fold((f64::INFINITY, 0.0f64), |(lo, hi), x| {
        (lo.min(x), hi.max(x))
    });
    let (lo, hi) = if lo.is_finite() && hi > 0.0 {
        (lo / 1.2, (hi * 1.2).max(lo * 10.0))
    } else {
        (1.0, 1000.0)
    };
    let area = titled(area, "TTFT distribution")?;
    let mut chart = ChartBuilder::on(&area)
        .margin(15)
        .margin_top(5)
        .x_label_area_size(45)
        .y_label_area_size(55)
        .build_cartesian_2d((lo..hi).log_scale(), 0.0..1.0)?;
    chart
        .configure_mesh()
        .x_desc("time to first token (ms, log scale)")
        .y_desc("fraction of requests")
        .label_style((FONT, 13))
        .axis_desc_style((FONT, 15))
        .x_label_formatter(&|v| format_ms(*v))
        .draw()?;
    let mut entries = Vec::new();
    for (i, (name, pts)) in lines.into_iter().enumerate() {
        if pts.is_empty() {
            continue;
        }
        chart.draw_series(LineSeries::new(pts, color(i).stroke_width(2)))?;
        entries.push((name, color(i), false));
    }
    legend(&chart.plotting_area().strip_coord_spec(), &entries, false)
}

const TITLE_SIZE: u32 = 22;
const LEGEND_SIZE: u32 = 13;

// Titles and legends are laid out here by a fixed estimate of the text's width rather than
// by plotters (caption, series labels), which measures text with the font: that keeps SVG
// output possible on a machine without fonts, where the SVG viewer draws the glyphs.

/// Draws `text` centred at the top of `area`; the area below it.
fn titled<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    text: &str,
) -> Result<DrawingArea<DB, Shift>, DrawingAreaErrorKind<DB::ErrorType>> {
    let (w, _) = area.dim_in_pixel();
    let style = (FONT, TITLE_SIZE)
        .into_font()
        .color(&BLACK)
        .pos(Pos::new(HPos::Center, VPos::Top));
    area.draw(&Text::new(text.to_string(), (w as i32 / 2, 8), style))?;
    Ok(area.margin(TITLE_SIZE + 14, 0, 0, 0))
}

/// A boxed legend in the upper (or lower) right corner of a chart's plotting area: one line
/// sample (dashed or solid) and name per entry.
fn legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    entries: &[(String, RGBColor, bool)],
    upper: bool,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    if entries.is_empty() {
        return Ok(());
    }
    let (w, h) = area.dim_in_pixel();
    let (w, h) = (w as i32, h as i32);
    let line_h = LEGEND_SIZE as i32 + 7;
    let chars = entries
        .iter()
        .map(|(n, _, _)| n.chars().count())
        .max()
        .unwrap_or(0);
    let box_w = 44 + (chars as f64 * LEGEND_SIZE as f64 * 0.6) as i32;
    let box_h = line_h * entries.len() as i32 + 10;
    let x0 = (w - box_w - 10).max(0);
    let y0 = if upper { 10 } else { (h - box_h - 10).max(0) };
    area.draw(&Rectangle::new(
        [(x0, y0), (x0 + box_w, y0 + box_h)],
        WHITE.mix(0.9).filled(),
    ))?;
    area.draw(&Rectangle::new(
        [(x0, y0), (x0 + box_w, y0 + box_h)],
        BLACK.stroke_width(1),
    ))?;
    let text_style = (FONT, LEGEND_SIZE)
        .into_font()
        .color(&BLACK)
        .pos(Pos::new(HPos::Left, VPos::Center));
    for (k, (name, c, dashed)) in entries.iter().enumerate() {
        let y = y0 + 5 + line_h * k as i32 + line_h / 2;
        let style = c.stroke_width(2);
        if *dashed {
            area.draw(&PathElement::new(vec![(x0 + 8, y), (x0 + 17, y)], style))?;
            area.draw(&PathElement::new(vec![(x0 + 22, y), (x0 + 31, y)], style))?;
        } else {
            area.draw(&PathElement::new(vec![(x0 + 8, y), (x0 + 31, y)], style))?;
        }
        area.draw(&Text::new(name.clone(), (x0 + 38, y), text_style.clone()))?;
    }
    Ok(())
}

fn format_ms(v: f64) -> String {
    if v >= 1.0 {
        format!("{:.0}", v)
    } else {
        format!("{:.1}", v)
    }
}

fn draw_hit_rates<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    report: &ReplayReport,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let names: Vec<String> = report
        .runs
        .iter()
        .map(|r| label(&r.policy, r.rate_scale))
        .collect();
    let n = names.len().max(1);
    let ideals = &report.ideals;
    let top = ideals
        .unlimited_hit_rate
        .max(ideals.pooled_hit_rate)
        .max(report.runs.iter().map(|r| r.hit_rate).fold(0.0, f64::max));
    let y_max = ((top * 100.0 * 1.25 / 10.0).ceil() * 10.0).clamp(10.0, 100.0);
    let area = titled(area, "Hit rate against the ideals")?;
    let mut chart = ChartBuilder::on(&area)
        .margin(15)
        .margin_top(5)
        .x_label_area_size(20)
        .y_label_area_size(55)
        .build_cartesian_2d(0.0..n as f64, 0.0..y_max)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_desc("hit rate (%)")
        .y_label_formatter(&|v| format!("{v:.0}"))
        .label_style((FONT, 13))
        .axis_desc_style((FONT, 15))
        .draw()?;
    // One bar per run, coloured like its CDF line (same order as the outcomes), its name
    // written upwards inside it and its value on top.
    chart.draw_series(report.runs.iter().enumerate().map(|(i, r)| {
        Rectangle::new(
            [
                (i as f64 + 0.12, 0.0),
                (i as f64 + 0.88, r.hit_rate * 100.0),
            ],
            color(i).mix(0.85).filled(),
        )
    }))?;
    let name_style = (FONT, 13)
        .into_font()
        .transform(FontTransform::Rotate270)
        .color(&BLACK)
        .pos(Pos::new(HPos::Left, VPos::Center));
    chart.draw_series(names.iter().enumerate().map(|(i, name)| {
        Text::new(
            name.clone(),
            (i as f64 + 0.5, y_max * 0.02),
            name_style.clone(),
        )
    }))?;
    let value_style = (FONT, 12)
        .into_font()
        .color(&BLACK)
        .pos(Pos::new(HPos::Center, VPos::Bottom));
    chart.draw_series(report.runs.iter().enumerate().map(|(i, r)| {
        Text::new(
            format!("{:.1}", r.hit_rate * 100.0),
            (i as f64 + 0.5, r.hit_rate * 100.0 + y_max * 0.01),
            value_style.clone(),
        )
    }))?;
    let mut entries = Vec::new();
    for (name, rate, c) in [
        ("unlimited", ideals.unlimited_hit_rate, BLACK),
        ("pooled LRU", ideals.pooled_hit_rate, RGBColor(214, 39, 40)),
    ] {
        let y = rate * 100.0;
        chart.draw_series(DashedLineSeries::new(
            [(0.0, y), (n as f64, y)],
            10,
            6,
            c.stroke_width(2),
        ))?;
        entries.push((format!("{name} ideal {y:.1}%"), c, true));
    }
    legend(&chart.plotting_area().strip_coord_spec(), &entries, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cdf_is_monotone_and_bounded() {
        let outcome = RunOutcome {
            results: (0..1000)
                .map(|i| kvrouter_replay::RequestResult {
                    ttft_us: (1000 - i) * 10,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        };
        let pts = cdf_points(&outcome, 0.1);
        assert!(pts.len() <= 2 * (MAX_CDF_POINTS + 1));
        assert_eq!(pts[0].1, 0.0);
        assert_eq!(*pts.last().unwrap(), (10.0, 1.0));
        assert!(pts.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 <= w[1].1));
    }

    /// Two policies at two rates, each with ten requests.
    fn runs() -> (ReplayReport, Vec<RunOutcome>) {
        use kvrouter_replay::ideal::Ideals;
        use kvrouter_replay::report::ReportSettings;
        let run = |policy: &str, rate: f64, ttft_ms: u64| RunOutcome {
            policy: policy.into(),
            rate_scale: rate,
            results: (0..10)
                .map(|i| kvrouter_replay::RequestResult {
                    ttft_us: (ttft_ms + i) * 1000,
                    e2e_us: (ttft_ms + i) * 1000 + 50_000,
                    cached_blocks: 2,
                    prompt_blocks: 4,
                    ..Default::default()
                })
                .collect(),
            duration_us: 1_000_000,
            ..Default::default()
        };
        let outcomes = vec![
            run("kv", 1.0, 10),
            run("kv", 2.0, 20),
            run("round-robin", 1.0, 40),
            run("round-robin", 2.0, 300),
        ];
        let ideals = Ideals {
            prompt_blocks: 40,
            unlimited_hits: 24,
            pooled_hits: 20,
            unlimited_hit_rate: 0.6,
            pooled_hit_rate: 0.5,
            pooled_capacity_blocks: 200,
        };
        let settings = ReportSettings {
            workers: 2,
            block_size: 16,
            slo_ttft_ms: 100.0,
            ..ReportSettings::default()
        };
        let report = ReplayReport::from_outcomes("t.jsonl".into(), settings, ideals, &outcomes);
        (report, outcomes)
    }

    #[test]
    fn plots_svg_and_png() {
        let (report, outcomes) = runs();
        let dir = tempfile::tempdir().unwrap();
        let svg = dir.path().join("replay.svg");
        plot(&report, &outcomes, &svg).unwrap();
        let text = std::fs::read_to_string(&svg).unwrap();
        for needle in ["<svg", "kv x2", "round-robin x1", "pooled LRU", "unlimited"] {
            assert!(text.contains(needle), "svg lacks {needle}");
        }

        let png = dir.path().join("replay.PNG");
        match plot(&report, &outcomes, &png) {
            Ok(()) => {
                let bytes = std::fs::read(&png).unwrap();
                assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
            }
            Err(PlotError::NoFont { .. }) if !ensure_font() => {
                println!("note: no TrueType font on this machine; PNG output not checked");
            }
            Err(e) => panic!("{e}"),
        }
        let err = plot(&report, &outcomes, &dir.path().join("replay.pdf")).unwrap_err();
        assert!(err.to_string().contains(".svg"), "{err}");
    }

    #[test]
    fn unknown_extension_is_refused() {
        let err = plot(&ReplayReport::default(), &[], Path::new("/tmp/x.jpeg")).unwrap_err();
        assert!(matches!(err, PlotError::UnknownFormat(_)), "{err}");
    }
}

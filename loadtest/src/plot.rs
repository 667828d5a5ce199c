//! Charts of a run, drawn with `plotters`: CDFs of TTFT, TPOT, ITL and
//! end-to-end latency, output throughput over time, and requests in flight
//! over time, on one 3×2 canvas. The same drawing code targets SVG (embedded
//! in the HTML report) and PNG. Everything is derived from the per-request
//! records, so any saved results JSON can be drawn.
//!
//! Text is drawn with DejaVu Sans, compiled into the binary (the `dejavu` crate) and
//! registered with plotters' `ab_glyph` text backend: the load tester needs no fontconfig,
//! freetype or system font, so it runs on a bare machine.

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;

use crate::error::LoadtestError;
use crate::record::RequestRecord;
use crate::runner::RunResult;
use crate::timeseries;

const SIZE: (u32, u32) = (1500, 900);
const FONT: &str = "sans-serif";

/// Registers the bundled font under [`FONT`] once per process.
fn register_font() -> Result<(), LoadtestError> {
    static REGISTERED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let ok = *REGISTERED
        .get_or_init(|| plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular()).is_ok());
    if ok { Ok(()) } else { Err(LoadtestError::Plot("the bundled DejaVu Sans font does not parse".into())) }
}

/// The charts as an SVG document.
pub fn render_svg(result: &RunResult) -> Result<String, LoadtestError> {
    register_font()?;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        draw(&root, result).map_err(|e| LoadtestError::Plot(e.to_string()))?;
        root.present().map_err(|e| LoadtestError::Plot(e.to_string()))?;
    }
    Ok(svg)
}

/// The charts as a PNG file at `path`.
pub fn render_png(result: &RunResult, path: &Path) -> Result<(), LoadtestError> {
    register_font()?;
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    draw(&root, result).map_err(|e| LoadtestError::Plot(format!("{}: {e}", path.display())))?;
    root.present().map_err(|e| LoadtestError::Plot(format!("{}: {e}", path.display())))
}

type DrawResult<DB> = Result<(), DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>>;

fn draw<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, result: &RunResult) -> DrawResult<DB> {
    root.fill(&WHITE)?;
    let panels = root.split_evenly((2, 3));
    let ok: Vec<&RequestRecord> = result.records.iter().filter(|r| r.success).collect();
    let ms = |xs: Vec<f64>| xs.into_iter().map(|x| x * 1000.0).collect::<Vec<_>>();
    cdf(&panels[0], "TTFT CDF", ms(ok.iter().filter_map(|r| r.ttft_s).collect()))?;
    cdf(&panels[1], "TPOT CDF", ms(ok.iter().filter_map(|r| r.tpot_s()).collect()))?;
    cdf(&panels[2], "ITL CDF", ms(ok.iter().flat_map(|r| r.itl_s.iter().copied()).collect()))?;
    cdf(&panels[3], "E2E latency CDF", ms(ok.iter().map(|r| r.latency_s).collect()))?;
    throughput(&panels[4], &result.records, result.summary.duration_s)?;
    concurrency(&panels[5], &result.records)?;
    Ok(())
}

fn cdf<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, title: &str, mut xs: Vec<f64>) -> DrawResult<DB> {
    xs.sort_by(f64::total_cmp);
    let xmax = xs.last().copied().filter(|x| *x > 0.0).unwrap_or(1.0) * 1.05;
    let mut chart = ChartBuilder::on(area)
        .caption(format!("{title} (n = {})", xs.len()), (FONT, 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..xmax, 0.0..1.0)?;
    chart.configure_mesh().x_desc("ms").y_desc("fraction ≤ x").draw()?;
    let n = xs.len() as f64;
    chart.draw_series(LineSeries::new(xs.iter().enumerate().map(|(i, x)| (*x, (i + 1) as f64 / n)), &BLUE))?;
    Ok(())
}

fn throughput<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    records: &[RequestRecord],
    duration_s: f64,
) -> DrawResult<DB> {
    // About 50 points whatever the run length, but never finer than 100 ms.
    let bucket = (duration_s / 50.0).max(0.1);
    let tput = timeseries::output_throughput(records, bucket);
    let ymax = tput.iter().copied().fold(0.0, f64::max).max(1.0) * 1.1;
    let xmax = (tput.len() as f64 * bucket).max(bucket);
    let mut chart = ChartBuilder::on(area)
        .caption(format!("Output throughput ({bucket:.1} s buckets)"), (FONT, 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..xmax, 0.0..ymax)?;
    chart.configure_mesh().x_desc("s").y_desc("tok/s").draw()?;
    chart.draw_series(LineSeries::new(tput.iter().enumerate().map(|(i, y)| ((i as f64 + 0.5) * bucket, *y)), &RED))?;
    Ok(())
}

fn concurrency<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, records: &[RequestRecord]) -> DrawResult<DB> {
    let steps = timeseries::concurrency_steps(records);
    let ymax = steps.iter().map(|(_, n)| *n).max().unwrap_or(1).max(1) as f64 * 1.1;
    let xmax = steps.last().map(|(t, _)| *t).filter(|t| *t > 0.0).unwrap_or(1.0);
    let mut chart = ChartBuilder::on(area)
        .caption("Requests in flight", (FONT, 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..xmax, 0.0..ymax)?;
    chart.configure_mesh().x_desc("s").y_desc("requests").draw()?;
    let mut points = Vec::with_capacity(steps.len() * 2 + 1);
    let mut level = 0.0;
    points.push((0.0, 0.0));
    for (t, n) in steps {
        points.push((t, level));
        level = n as f64;
        points.push((t, level));
    }
    chart.draw_series(LineSeries::new(points, &GREEN))?;
    Ok(())
}

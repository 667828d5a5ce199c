//! `baton-loadtest compare a.json b.json`: each figure of two runs side by side
//! with the ratio B/A, marked better or worse by the figure's direction
//! (throughputs: higher is better; latencies and failures: lower is better).

use std::fmt::Write as _;
use std::path::Path;

use crate::error::LoadtestError;
use crate::metrics::{Stats, Summary};
use crate::runner::RunResult;

/// One compared figure.
#[derive(Debug, Clone, PartialEq)]
pub struct CompareRow {
    /// The figure's name, with unit.
    pub metric: String,
    /// Value in the first run.
    pub a: f64,
    /// Value in the second run.
    pub b: f64,
    /// `b / a`, or `None` when `a` is zero.
    pub ratio: Option<f64>,
    /// Whether a larger value is an improvement.
    pub higher_is_better: bool,
}

impl CompareRow {
    fn new(metric: impl Into<String>, a: f64, b: f64, higher_is_better: bool) -> Self {
        Self { metric: metric.into(), a, b, ratio: (a != 0.0).then(|| b / a), higher_is_better }
    }

    /// Whether B is better than A (`None` when equal or not comparable).
    pub fn b_is_better(&self) -> Option<bool> {
        if self.a == self.b || self.a.is_nan() || self.b.is_nan() {
            return None;
        }
        Some((self.b > self.a) == self.higher_is_better)
    }
}

fn latency_rows(rows: &mut Vec<CompareRow>, name: &str, a: &Stats, b: &Stats) {
    for (stat, va, vb) in [
        ("mean", a.mean, b.mean),
        ("median", a.median, b.median),
        ("p90", a.p90, b.p90),
        ("p99", a.p99, b.p99),
        ("max", a.max, b.max),
    ] {
        rows.push(CompareRow::new(format!("{name} {stat} (ms)"), va, vb, false));
    }
}

/// Every figure of `a` and `b`, in the order of the summary table.
pub fn compare(a: &Summary, b: &Summary) -> Vec<CompareRow> {
    let mut rows = vec![
        CompareRow::new("Successful requests", a.completed as f64, b.completed as f64, true),
        CompareRow::new("Failed requests", a.failed as f64, b.failed as f64, false),
        CompareRow::new("Request throughput (req/s)", a.request_throughput, b.request_throughput, true),
    ];
    if let (Some(ga), Some(gb)) = (a.request_goodput, b.request_goodput) {
        rows.push(CompareRow::new("Request goodput (req/s)", ga, gb, true));
    }
    rows.extend([
        CompareRow::new("Output token throughput (tok/s)", a.output_throughput, b.output_throughput, true),
        CompareRow::new(
            "Peak output token throughput (tok/s)",
            a.peak_output_throughput,
            b.peak_output_throughput,
            true,
        ),
        CompareRow::new("Total token throughput (tok/s)", a.total_token_throughput, b.total_token_throughput, true),
    ]);
    latency_rows(&mut rows, "TTFT", &a.ttft_ms, &b.ttft_ms);
    latency_rows(&mut rows, "TPOT", &a.tpot_ms, &b.tpot_ms);
    latency_rows(&mut rows, "ITL", &a.itl_ms, &b.itl_ms);
    latency_rows(&mut rows, "E2EL", &a.e2el_ms, &b.e2el_ms);
    rows
}

/// The comparison as a console table.
pub fn compare_table(rows: &[CompareRow], name_a: &str, name_b: &str) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "A: {name_a}\nB: {name_b}");
    let _ = writeln!(out, "{:<38} {:>12} {:>12} {:>8}", "metric", "A", "B", "B/A");
    for r in rows {
        let ratio = r.ratio.map_or_else(|| "-".to_string(), |x| format!("{x:.3}"));
        let mark = match r.b_is_better() {
            Some(true) => " better",
            Some(false) => " worse",
            None => "",
        };
        let _ = writeln!(out, "{:<38} {:>12.2} {:>12.2} {:>8}{mark}", r.metric, r.a, r.b, ratio);
    }
    out
}

/// Loads two results files and renders their comparison.
pub fn compare_files(a: &Path, b: &Path) -> Result<String, LoadtestError> {
    let ra = RunResult::load(a)?;
    let rb = RunResult::load(b)?;
    Ok(compare_table(&compare(&ra.summary, &rb.summary), &a.display().to_string(), &b.display().to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Rate, Slo};
    use crate::metrics::RunShape;

    fn summary(throughput: f64, ttft_ms: f64) -> Summary {
        let mut s = Summary::compute(
            &[],
            1.0,
            RunShape { request_rate: Rate::INFINITE, burstiness: 1.0, max_concurrency: None, slo: Slo::default() },
        );
        s.request_throughput = throughput;
        s.ttft_ms.mean = ttft_ms;
        s
    }

    #[test]
    fn ratios_and_directions() {
        let rows = compare(&summary(2.0, 100.0), &summary(3.0, 50.0));
        let find = |m: &str| rows.iter().find(|r| r.metric == m).expect("row present");
        let tput = find("Request throughput (req/s)");
        assert_eq!(tput.ratio, Some(1.5));
        assert_eq!(tput.b_is_better(), Some(true));
        let ttft = find("TTFT mean (ms)");
        assert_eq!(ttft.ratio, Some(0.5));
        assert_eq!(ttft.b_is_better(), Some(true));
        let failed = find("Failed requests");
        assert_eq!(failed.ratio, None);
        assert_eq!(failed.b_is_better(), None);
        let table = compare_table(&rows, "a.json", "b.json");
        assert!(table.contains("1.500 better"));
    }
}

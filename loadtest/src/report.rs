//! Human-readable output: the console summary (shaped like `vllm bench
//! serve`'s, so numbers can be read side by side), the one-row-per-rate sweep
//! table, and writing `--report` files (HTML with embedded SVG, or PNG).

use std::fmt::Write as _;
use std::path::Path;

use crate::error::LoadtestError;
use crate::metrics::{Stats, Summary};
use crate::plot;
use crate::runner::RunResult;

const WIDTH: usize = 50;

/// `text` centred in a line of `fill`, like Python's `'{:=^50}'`.
fn title(out: &mut String, text: &str, fill: char) {
    let pad = WIDTH.saturating_sub(text.chars().count());
    let left = pad / 2;
    let fill_n = |n: usize| fill.to_string().repeat(n);
    let _ = writeln!(out, "{}{text}{}", fill_n(left), fill_n(pad - left));
}

fn row(out: &mut String, label: &str, value: impl std::fmt::Display) {
    let _ = writeln!(out, "{label:<40} {value}");
}

fn latency_block(out: &mut String, heading: &str, short: &str, s: &Stats) {
    title(out, heading, '-');
    row(out, &format!("Mean {short} (ms):"), format!("{:.2}", s.mean));
    row(out, &format!("Median {short} (ms):"), format!("{:.2}", s.median));
    row(out, &format!("P90 {short} (ms):"), format!("{:.2}", s.p90));
    row(out, &format!("P99 {short} (ms):"), format!("{:.2}", s.p99));
    row(out, &format!("Max {short} (ms):"), format!("{:.2}", s.max));
}

/// The console summary of one run.
pub fn summary_table(result: &RunResult) -> String {
    let s = &result.summary;
    let mut out = String::new();
    title(&mut out, " Serving Benchmark Result ", '=');
    row(&mut out, "Successful requests:", s.completed);
    row(&mut out, "Failed requests:", s.failed);
    row(&mut out, "Request rate configured (RPS):", s.request_rate);
    if let Some(c) = s.max_concurrency {
        row(&mut out, "Maximum request concurrency:", c);
    }
    row(&mut out, "Benchmark duration (s):", format!("{:.2}", s.duration_s));
    row(&mut out, "Total input tokens:", s.total_input_tokens);
    row(&mut out, "Total generated tokens:", s.total_output_tokens);
    row(&mut out, "Request throughput (req/s):", format!("{:.2}", s.request_throughput));
    if let Some(g) = s.request_goodput {
        row(&mut out, "Request goodput (req/s):", format!("{g:.2}"));
    }
    row(&mut out, "Output token throughput (tok/s):", format!("{:.2}", s.output_throughput));
    row(&mut out, "Peak output token throughput (tok/s):", format!("{:.2}", s.peak_output_throughput));
    row(&mut out, "Peak concurrent requests:", s.peak_concurrency);
    row(&mut out, "Total token throughput (tok/s):", format!("{:.2}", s.total_token_throughput));
    latency_block(&mut out, "Time to First Token", "TTFT", &s.ttft_ms);
    latency_block(&mut out, "Time per Output Token (excl. 1st token)", "TPOT", &s.tpot_ms);
    latency_block(&mut out, "Inter-token Latency", "ITL", &s.itl_ms);
    latency_block(&mut out, "End-to-end Latency", "E2EL", &s.e2el_ms);
    title(&mut out, "", '=');
    if s.estimated_output_requests > 0 {
        let _ = writeln!(
            out,
            "Note: output tokens ESTIMATED for {} requests (the server sent no usage).",
            s.estimated_output_requests
        );
    }
    if s.short_output_requests > 0 {
        let _ = writeln!(
            out,
            "Note: {} requests generated fewer tokens than requested (ignore_eos/min_tokens not honoured?).",
            s.short_output_requests
        );
    }
    if !s.errors.is_empty() {
        let _ = writeln!(out, "Errors ({} failed requests):", s.failed);
        for e in &s.errors {
            let _ = writeln!(out, "  {:>6} × {}", e.count, e.error);
        }
    }
    out
}

/// One table with a row per rate of a sweep.
pub fn sweep_table(results: &[RunResult]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:>8} {:>6} {:>6} {:>9} {:>10} {:>9} {:>10} {:>9} {:>9} {:>9} {:>9}",
        "rate",
        "ok",
        "failed",
        "req/s",
        "out tok/s",
        "goodput",
        "TTFT mean",
        "TTFT p99",
        "TPOT mean",
        "TPOT p99",
        "ITL p99"
    );
    for r in results {
        let s: &Summary = &r.summary;
        let goodput = s.request_goodput.map_or_else(|| "-".to_string(), |g| format!("{g:.2}"));
        let _ = writeln!(
            out,
            "{:>8} {:>6} {:>6} {:>9.2} {:>10.2} {:>9} {:>10.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2}",
            s.request_rate.to_string(),
            s.completed,
            s.failed,
            s.request_throughput,
            s.output_throughput,
            goodput,
            s.ttft_ms.mean,
            s.ttft_ms.p99,
            s.tpot_ms.mean,
            s.tpot_ms.p99,
            s.itl_ms.p99
        );
    }
    out
}

/// Writes charts of `result` to `path`: `.html` (SVG embedded, with the
/// summary table) or `.png`.
pub fn write_report(result: &RunResult, path: &Path) -> Result<(), LoadtestError> {
    let ext = path.extension().map(|e| e.to_string_lossy().to_ascii_lowercase()).unwrap_or_default();
    match ext.as_str() {
        "html" | "htm" => {
            let svg = plot::render_svg(result)?;
            let html = format!(
                "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>baton-loadtest report</title></head>\n\
                 <body style=\"font-family:sans-serif\">\n<h1>baton-loadtest report</h1>\n\
                 <p>{} — model {} — started {}</p>\n<pre>{}</pre>\n{}\n</body></html>\n",
                escape(&result.config.base_url),
                escape(result.model.as_deref().unwrap_or("-")),
                escape(&result.started_at),
                escape(&summary_table(result)),
                svg
            );
            std::fs::write(path, html).map_err(|e| LoadtestError::io(path, e))
        }
        "png" => plot::render_png(result, path),
        _ => Err(LoadtestError::Config(format!("--report {}: use a .html or .png file name", path.display()))),
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

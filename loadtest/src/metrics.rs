//! Aggregate figures of a run, with `vllm bench serve`'s definitions.
//!
//! Only successful requests contribute to latency statistics and token totals;
//! failed ones are counted and their errors grouped. Throughputs divide by the
//! benchmark duration (first send to last response). ITL statistics pool every
//! gap of every request; TPOT statistics are per request and exclude
//! single-token outputs. Percentiles interpolate linearly between ranks, as
//! numpy's default does. Goodput counts requests meeting *all* given SLOs, a
//! single-token request's TPOT being 0.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::config::{Rate, Slo};
use crate::record::RequestRecord;
use crate::timeseries;

/// Distribution of one latency, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    /// Number of samples.
    pub count: usize,
    /// Arithmetic mean.
    pub mean: f64,
    /// Standard deviation (population).
    pub std: f64,
    /// 50th percentile.
    pub median: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest sample.
    pub max: f64,
}

impl Stats {
    /// Statistics of `samples_s` (seconds), reported in milliseconds; all zero
    /// when there are no samples.
    pub fn from_seconds(samples_s: impl IntoIterator<Item = f64>) -> Self {
        let mut ms: Vec<f64> = samples_s.into_iter().map(|s| s * 1000.0).collect();
        if ms.is_empty() {
            return Self::default();
        }
        ms.sort_by(f64::total_cmp);
        let n = ms.len() as f64;
        let mean = ms.iter().sum::<f64>() / n;
        let var = ms.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
        Self {
            count: ms.len(),
            mean,
            std: var.sqrt(),
            median: percentile(&ms, 50.0),
            p90: percentile(&ms, 90.0),
            p99: percentile(&ms, 99.0),
            max: ms[ms.len() - 1],
        }
    }
}

/// The `p`-th percentile of ascending `sorted`, linearly interpolated
/// (numpy's default); 0 for an empty slice.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (p / 100.0).clamp(0.0, 1.0) * (sorted.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
}

/// How often one error message occurred.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorCount {
    /// The error.
    pub error: String,
    /// Number of requests that failed with it.
    pub count: usize,
}

/// The figures of one run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Requests that completed.
    pub completed: usize,
    /// Requests that failed.
    pub failed: usize,
    /// The concurrency limit, if any.
    pub max_concurrency: Option<usize>,
    /// The requested arrival rate.
    pub request_rate: Rate,
    /// The arrival burstiness.
    pub burstiness: f64,
    /// First send to last response, seconds.
    pub duration_s: f64,
    /// Prompt tokens of completed requests.
    pub total_input_tokens: u64,
    /// Generated tokens of completed requests.
    pub total_output_tokens: u64,
    /// Completed requests per second.
    pub request_throughput: f64,
    /// Requests meeting every SLO, per second (`None` without SLOs).
    pub request_goodput: Option<f64>,
    /// The SLOs goodput was measured against.
    pub goodput_slo: Slo,
    /// Generated tokens per second.
    pub output_throughput: f64,
    /// Prompt plus generated tokens per second.
    pub total_token_throughput: f64,
    /// Highest generated tokens per second over any 1 s bucket.
    pub peak_output_throughput: f64,
    /// Most requests in flight at once.
    pub peak_concurrency: usize,
    /// Time to first token.
    pub ttft_ms: Stats,
    /// Time per output token, excluding the first.
    pub tpot_ms: Stats,
    /// Inter-token latency (every gap between content chunks).
    pub itl_ms: Stats,
    /// End-to-end latency.
    pub e2el_ms: Stats,
    /// Completed requests whose output length was estimated (no usage sent).
    pub estimated_output_requests: usize,
    /// Completed requests that generated fewer tokens than asked for (the
    /// server ignored `ignore_eos`/`min_tokens`, or it was disabled).
    #[serde(default)]
    pub short_output_requests: usize,
    /// Distinct errors of failed requests, most frequent first.
    pub errors: Vec<ErrorCount>,
}

/// Run parameters the summary repeats so it can be read on its own.
#[derive(Debug, Clone, Copy)]
pub struct RunShape {
    /// The requested arrival rate.
    pub request_rate: Rate,
    /// The arrival burstiness.
    pub burstiness: f64,
    /// The concurrency limit.
    pub max_concurrency: Option<usize>,
    /// Goodput objectives.
    pub slo: Slo,
}

impl Summary {
    /// Aggregates `records` of a run that lasted `duration_s` seconds.
    pub fn compute(records: &[RequestRecord], duration_s: f64, shape: RunShape) -> Self {
        let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.success).collect();
        let per_s = |x: f64| if duration_s > 0.0 { x / duration_s } else { 0.0 };
        let total_input_tokens: u64 = ok.iter().map(|r| r.input_tokens).sum();
        let total_output_tokens: u64 = ok.iter().map(|r| r.output_tokens).sum();
        let good = ok.iter().filter(|r| meets_slo(r, &shape.slo)).count();
        let mut errors: HashMap<&str, usize> = HashMap::new();
        for r in records.iter().filter(|r| !r.success) {
            *errors.entry(r.error.as_deref().unwrap_or("unknown error")).or_default() += 1;
        }
        let mut errors: Vec<ErrorCount> =
            errors.into_iter().map(|(error, count)| ErrorCount { error: error.to_string(), count }).collect();
        errors.sort_by(|a, b| b.count.cmp(&a.count).then_with(|| a.error.cmp(&b.error)));
        Self {
            completed: ok.len(),
            failed: records.len() - ok.len(),
            max_concurrency: shape.max_concurrency,
            request_rate: shape.request_rate,
            burstiness: shape.burstiness,
            duration_s,
            total_input_tokens,
            total_output_tokens,
            request_throughput: per_s(ok.len() as f64),
            request_goodput: (!shape.slo.is_empty()).then(|| per_s(good as f64)),
            goodput_slo: shape.slo,
            output_throughput: per_s(total_output_tokens as f64),
            total_token_throughput: per_s((total_input_tokens + total_output_tokens) as f64),
            peak_output_throughput: timeseries::output_throughput(records, 1.0).into_iter().fold(0.0, f64::max),
            peak_concurrency: timeseries::peak_concurrency(records),
            ttft_ms: Stats::from_seconds(ok.iter().filter_map(|r| r.ttft_s)),
            tpot_ms: Stats::from_seconds(ok.iter().filter_map(|r| r.tpot_s())),
            itl_ms: Stats::from_seconds(ok.iter().flat_map(|r| r.itl_s.iter().copied())),
            e2el_ms: Stats::from_seconds(ok.iter().map(|r| r.latency_s)),
            estimated_output_requests: ok.iter().filter(|r| r.output_tokens_estimated).count(),
            short_output_requests: ok.iter().filter(|r| r.output_tokens < r.requested_output_tokens).count(),
            errors,
        }
    }
}

fn meets_slo(r: &RequestRecord, slo: &Slo) -> bool {
    let within = |limit: Option<f64>, value_s: f64| limit.is_none_or(|ms| value_s * 1000.0 <= ms);
    within(slo.ttft_ms, r.ttft_s.unwrap_or(f64::INFINITY))
        && within(slo.tpot_ms, r.tpot_s().unwrap_or(0.0))
        && within(slo.e2el_ms, r.latency_s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(ttft: f64, latency: f64, tokens: u64, error: Option<&str>) -> RequestRecord {
        RequestRecord {
            index: 0,
            scheduled_s: 0.0,
            start_s: 0.0,
            end_s: latency,
            success: error.is_none(),
            error: error.map(String::from),
            input_tokens: 10,
            output_tokens: tokens,
            requested_output_tokens: tokens,
            output_tokens_estimated: false,
            ttft_s: Some(ttft),
            latency_s: latency,
            itl_s: vec![(latency - ttft) / (tokens.max(2) - 1) as f64; tokens.saturating_sub(1) as usize],
        }
    }

    fn shape(slo: Slo) -> RunShape {
        RunShape { request_rate: Rate::INFINITE, burstiness: 1.0, max_concurrency: None, slo }
    }

    #[test]
    fn percentiles_match_numpy_linear() {
        let xs = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&xs, 50.0), 2.5);
        assert!((percentile(&xs, 90.0) - 3.7).abs() < 1e-12);
        assert!((percentile(&xs, 99.0) - 3.97).abs() < 1e-12);
        assert_eq!(percentile(&[5.0], 99.0), 5.0);
        let s = Stats::from_seconds([0.001, 0.002, 0.003, 0.004]);
        assert!((s.mean - 2.5).abs() < 1e-9 && (s.max - 4.0).abs() < 1e-9);
        assert_eq!(Stats::from_seconds([]), Stats::default());
    }

    #[test]
    fn summary_counts_only_successes_and_groups_errors() {
        let records = vec![
            rec(0.1, 1.1, 11, None),
            rec(0.3, 2.3, 11, None),
            rec(0.0, 0.5, 0, Some("HTTP 500: boom")),
            rec(0.0, 0.5, 0, Some("HTTP 500: boom")),
            rec(0.0, 0.5, 0, Some("timed out after 1 s")),
        ];
        let s = Summary::compute(&records, 2.0, shape(Slo::default()));
        assert_eq!((s.completed, s.failed), (2, 3));
        assert_eq!(s.total_output_tokens, 22);
        assert_eq!(s.total_input_tokens, 20);
        assert!((s.request_throughput - 1.0).abs() < 1e-12);
        assert!((s.output_throughput - 11.0).abs() < 1e-12);
        assert!((s.total_token_throughput - 21.0).abs() < 1e-12);
        assert!((s.ttft_ms.mean - 200.0).abs() < 1e-9);
        // TPOTs are 100 ms and 200 ms.
        assert!((s.tpot_ms.mean - 150.0).abs() < 1e-9);
        assert_eq!(s.itl_ms.count, 20);
        assert_eq!(s.request_goodput, None);
        assert_eq!(s.short_output_requests, 0);
        let mut short = records.clone();
        short[0].requested_output_tokens = 20;
        let s2 = Summary::compute(&short, 2.0, shape(Slo::default()));
        assert_eq!(s2.short_output_requests, 1);
        assert_eq!(s.errors[0], ErrorCount { error: "HTTP 500: boom".into(), count: 2 });
        assert_eq!(s.errors.len(), 2);
    }

    #[test]
    fn goodput_needs_every_slo() {
        let records = vec![rec(0.1, 1.1, 11, None), rec(0.3, 2.3, 11, None), rec(0.1, 0.1, 1, None)];
        let slo = |s: &str| s.parse::<Slo>().expect("valid slo");
        let good = |s: &str| Summary::compute(&records, 1.0, shape(slo(s))).request_goodput;
        assert_eq!(good("ttft:200"), Some(2.0));
        assert_eq!(good("ttft:200 tpot:150"), Some(2.0));
        assert_eq!(good("ttft:400 tpot:150"), Some(2.0));
        assert_eq!(good("ttft:400 tpot:250"), Some(3.0));
        assert_eq!(good("e2el:1000"), Some(1.0));
    }
}

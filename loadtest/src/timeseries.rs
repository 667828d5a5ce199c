//! Throughput and concurrency over the course of a run.
//!
//! Derived from the per-request records only, so a saved results JSON can be
//! re-plotted. A request's output tokens are spread evenly over its content
//! chunks (exact when each chunk is one token, as with most servers).

use crate::record::RequestRecord;

/// Output tokens per second in consecutive buckets of `bucket_s` seconds,
/// starting at time zero, covering the whole run.
pub fn output_throughput(records: &[RequestRecord], bucket_s: f64) -> Vec<f64> {
    let end = records.iter().map(|r| r.end_s).fold(0.0, f64::max);
    if bucket_s <= 0.0 || end <= 0.0 {
        return Vec::new();
    }
    let buckets = (end / bucket_s).ceil().max(1.0) as usize;
    let mut tokens = vec![0.0; buckets];
    for r in records.iter().filter(|r| r.success) {
        let times = r.chunk_times_s();
        if times.is_empty() {
            continue;
        }
        let per_chunk = r.output_tokens as f64 / times.len() as f64;
        for t in times {
            let i = ((t / bucket_s) as usize).min(buckets - 1);
            tokens[i] += per_chunk;
        }
    }
    tokens.iter().map(|t| t / bucket_s).collect()
}

/// The number of requests in flight as a step function: `(time, count)` at
/// every change, in time order.
pub fn concurrency_steps(records: &[RequestRecord]) -> Vec<(f64, usize)> {
    let mut events: Vec<(f64, i64)> = records.iter().flat_map(|r| [(r.start_s, 1), (r.end_s, -1)]).collect();
    // Ends before starts at the same instant, so back-to-back requests on one
    // slot do not count twice.
    events.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let mut level: i64 = 0;
    events
        .into_iter()
        .map(|(t, d)| {
            level += d;
            (t, level.max(0) as usize)
        })
        .collect()
}

/// The largest number of requests in flight at once.
pub fn peak_concurrency(records: &[RequestRecord]) -> usize {
    concurrency_steps(records).into_iter().map(|(_, n)| n).max().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(start: f64, ttft: f64, itl: Vec<f64>, tokens: u64) -> RequestRecord {
        let latency = ttft + itl.iter().sum::<f64>();
        RequestRecord {
            index: 0,
            scheduled_s: start,
            start_s: start,
            end_s: start + latency,
            success: true,
            error: None,
            input_tokens: 1,
            output_tokens: tokens,
            requested_output_tokens: tokens,
            output_tokens_estimated: false,
            ttft_s: Some(ttft),
            latency_s: latency,
            itl_s: itl,
        }
    }

    #[test]
    fn throughput_buckets_count_chunks() {
        // Chunks at 0.5, 1.5, 1.7, 2.5 s; each carries one token.
        let r = rec(0.0, 0.5, vec![1.0, 0.2, 0.8], 4);
        let tput = output_throughput(&[r], 1.0);
        assert_eq!(tput, vec![1.0, 2.0, 1.0]);
        let halves = output_throughput(&[rec(0.0, 0.5, vec![1.0, 0.2, 0.8], 4)], 0.5);
        assert_eq!(halves.iter().sum::<f64>() * 0.5, 4.0);
    }

    #[test]
    fn concurrency_counts_overlaps_not_touching_intervals() {
        let a = rec(0.0, 1.0, vec![], 1);
        let b = rec(0.5, 1.0, vec![], 1);
        let c = rec(1.5, 1.0, vec![], 1); // starts exactly when b ends
        assert_eq!(peak_concurrency(&[a.clone(), b.clone()]), 2);
        assert_eq!(peak_concurrency(&[b, c]), 1);
        assert_eq!(concurrency_steps(&[a]), vec![(0.0, 1), (1.0, 0)]);
    }
}

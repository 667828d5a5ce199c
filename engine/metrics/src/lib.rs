//! baton-metrics: Prometheus metrics with vLLM's names, labels and histogram buckets, so
//! existing vLLM dashboards work against Baton unchanged. Shared by the frontend (`serve`,
//! `router`) and the workers, which render the same names for their own engine; a crate of
//! its own so a worker does not depend on the frontend for it.
//!
//! [`Metrics`] owns its own [`PrometheusRecorder`] instead of installing a global one: every
//! server (and every test) builds an independent registry, and building twice never fails.
//! Handles are registered once at construction with the `model_name` label, so recording on a
//! request path is a lock-free atomic update.
//!
//! Three sources feed it:
//! - request-level histograms and token counters are recorded by the frontend pipeline while
//!   requests run ([`Metrics::observe_ttft`] and friends);
//! - a worker records its KV hand-offs and the prompt tokens it computed
//!   ([`Metrics::observe_kv_transfer`], [`Metrics::add_prompt_tokens_computed`]);
//! - engine gauges and cumulative counters are copied from [`EngineStats`] at scrape time
//!   ([`Metrics::render`]); the engine itself records nothing.

use baton_core::api::{EngineStats, FinishReason};
use metrics::{Counter, Gauge, Histogram, Key, Label, Metadata, Recorder, Unit};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder};
use std::time::Duration;

/// Time to first token, seconds (histogram).
/// KV bytes moved between workers (Baton's own).
pub const KV_TRANSFER_BYTES: &str = "baton_kv_transfer_bytes_total";
/// Duration of one KV hand-off (Baton's own).
pub const KV_TRANSFER_SECONDS: &str = "baton_kv_transfer_seconds";
pub const TIME_TO_FIRST_TOKEN: &str = "vllm:time_to_first_token_seconds";
/// Time between consecutive output tokens of one sequence, seconds (histogram).
pub const INTER_TOKEN_LATENCY: &str = "vllm:inter_token_latency_seconds";
/// Arrival to last token, seconds (histogram).
pub const E2E_REQUEST_LATENCY: &str = "vllm:e2e_request_latency_seconds";
/// Requests in the running batch (gauge).
pub const NUM_REQUESTS_RUNNING: &str = "vllm:num_requests_running";
/// Requests waiting to be scheduled (gauge).
pub const NUM_REQUESTS_WAITING: &str = "vllm:num_requests_waiting";
/// Fraction of KV blocks in use, 0..=1 (gauge; vLLM's name despite the `perc`).
pub const KV_CACHE_USAGE: &str = "vllm:kv_cache_usage_perc";
/// Prompt tokens found in the prefix cache (counter; `_total` as prometheus_client renders it).
pub const PREFIX_CACHE_HITS: &str = "vllm:prefix_cache_hits_total";
/// Prompt tokens looked up in the prefix cache (counter).
pub const PREFIX_CACHE_QUERIES: &str = "vllm:prefix_cache_queries_total";
/// Preemptions (counter).
pub const NUM_PREEMPTIONS: &str = "vllm:num_preemptions_total";
/// Prompt tokens processed (counter).
pub const PROMPT_TOKENS: &str = "vllm:prompt_tokens_total";
/// Tokens generated (counter).
pub const GENERATION_TOKENS: &str = "vllm:generation_tokens_total";
/// Finished sequences by reason (counter with a `finished_reason` label).
pub const REQUEST_SUCCESS: &str = "vllm:request_success_total";
/// KV blocks referenced by some request (gauge).
pub const KV_BLOCKS_USED: &str = "baton_kv_blocks_used";
/// KV blocks in the pool (gauge).
pub const KV_BLOCKS_TOTAL: &str = "baton_kv_blocks_total";
/// Engine sequences admitted by the frontend and not finished (gauge; Baton's own). On a
/// worker: its Worker-service streams open.
pub const INFLIGHT: &str = "baton_router_inflight";
/// Tasks alive on the process's async runtime (gauge; Baton's own): flat under steady load,
/// back to its idle level when the load stops.
pub const RUNTIME_TASKS: &str = "baton_runtime_alive_tasks";
/// Prompt tokens this process's engine actually computed: not served from its prefix cache
/// and not received from another worker (counter; Baton's own). Summed over a cluster's
/// workers it shows whether a prompt was computed once or twice.
pub const PROMPT_TOKENS_COMPUTED: &str = "baton_prompt_tokens_computed_total";

/// vLLM's buckets for [`TIME_TO_FIRST_TOKEN`].
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
];
/// vLLM's buckets for [`INTER_TOKEN_LATENCY`].
pub const ITL_BUCKETS: &[f64] =
    &[0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];
/// vLLM's buckets for [`E2E_REQUEST_LATENCY`].
pub const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
];

/// The metric registry of one served model.
pub struct Metrics {
    handle: PrometheusHandle,
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    prompt_tokens: Counter,
    generation_tokens: Counter,
    success_stop: Counter,
    success_length: Counter,
    success_abort: Counter,
    running: Gauge,
    waiting: Gauge,
    kv_usage: Gauge,
    prefix_hits: Counter,
    prefix_queries: Counter,
    preemptions: Counter,
    kv_used: Gauge,
    kv_total: Gauge,
    kv_transfer_bytes: Counter,
    kv_transfer_seconds: Histogram,
    inflight: Gauge,
    runtime_tasks: Gauge,
    prompt_tokens_computed: Counter,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

static METADATA: Metadata<'static> = Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));

fn labels(model_name: &str) -> Vec<Label> {
    vec![Label::new("model_name", model_name.to_owned())]
}

/// The registry could not be built (only possible with an invalid bucket list).
#[derive(Debug, thiserror::Error)]
#[error("cannot build the metrics registry: {0}")]
pub struct MetricsError(#[from] metrics_exporter_prometheus::BuildError);

impl Metrics {
    /// A fresh, independent registry whose series carry `model_name="<model_name>"`.
    pub fn new(model_name: &str) -> Result<Self, MetricsError> {
        let mut builder = PrometheusBuilder::new();
        for (name, buckets) in [
            (TIME_TO_FIRST_TOKEN, TTFT_BUCKETS),
            (INTER_TOKEN_LATENCY, ITL_BUCKETS),
            (E2E_REQUEST_LATENCY, E2E_BUCKETS),
        ] {
            builder = builder.set_buckets_for_metric(Matcher::Full(name.to_owned()), buckets)?;
        }
        let recorder: PrometheusRecorder = builder.build_recorder();
        let handle = recorder.handle();
        let l = labels(model_name);

        let describe = |name: &'static str, unit: Option<Unit>, help: &'static str| {
            recorder.describe_histogram(name.into(), unit, help.into());
        };
        describe(TIME_TO_FIRST_TOKEN, Some(Unit::Seconds), "Histogram of time to first token in seconds.");
        describe(INTER_TOKEN_LATENCY, Some(Unit::Seconds), "Histogram of inter-token latency in seconds.");
        describe(E2E_REQUEST_LATENCY, Some(Unit::Seconds), "Histogram of e2e request latency in seconds.");
        describe(KV_TRANSFER_SECONDS, Some(Unit::Seconds), "Time of one KV hand-off, connect to acknowledgement.");
        let gauge_help = [
            (NUM_REQUESTS_RUNNING, "Number of requests in model execution batches."),
            (NUM_REQUESTS_WAITING, "Number of requests waiting to be processed."),
            (KV_CACHE_USAGE, "KV-cache usage. 1 means 100 percent usage."),
            (KV_BLOCKS_USED, "KV blocks referenced by some request."),
            (KV_BLOCKS_TOTAL, "KV blocks in the pool."),
            (INFLIGHT, "Engine sequences admitted and not finished (worker: streams open)."),
            (RUNTIME_TASKS, "Tasks alive on the async runtime."),
        ];
        for (name, help) in gauge_help {
            recorder.describe_gauge(name.into(), None, help.into());
        }
        let counter_help = [
            (PREFIX_CACHE_HITS, "Prefix cache hits, in terms of number of cached tokens."),
            (PREFIX_CACHE_QUERIES, "Prefix cache queries, in terms of number of queried tokens."),
            (NUM_PREEMPTIONS, "Cumulative number of preemptions from the engine."),
            (PROMPT_TOKENS, "Number of prefill tokens processed."),
            (GENERATION_TOKENS, "Number of generation tokens processed."),
            (REQUEST_SUCCESS, "Count of successfully processed requests."),
            (KV_TRANSFER_BYTES, "KV-cache bytes moved between workers (sent by prefill, received by decode)."),
            (PROMPT_TOKENS_COMPUTED, "Prompt tokens computed here (not cached, not received)."),
        ];
        for (name, help) in counter_help {
            recorder.describe_counter(name.into(), None, help.into());
        }

        let histogram = |name: &'static str| recorder.register_histogram(&Key::from_parts(name, l.clone()), &METADATA);
        let counter = |name: &'static str| recorder.register_counter(&Key::from_parts(name, l.clone()), &METADATA);
        let gauge = |name: &'static str| recorder.register_gauge(&Key::from_parts(name, l.clone()), &METADATA);
        let success = |reason: &'static str| {
            let mut with_reason = l.clone();
            with_reason.push(Label::new("finished_reason", reason));
            recorder.register_counter(&Key::from_parts(REQUEST_SUCCESS, with_reason), &METADATA)
        };

        Ok(Self {
            ttft: histogram(TIME_TO_FIRST_TOKEN),
            itl: histogram(INTER_TOKEN_LATENCY),
            e2e: histogram(E2E_REQUEST_LATENCY),
            prompt_tokens: counter(PROMPT_TOKENS),
            generation_tokens: counter(GENERATION_TOKENS),
            success_stop: success("stop"),
            success_length: success("length"),
            success_abort: success("abort"),
            running: gauge(NUM_REQUESTS_RUNNING),
            waiting: gauge(NUM_REQUESTS_WAITING),
            kv_usage: gauge(KV_CACHE_USAGE),
            prefix_hits: counter(PREFIX_CACHE_HITS),
            prefix_queries: counter(PREFIX_CACHE_QUERIES),
            preemptions: counter(NUM_PREEMPTIONS),
            kv_used: gauge(KV_BLOCKS_USED),
            kv_total: gauge(KV_BLOCKS_TOTAL),
            kv_transfer_bytes: counter(KV_TRANSFER_BYTES),
            kv_transfer_seconds: histogram(KV_TRANSFER_SECONDS),
            inflight: gauge(INFLIGHT),
            runtime_tasks: gauge(RUNTIME_TASKS),
            prompt_tokens_computed: counter(PROMPT_TOKENS_COMPUTED),
            handle,
        })
    }

    /// Records the time from arrival to a sequence's first token.
    pub fn observe_ttft(&self, d: Duration) {
        self.ttft.record(d.as_secs_f64());
    }

    /// Records the gap between two consecutive tokens of one sequence.
    pub fn observe_itl(&self, d: Duration) {
        self.itl.record(d.as_secs_f64());
    }

    /// Records a finished sequence: its end-to-end latency and why it finished.
    pub fn observe_finished(&self, e2e: Duration, reason: FinishReason) {
        self.e2e.record(e2e.as_secs_f64());
        match reason {
            FinishReason::Stop => self.success_stop.increment(1),
            FinishReason::Length => self.success_length.increment(1),
            FinishReason::Abort => self.success_abort.increment(1),
        }
    }

    /// Counts prompt tokens of an accepted request.
    pub fn add_prompt_tokens(&self, n: usize) {
        self.prompt_tokens.increment(n as u64);
    }

    /// Counts generated tokens.
    pub fn add_generation_tokens(&self, n: usize) {
        self.generation_tokens.increment(n as u64);
    }

    /// Counts prompt tokens this process's engine computed itself.
    pub fn add_prompt_tokens_computed(&self, n: usize) {
        self.prompt_tokens_computed.increment(n as u64);
    }

    /// Sets the process's own load gauges before a scrape: work admitted and not finished,
    /// and tasks alive on the runtime.
    pub fn set_process_load(&self, inflight: usize, runtime_tasks: usize) {
        self.inflight.set(inflight as f64);
        self.runtime_tasks.set(runtime_tasks as f64);
    }

    /// Records one finished KV hand-off.
    pub fn observe_kv_transfer(&self, bytes: usize, d: Duration) {
        self.kv_transfer_bytes.increment(bytes as u64);
        self.kv_transfer_seconds.record(d.as_secs_f64());
    }

    /// Copies the engine's load report into the gauges and cumulative counters, then renders the
    /// Prometheus text exposition.
    pub fn render(&self, stats: &EngineStats) -> String {
        self.running.set(stats.num_running as f64);
        self.waiting.set(stats.num_waiting as f64);
        let usage = if stats.num_total_blocks == 0 {
            0.0
        } else {
            stats.num_used_blocks as f64 / stats.num_total_blocks as f64
        };
        self.kv_usage.set(usage);
        self.kv_used.set(stats.num_used_blocks as f64);
        self.kv_total.set(stats.num_total_blocks as f64);
        self.prefix_hits.absolute(stats.prefix_cache_hits);
        self.prefix_queries.absolute(stats.prefix_cache_queries);
        self.preemptions.absolute(stats.num_preemptions);
        self.handle.run_upkeep();
        self.handle.render()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(text: &str, series: &str) -> Option<f64> {
        text.lines()
            .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    }

    #[test]
    fn renders_vllm_names_with_colons_labels_and_buckets() {
        let m = Metrics::new("tiny").expect("metrics");
        m.observe_ttft(Duration::from_millis(30));
        m.observe_itl(Duration::from_millis(12));
        m.observe_finished(Duration::from_millis(700), FinishReason::Length);
        m.add_prompt_tokens(7);
        m.add_generation_tokens(5);
        m.add_prompt_tokens_computed(6);
        m.set_process_load(3, 42);
        let stats = EngineStats {
            num_running: 2,
            num_waiting: 3,
            num_used_blocks: 4,
            num_total_blocks: 16,
            prefix_cache_queries: 100,
            prefix_cache_hits: 40,
            num_preemptions: 1,
        };
        let text = m.render(&stats);
        let lbl = r#"{model_name="tiny"}"#;
        assert_eq!(sample(&text, &format!("{NUM_REQUESTS_RUNNING}{lbl}")), Some(2.0), "{text}");
        assert_eq!(sample(&text, &format!("{NUM_REQUESTS_WAITING}{lbl}")), Some(3.0));
        assert_eq!(sample(&text, &format!("{KV_CACHE_USAGE}{lbl}")), Some(0.25));
        assert_eq!(sample(&text, &format!("{KV_BLOCKS_USED}{lbl}")), Some(4.0));
        assert_eq!(sample(&text, &format!("{KV_BLOCKS_TOTAL}{lbl}")), Some(16.0));
        assert_eq!(sample(&text, &format!("{PREFIX_CACHE_HITS}{lbl}")), Some(40.0));
        assert_eq!(sample(&text, &format!("{PREFIX_CACHE_QUERIES}{lbl}")), Some(100.0));
        assert_eq!(sample(&text, &format!("{NUM_PREEMPTIONS}{lbl}")), Some(1.0));
        assert_eq!(sample(&text, &format!("{PROMPT_TOKENS}{lbl}")), Some(7.0));
        assert_eq!(sample(&text, &format!("{GENERATION_TOKENS}{lbl}")), Some(5.0));
        assert_eq!(sample(&text, &format!("{PROMPT_TOKENS_COMPUTED}{lbl}")), Some(6.0));
        assert_eq!(sample(&text, &format!("{INFLIGHT}{lbl}")), Some(3.0));
        assert_eq!(sample(&text, &format!("{RUNTIME_TASKS}{lbl}")), Some(42.0));
        // 30 ms lands in the 0.04 bucket but not the 0.02 one: vLLM's bucket edges are in use.
        let ttft = |le: &str| {
            sample(&text, &format!("vllm:time_to_first_token_seconds_bucket{{model_name=\"tiny\",le=\"{le}\"}}"))
        };
        assert_eq!(ttft("0.02"), Some(0.0), "{text}");
        assert_eq!(ttft("0.04"), Some(1.0));
        assert_eq!(ttft("2560"), Some(1.0));
        let e2e_count = sample(&text, &format!("vllm:e2e_request_latency_seconds_count{lbl}"));
        assert_eq!(e2e_count, Some(1.0));
        let success = r#"vllm:request_success_total{model_name="tiny",finished_reason="length"}"#;
        assert_eq!(sample(&text, success), Some(1.0));
        assert!(text.contains("# TYPE vllm:inter_token_latency_seconds histogram"), "{text}");
    }

    #[test]
    fn two_registries_are_independent() {
        let a = Metrics::new("a").expect("metrics");
        let b = Metrics::new("b").expect("metrics");
        a.add_prompt_tokens(3);
        let stats = EngineStats::default();
        let text_b = b.render(&stats);
        assert_eq!(sample(&text_b, r#"vllm:prompt_tokens_total{model_name="b"}"#), Some(0.0), "{text_b}");
        assert!(!text_b.contains(r#"model_name="a""#));
        // An empty pool reports 0 usage instead of NaN.
        assert_eq!(sample(&text_b, r#"vllm:kv_cache_usage_perc{model_name="b"}"#), Some(0.0));
    }
}

//! Measured TTFT, TPOT, ITL, latency and throughput against a server whose
//! delays are known, at several concurrencies. Delays are ≥ 20 ms and the
//! tolerances allow for a noisy 2-core CI machine: lower bounds are strict
//! (a client cannot see a token before it is sent), upper bounds leave room
//! for scheduling jitter.

mod common;

use baton_loadtest::{BackendKind, DatasetConfig, Rate, RunConfig, run};
use common::{Script, start};

const TTFT_MS: f64 = 60.0;
const ITL_MS: f64 = 25.0;
const TOKENS: usize = 8;

fn config(base_url: &str, prompts: std::path::PathBuf, n: usize, concurrency: usize) -> RunConfig {
    let mut c =
        RunConfig::new(BackendKind::Openai, base_url, DatasetConfig::Prompts { path: prompts, output_len: TOKENS });
    c.num_prompts = n;
    c.max_concurrency = Some(concurrency);
    c.request_rate = Rate::INFINITE;
    c
}

fn in_range(name: &str, value: f64, lo: f64, hi: f64) {
    assert!((lo..=hi).contains(&value), "{name} = {value:.2}, expected within [{lo:.2}, {hi:.2}]");
}

async fn check_timings(concurrency: usize, n: usize) {
    let server = start(Script::new(TTFT_MS as u64, ITL_MS as u64)).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = config(&server.base_url, common::prompts_file(&dir, n), n, concurrency);
    let result = run(&cfg).await.expect("run completes");
    let s = &result.summary;
    assert_eq!((s.completed, s.failed), (n, 0), "errors: {:?}", s.errors);
    assert_eq!(result.records.len(), n);
    assert_eq!(s.total_output_tokens, (n * TOKENS) as u64);
    assert_eq!(s.estimated_output_requests, 0);
    assert_eq!(s.short_output_requests, 0);
    assert!(result.records.iter().all(|r| r.requested_output_tokens == TOKENS as u64));

    let latency_ms = TTFT_MS + (TOKENS - 1) as f64 * ITL_MS;
    in_range("TTFT median", s.ttft_ms.median, TTFT_MS, TTFT_MS + 20.0);
    in_range("TTFT mean", s.ttft_ms.mean, TTFT_MS, TTFT_MS + 25.0);
    // TPOT spans the whole decode, so per-chunk jitter averages out.
    in_range("TPOT mean", s.tpot_ms.mean, ITL_MS - 4.0, ITL_MS + 5.0);
    in_range("TPOT median", s.tpot_ms.median, ITL_MS - 4.0, ITL_MS + 5.0);
    assert_eq!(s.itl_ms.count, n * (TOKENS - 1));
    in_range("ITL mean", s.itl_ms.mean, ITL_MS - 4.0, ITL_MS + 5.0);
    in_range("ITL median", s.itl_ms.median, ITL_MS - 8.0, ITL_MS + 8.0);
    in_range("E2EL mean", s.e2el_ms.mean, latency_ms, latency_ms + 40.0);

    // Requests run in n / C back-to-back waves of one latency each.
    let ideal_duration_s = (n / concurrency) as f64 * latency_ms / 1000.0;
    let ideal_rps = n as f64 / ideal_duration_s;
    in_range("request throughput", s.request_throughput, 0.7 * ideal_rps, 1.02 * ideal_rps);
    in_range(
        "output throughput",
        s.output_throughput,
        0.7 * ideal_rps * TOKENS as f64,
        1.02 * ideal_rps * TOKENS as f64,
    );
    assert_eq!(s.peak_concurrency, concurrency);
    assert_eq!(server.observed.max_in_flight.load(std::sync::atomic::Ordering::SeqCst), concurrency);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timings_match_script_concurrency_1() {
    check_timings(1, 6).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timings_match_script_concurrency_4() {
    check_timings(4, 16).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timings_match_script_concurrency_16() {
    check_timings(16, 32).await;
}

/// Chat streams start with a role-only delta; TTFT must wait for content.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_ttft_ignores_role_only_chunk() {
    let server = start(Script::new(TTFT_MS as u64, ITL_MS as u64)).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = config(&server.base_url, common::prompts_file(&dir, 4), 4, 4);
    cfg.backend = BackendKind::OpenaiChat;
    let result = run(&cfg).await.expect("run completes");
    let s = &result.summary;
    assert_eq!((s.completed, s.failed), (4, 0), "errors: {:?}", s.errors);
    in_range("chat TTFT min", s.ttft_ms.median, TTFT_MS, TTFT_MS + 20.0);
    assert_eq!(s.total_output_tokens, 4 * TOKENS as u64);
    let body = &server.observed.bodies.lock().expect("lock")[0];
    assert_eq!(body["max_completion_tokens"], TOKENS);
    assert_eq!(body["messages"][0]["role"], "user");
}

/// Arrivals follow the seeded schedule: each request is sent at its planned
/// time (no concurrency limit), and the gaps have the requested mean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sends_follow_the_arrival_schedule() {
    let server = start(Script::new(20, 20)).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let n = 60;
    let mut cfg = config(&server.base_url, common::prompts_file(&dir, n), n, 1);
    cfg.max_concurrency = None;
    cfg.request_rate = Rate::per_second(40.0).expect("rate");
    cfg.seed = 11;
    cfg.dataset = DatasetConfig::Prompts { path: common::prompts_file(&dir, n), output_len: 2 };
    let result = run(&cfg).await.expect("run completes");
    let planned: Vec<f64> = baton_loadtest::arrival::ArrivalSchedule::new(cfg.request_rate, 1.0, cfg.seed)
        .expect("schedule")
        .take(n)
        .collect();
    for (r, want) in result.records.iter().zip(&planned) {
        assert!((r.scheduled_s - want).abs() < 1e-12);
        in_range("send lag (s)", r.start_s - r.scheduled_s, 0.0, 0.03);
    }
    assert!(result.summary.failed == 0);
}

/// Tokens whose text is empty still arrive as chunks (Baton and vLLM send them): they are
/// timed as tokens, and the request succeeds with empty text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_text_tokens_are_timed_and_succeed() {
    for chat in [false, true] {
        let server = start(Script { text: common::Text::Empty, ..Script::new(TTFT_MS as u64, ITL_MS as u64) }).await;
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cfg = config(&server.base_url, common::prompts_file(&dir, 4), 4, 4);
        if chat {
            cfg.backend = BackendKind::OpenaiChat;
        }
        let result = run(&cfg).await.expect("run completes");
        let s = &result.summary;
        assert_eq!((s.completed, s.failed), (4, 0), "chat {chat}: errors {:?}", s.errors);
        in_range("TTFT", s.ttft_ms.median, TTFT_MS, TTFT_MS + 20.0);
        // Every empty-text token is a timed chunk (the chunk that only ends the choice is not).
        assert_eq!(s.itl_ms.count, 4 * (TOKENS - 1), "chat {chat}");
        in_range("ITL mean", s.itl_ms.mean, ITL_MS - 4.0, ITL_MS + 5.0);
        assert_eq!(s.total_output_tokens, 4 * TOKENS as u64);
    }
}

/// A server that counts tokens in `usage` but sends no token chunk at all: a success with
/// empty text (as vLLM's benchmark counts it), its TTFT the chunk that ended the choice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_with_usage_but_no_token_chunks_succeeds_with_empty_text() {
    let server = start(Script { text: common::Text::FinishOnly, ..Script::new(TTFT_MS as u64, ITL_MS as u64) }).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = config(&server.base_url, common::prompts_file(&dir, 3), 3, 3);
    let result = run(&cfg).await.expect("run completes");
    let s = &result.summary;
    assert_eq!((s.completed, s.failed), (3, 0), "errors {:?}", s.errors);
    let end_ms = TTFT_MS + (TOKENS - 1) as f64 * ITL_MS;
    in_range("TTFT (the finishing chunk)", s.ttft_ms.median, end_ms, end_ms + 20.0);
    assert_eq!(s.total_output_tokens, 3 * TOKENS as u64);
    // Without a usage count, nothing says any token was generated: a failure.
    let server = start(Script {
        text: common::Text::FinishOnly,
        send_usage: false,
        ..Script::new(TTFT_MS as u64, ITL_MS as u64)
    })
    .await;
    let cfg = config(&server.base_url, common::prompts_file(&dir, 2), 2, 2);
    let result = run(&cfg).await.expect("run completes");
    assert_eq!((result.summary.completed, result.summary.failed), (0, 2));
}

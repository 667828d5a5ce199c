//! End to end: `baton serve` on CPU with a tiny random Llama, driven by
//! `baton-loadtest`'s library API. Every request must complete, the output
//! lengths must be those asked for (`ignore_eos`/`min_tokens` honoured), and
//! the results JSON must hold the config, one full record per request and the
//! summary.

#[path = "common/port.rs"]
mod port;
use port::free_port;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use baton_formats::testing::{TinySpec, write_hf_folder};
use baton_loadtest::{BackendKind, DatasetConfig, RunConfig, RunResult};

/// Long enough for a debug build to load a tiny model on a busy 2-core box.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(120);

/// A `baton serve` child process, killed when dropped.
struct Serve {
    child: Child,
    log: PathBuf,
    http: String,
    grpc: String,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Serve {
    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

async fn start_serve(dir: &Path) -> (Serve, PathBuf) {
    let model_dir = dir.join("model");
    write_hf_folder(&model_dir, &TinySpec::llama()).expect("write tiny model");
    let (port, grpc_port) = (free_port(), free_port());
    let log = dir.join("serve.log");
    let log_file = std::fs::File::create(&log).expect("create log");
    let child = Command::new(env!("CARGO_BIN_EXE_baton"))
        .arg("serve")
        .arg("--model")
        .arg(&model_dir)
        .args(["--device", "cpu", "--host", "127.0.0.1"])
        .args(["--port", &port.to_string(), "--grpc-port", &grpc_port.to_string()])
        .stdout(Stdio::null())
        .stderr(log_file)
        .spawn()
        .expect("spawn baton serve");
    let mut serve =
        Serve { child, log, http: format!("http://127.0.0.1:{port}"), grpc: format!("http://127.0.0.1:{grpc_port}") };
    let client = reqwest::Client::new();
    let deadline = Instant::now() + STARTUP_TIMEOUT;
    loop {
        if let Ok(Some(status)) = serve.child.try_wait() {
            panic!("baton serve exited early ({status}):\n{}", serve.log_text());
        }
        let healthy = client.get(format!("{}/health", serve.http)).send().await.is_ok_and(|r| r.status().is_success());
        if healthy {
            break;
        }
        assert!(Instant::now() < deadline, "baton serve not healthy after {STARTUP_TIMEOUT:?}:\n{}", serve.log_text());
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    (serve, model_dir)
}

fn config(backend: BackendKind, base_url: &str, model_dir: &Path, n: usize) -> RunConfig {
    let mut c =
        RunConfig::new(backend, base_url, DatasetConfig::Random { input_len: 16, output_len: 8, range_ratio: 0.25 });
    c.tokenizer = Some(model_dir.join("tokenizer.json"));
    c.num_prompts = n;
    c.max_concurrency = Some(8);
    c.request_timeout_s = Some(120.0);
    c.seed = 1;
    c
}

fn check_complete(result: &RunResult, n: usize, log: &str) {
    let s = &result.summary;
    assert_eq!((s.completed, s.failed), (n, 0), "errors: {:?}\nserver log:\n{log}", s.errors);
    assert_eq!(result.records.len(), n);
    for (i, r) in result.records.iter().enumerate() {
        assert_eq!(r.index, i);
        assert!(r.success && r.error.is_none());
        assert!(r.ttft_s.is_some_and(|t| t > 0.0 && t <= r.latency_s));
        assert!((12..=20).contains(&r.input_tokens), "input {}", r.input_tokens);
        // ignore_eos + min_tokens: exactly the requested 6..=10 tokens.
        assert!((6..=10).contains(&r.output_tokens), "output {}", r.output_tokens);
        assert!(!r.output_tokens_estimated, "server sent no usage");
        assert_eq!(r.output_tokens, r.requested_output_tokens);
        // A chunk carries at least one token.
        assert!((r.itl_s.len() as u64) < r.output_tokens);
    }
    assert_eq!(s.total_output_tokens, result.records.iter().map(|r| r.output_tokens).sum::<u64>());
    assert_eq!(s.short_output_requests, 0);
    assert!(s.ttft_ms.count == n && s.e2el_ms.count == n && s.request_throughput > 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loadtest_drives_50_openai_requests_through_serve() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (serve, model_dir) = start_serve(dir.path()).await;
    let cfg = config(BackendKind::Openai, &serve.http, &model_dir, 50);
    let result = baton_loadtest::run(&cfg).await.expect("load test runs");
    check_complete(&result, 50, &serve.log_text());

    let out = dir.path().join("results.json");
    result.save(&out).expect("write results");
    let saved = RunResult::load(&out).expect("results JSON reads back");
    assert_eq!(saved.config, result.config);
    assert_eq!(saved.records.len(), result.records.len());
    assert_eq!(saved.summary.completed, result.summary.completed);
    assert_eq!(saved.summary.total_output_tokens, result.summary.total_output_tokens);
    // Floats go through decimal text, so they agree to within rounding.
    for (a, b) in saved.records.iter().zip(&result.records) {
        assert_eq!((a.index, a.output_tokens, a.itl_s.len()), (b.index, b.output_tokens, b.itl_s.len()));
        assert!((a.latency_s - b.latency_s).abs() < 1e-9);
    }
    let raw: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).expect("read")).expect("json");
    for key in ["config", "summary", "records", "model", "started_at"] {
        assert!(!raw[key].is_null(), "results JSON lacks {key}");
    }
    assert_eq!(raw["records"].as_array().map(Vec::len), Some(50));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loadtest_drives_chat_and_grpc_through_serve() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (serve, model_dir) = start_serve(dir.path()).await;
    let chat = config(BackendKind::OpenaiChat, &serve.http, &model_dir, 10);
    let result = baton_loadtest::run(&chat).await.expect("chat load test runs");
    let s = &result.summary;
    assert_eq!((s.completed, s.failed), (10, 0), "chat errors: {:?}\n{}", s.errors, serve.log_text());

    let grpc = config(BackendKind::Grpc, &serve.grpc, &model_dir, 10);
    let result = baton_loadtest::run(&grpc).await.expect("gRPC load test runs");
    check_complete(&result, 10, &serve.log_text());
}

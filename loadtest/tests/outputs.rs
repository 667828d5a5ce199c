//! Files and console output: `--out` JSON (config, records, summary), the
//! HTML and PNG reports, `compare`, sweeps, and the binary's errors on bad
//! input.

mod common;

use baton_loadtest::cli::{Cli, execute};
use baton_loadtest::{LoadtestError, RunResult};
use clap::Parser;
use common::{Script, start};

fn cli(args: &[&str]) -> Cli {
    Cli::try_parse_from(std::iter::once("baton-loadtest").chain(args.iter().copied())).expect("valid flags")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_writes_json_html_png_and_compares() {
    let server = start(Script::new(20, 20)).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let prompts = common::prompts_file(&dir, 6);
    let path = |name: &str| dir.path().join(name).display().to_string();
    let base = [
        "--base-url",
        &server.base_url,
        "--dataset",
        "prompts",
        "--dataset-path",
        prompts.to_str().expect("utf-8 path"),
        "--output-len",
        "4",
        "--num-prompts",
        "6",
        "--no-progress",
        "--goodput",
        "ttft:5000",
    ];
    let mut a_args = base.to_vec();
    let (a_json, a_html, b_json, b_png) = (path("a.json"), path("a.html"), path("b.json"), path("b.png"));
    a_args.extend(["--max-concurrency", "1", "--out", &a_json, "--report", &a_html]);
    let table = execute(&cli(&a_args)).await.expect("run a");
    for line in [
        "============ Serving Benchmark Result ============",
        "Successful requests:                     6",
        "Request goodput (req/s):",
        "---------------Time to First Token----------------",
        "Mean TPOT (ms):",
        "P99 ITL (ms):",
        "Max E2EL (ms):",
    ] {
        assert!(table.contains(line), "missing `{line}` in\n{table}");
    }
    let mut b_args = base.to_vec();
    b_args.extend(["--max-concurrency", "6", "--out", &b_json, "--report", &b_png]);
    execute(&cli(&b_args)).await.expect("run b");

    let a = RunResult::load(std::path::Path::new(&a_json)).expect("a.json parses");
    assert_eq!(a.tool, "baton-loadtest");
    assert_eq!(a.records.len(), 6);
    assert_eq!(a.config.max_concurrency, Some(1));
    assert_eq!(a.summary.completed, 6);
    assert_eq!(a.summary.total_output_tokens, 24);
    assert!(a.records.iter().all(|r| r.ttft_s.is_some() && r.itl_s.len() == 3));
    let raw: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&a_json).expect("read")).expect("json");
    assert_eq!(raw["config"]["request_rate"], "inf");
    assert!(raw["summary"]["ttft_ms"]["p99"].is_number());

    let html = std::fs::read_to_string(&a_html).expect("html written");
    assert!(html.contains("<svg") && html.contains("TTFT CDF") && html.contains("Serving Benchmark Result"));
    let png = std::fs::read(&b_png).expect("png written");
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 10_000);

    let cmp = execute(&cli(&["compare", &a_json, &b_json])).await.expect("compare");
    assert!(cmp.contains("B/A") && cmp.contains("Request throughput (req/s)"), "{cmp}");
    // Six at once finish several times sooner than one at a time.
    let b = RunResult::load(std::path::Path::new(&b_json)).expect("b.json parses");
    assert!(b.summary.request_throughput > 2.0 * a.summary.request_throughput);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweep_prints_one_row_per_rate_and_writes_per_rate_files() {
    let server = start(Script::new(20, 20)).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let prompts = common::prompts_file(&dir, 4);
    let out = dir.path().join("sweep.json");
    let table = execute(&cli(&[
        "--base-url",
        &server.base_url,
        "--dataset",
        "prompts",
        "--dataset-path",
        prompts.to_str().expect("utf-8 path"),
        "--output-len",
        "2",
        "--num-prompts",
        "4",
        "--no-progress",
        "--sweep",
        "20,inf",
        "--out",
        out.to_str().expect("utf-8 path"),
    ]))
    .await
    .expect("sweep");
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 3, "{table}");
    assert!(lines[1].trim_start().starts_with("20 ") && lines[2].trim_start().starts_with("inf "));
    for name in ["sweep-rate20.json", "sweep-rateinf.json"] {
        let r = RunResult::load(&dir.path().join(name)).expect("per-rate file");
        assert_eq!(r.summary.completed, 4);
    }
}

#[tokio::test]
async fn compare_of_missing_or_bad_files_fails_clearly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "[]").expect("write");
    let missing = dir.path().join("missing.json");
    let err = execute(&cli(&["compare", missing.to_str().expect("p"), bad.to_str().expect("p")]))
        .await
        .expect_err("missing file");
    assert!(matches!(err, LoadtestError::Io { .. }), "{err:?}");
    let err =
        execute(&cli(&["compare", bad.to_str().expect("p"), bad.to_str().expect("p")])).await.expect_err("bad file");
    assert!(matches!(err, LoadtestError::Json { .. }), "{err:?}");
}

#[test]
fn binary_rejects_bad_input_with_clear_messages() {
    let bin = env!("CARGO_BIN_EXE_baton-loadtest");
    let out = std::process::Command::new(bin).args(["--request-rate", "soon"]).output().expect("run binary");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("not a rate"), "{stderr}");

    let out = std::process::Command::new(bin)
        .args(["--model", "m", "--dataset", "prompts", "--dataset-path", "/nonexistent/prompts.txt"])
        .output()
        .expect("run binary");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("/nonexistent/prompts.txt"), "{stderr}");

    let out = std::process::Command::new(bin)
        .args(["--tokenizer", "/nonexistent/tokenizer.json"])
        .output()
        .expect("run binary");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("tokenizer: /nonexistent/tokenizer.json"), "{stderr}");

    let out = std::process::Command::new(bin).arg("--help").output().expect("run binary");
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in ["--request-rate", "--burstiness", "--max-concurrency", "--goodput", "--sweep", "--report"] {
        assert!(help.contains(flag), "help lacks {flag}");
    }
}

/// The load tester must start on a bare machine: no fontconfig or freetype among the shared
/// libraries it needs (its charts use a font compiled into the binary).
#[test]
fn the_binary_needs_no_system_font_libraries() {
    let bin = env!("CARGO_BIN_EXE_baton-loadtest");
    let out = std::process::Command::new("ldd").arg(bin).output().expect("ldd runs (glibc Linux)");
    let libs = String::from_utf8_lossy(&out.stdout);
    assert!(libs.contains("libc.so"), "ldd listed no libraries: {libs}");
    for lib in ["fontconfig", "freetype", "expat"] {
        assert!(!libs.contains(lib), "baton-loadtest links {lib}:\n{libs}");
    }
}
